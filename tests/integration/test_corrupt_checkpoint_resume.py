"""Fault 4 (issue 13): a flipped byte in a shard of the newest checkpoint. Under ``ckpt_path="last"`` the
damage is found before anything is loaded, reported with the checkpoint and the file, and the run resumes
from the newest checkpoint that is intact; it then ends with the uninterrupted run's parameters bit for
bit. When every checkpoint is damaged the fit refuses with one error naming them (it never trains from
step 0 while it was asked to resume). Real processes: a TP2 Trainer on two forked ranks, gloo, Lightning's
ModelCheckpoint, real files.
"""

import logging
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from megatron_lite.core.checkpoint.errors import CorruptCheckpointError
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "distributed"))
sys.path.insert(0, str(HERE))
from parity_utils import run  # noqa: E402
from reliability_record import record  # noqa: E402

STEPS = 8


class StartTime(L.Callback):
    """Rank 0 writes when training starts (after a resume: once the checkpoint is loaded)."""

    def __init__(self, out: Path):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(repr(time.time()))


def _checkpoints(directory: Path, save_last: bool) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1, save_last=save_last)


def _logged(out: Path, fn):
    """Run ``fn()`` with megatron-lite's log records also written to ``out`` (the forked ranks inherit the
    handler); returns its result and the log."""
    handler = logging.FileHandler(out)
    logger = logging.getLogger("megatron_lite")
    logger.addHandler(handler)
    try:
        result = fn()
    finally:
        logger.removeHandler(handler)
        handler.close()
    return result, out.read_text()


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("save_last", [False, True])
def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_to_the_previous_valid_one(tmp_path, save_last):
    ckpt = tmp_path / "ckpt"
    run(tmp_path / "first", devices=2, tp=2, steps=6, callbacks=[_checkpoints(ckpt, save_last)])
    newest = ckpt / ("last.ckpt" if save_last else "epoch=0-step=6.ckpt")
    # the newest checkpoint by its commit; with save_last its predecessor holds the same step (ModelCheckpoint
    # writes epoch=0-step=6.ckpt, then last.ckpt), without it the previous one is step 4
    fallback, fallback_step = (ckpt / "epoch=0-step=6.ckpt", 6) if save_last else (ckpt / "epoch=0-step=4.ckpt", 4)
    shard = newest / "__1_0.distcp"  # written by rank 1
    _flip_byte(shard)

    faulted = time.time()
    resumed, log = _logged(
        tmp_path / "log.txt",
        lambda: run(
            tmp_path / "resumed",
            devices=2,
            tp=2,
            steps=STEPS,
            ckpt_path="last",
            callbacks=[_checkpoints(ckpt, save_last), StartTime(tmp_path / "started")],
        ),
    )
    recover_s = float((tmp_path / "started").read_text()) - faulted  # to training again, start-up included
    # reported with the checkpoint and the file, and why
    assert f"{newest}: __1_0.distcp: checksum mismatch" in log, log
    assert f"Resuming the newest valid one, {fallback}." in log
    assert len(resumed["losses"]) == STEPS - fallback_step  # it started at the fallback's step
    assert newest.is_dir()  # the damaged checkpoint is left for a person to look at, not deleted ...
    assert read_checkpoint_meta(ckpt / "epoch=0-step=8.ckpt")["global_step"] == STEPS  # ... and training went on

    reference = run(tmp_path / "reference", devices=2, tp=2, steps=STEPS)
    assert resumed["losses"] == reference["losses"][fallback_step:]
    for name, value in reference["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    if not save_last:
        record(
            "4-corrupt-shard",
            "one byte flipped in a shard of the newest checkpoint (TP2, checkpoints every 2 steps, no last.ckpt)",
            f"ckpt_path='last': the checksum mismatch was found before loading and reported with the checkpoint "
            f"and file ({newest.name}/{shard.name}); the previous valid checkpoint ({fallback.name}) was resumed; "
            f"the final parameters equal the uninterrupted run's bit for bit",
            6 - fallback_step,
            "none (the damaged checkpoint's steps were trained again)",
            recover_s,
        )


def test_when_every_checkpoint_is_damaged_the_fit_refuses_naming_them(tmp_path):
    ckpt = tmp_path / "ckpt"
    run(tmp_path / "first", devices=2, tp=2, steps=2, callbacks=[_checkpoints(ckpt, save_last=True)])
    for checkpoint in ("last.ckpt", "epoch=0-step=2.ckpt"):
        _flip_byte(ckpt / checkpoint / "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError) as caught:
        run(tmp_path / "resumed", devices=2, tp=2, steps=4, ckpt_path="last", callbacks=[_checkpoints(ckpt, True)])
    message = str(caught.value)
    assert "no checkpoint in" in message and "passed its checks, so nothing was loaded" in message
    for checkpoint in ("last.ckpt", "epoch=0-step=2.ckpt"):
        assert f"{ckpt / checkpoint}: __0_0.distcp: checksum mismatch" in message
    assert not (tmp_path / "resumed" / "result.pt").exists()  # no training happened
