"""Complete, exact resume through a real Trainer, and what happens to the RNG states and the data position
when the layout or the global batch changes.

Same layout (TP2, PP2, DP2 with ZeRO-1; dropout in every run so the RNG streams matter): an uninterrupted run
of 6 steps saves after step 3; a run resumed from that checkpoint gives the same losses of steps 4-6 and the
same final parameters bit for bit (torch.equal), starts with exactly the RNG states that were saved, trains on
exactly the samples the uninterrupted run trained on next, and logs no RNG note.

Another layout (saved at TP2, resumed at DP2: the same number of ranks, whose streams would mean something
else): the RNG states are re-derived from the seeds for step 3, with one note from rank 0 naming the change,
and the samples are still exactly the next ones. Another global batch size (8 -> 16): the samples continue at
24, and a checkpoint saved after the change counts the consumed samples exactly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from parity_utils import run, tiny_config
from reshard_utils import RNGRecorder, SampleRecorder, sample_indices

import megatron_lite as ml
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta
from megatron_lite.core.checkpoint.resume.rng import derived_seed
from megatron_lite.core.parallel.random import DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG
from megatron_lite.data import MockGPTDataModule

CONFIG = tiny_config(vocab_size=1001, make_vocab_size_divisible_by=100, hidden_dropout=0.1, attention_dropout=0.1)
SAVE_AT, STEPS, GBS, DATA_SEED, MODEL_SEED, GLOBAL_SEED = 3, 6, 8, 7, 1234, 42
NOTE = "RNG states not restored"


# one worker under `pytest -n 2 --dist loadgroup`: the saved runs are module fixtures, made once
pytestmark = pytest.mark.xdist_group("exact_resume")


def optimizer(distributed: bool = False) -> ml.OptimizerConfig:
    return ml.OptimizerConfig(
        lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, use_distributed_optimizer=distributed
    )


LAYOUTS = {
    "tp2": dict(devices=2, tp=2),
    "pp2": dict(devices=2, pp=2),
    "dp2_zero1": dict(devices=2, optimizer=optimizer(distributed=True)),
}


def _data(gbs: int = GBS) -> MockGPTDataModule:
    return MockGPTDataModule(
        seq_length=CONFIG.seq_length,
        micro_batch_size=2,
        global_batch_size=gbs,
        vocab_size=CONFIG.vocab_size,
        seed=DATA_SEED,
    )


def _run(out: Path, layout: dict, gbs: int = GBS, **kwargs) -> dict:
    """A run recording its samples, its RNG states and the megatron-lite log records (the forked ranks
    inherit the file handler)."""
    L.seed_everything(GLOBAL_SEED)
    handler = logging.FileHandler(out / "log.txt")
    logger = logging.getLogger("megatron_lite")
    logger.addHandler(handler)
    try:
        callbacks = [SampleRecorder(out), RNGRecorder(out), *kwargs.pop("callbacks", [])]
        result = run(
            out, config=CONFIG, data=_data(gbs), callbacks=callbacks, **{"optimizer": optimizer(), **layout, **kwargs}
        )
    finally:
        logger.removeHandler(handler)
        handler.close()
    result["log"] = (out / "log.txt").read_text()
    result["samples"] = sample_indices(out, 20 * GBS, CONFIG.seq_length, CONFIG.vocab_size, DATA_SEED)
    result["out"] = out
    return result


def _uninterrupted(out: Path, layout: dict) -> dict:
    out.mkdir(parents=True)
    result = _run(
        out,
        layout,
        steps=STEPS,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=SAVE_AT, save_top_k=-1)],
    )
    result["checkpoint"] = str(out / "ckpts" / f"epoch=0-step={SAVE_AT}.ckpt")
    return result


def _rng(out: Path, kind: str, rank: int) -> dict:
    return torch.load(out / f"rng_{kind}_rank{rank}.pt", weights_only=True)


def _consumed(checkpoint: str) -> int:
    return read_checkpoint_meta(checkpoint)["MockGPTDataModule"]["consumed_samples"]


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    return _uninterrupted(tmp_path_factory.mktemp("tp2") / "run", LAYOUTS["tp2"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_at_the_same_layout_is_bit_exact(name, tp2_run, tmp_path):
    reference = tp2_run if name == "tp2" else _uninterrupted(tmp_path / "uninterrupted", LAYOUTS[name])
    assert reference["samples"] == [list(range(s * GBS, (s + 1) * GBS)) for s in range(STEPS)]
    assert _consumed(reference["checkpoint"]) == SAVE_AT * GBS
    (tmp_path / "resumed").mkdir()
    resumed = _run(tmp_path / "resumed", LAYOUTS[name], steps=STEPS, ckpt_path=reference["checkpoint"])

    assert resumed["global_step"] == STEPS
    assert resumed["losses"] == reference["losses"][SAVE_AT:]  # floats compared exactly
    assert resumed["params"].keys() == reference["params"].keys()
    for param, value in reference["params"].items():
        assert torch.equal(resumed["params"][param], value), param
    assert resumed["samples"] == reference["samples"][SAVE_AT:]
    for rank in range(2):
        # the dropout streams as saved when training starts; every generator where the uninterrupted run's is
        # when it ends (the global CPU generator is set before the first step: Lightning draws from it first)
        saved, restored = _rng(reference["out"], f"saved_step{SAVE_AT}", rank), _rng(resumed["out"], "start", rank)
        assert saved.keys() == restored.keys() and len(saved) == 3, (rank, saved.keys())  # both dropout streams
        for key in saved.keys() - {"torch"}:
            assert torch.equal(restored[key], saved[key]), (rank, key)
        end, reference_end = _rng(resumed["out"], "end", rank), _rng(reference["out"], "end", rank)
        for key in reference_end:
            assert torch.equal(end[key], reference_end[key]), (rank, key)
    assert NOTE not in resumed["log"]


def test_layout_change_rederives_rng_from_the_seeds_and_keeps_the_data_position(tp2_run, tmp_path):
    (tmp_path / "dp2").mkdir()
    resumed = _run(tmp_path / "dp2", dict(devices=2), steps=STEPS, ckpt_path=tp2_run["checkpoint"])

    notes = [line for line in resumed["log"].splitlines() if NOTE in line]
    assert len(notes) == 1, resumed["log"]  # from rank 0 only
    assert "tp 2 -> 1" in notes[0] and "dp 1 -> 2" in notes[0] and f"for step {SAVE_AT}" in notes[0], notes[0]
    for rank in range(2):
        saved = _rng(tp2_run["out"], f"saved_step{SAVE_AT}", rank)
        # the dropout streams when training starts, the global CPU generator (set before the first step and
        # not drawn from by training) when it ends
        state = {**_rng(resumed["out"], "start", rank), "torch": _rng(resumed["out"], "end", rank)["torch"]}
        expected = {
            "torch": derived_seed(GLOBAL_SEED, SAVE_AT),
            f"{MODEL_PARALLEL_RNG}@cpu": derived_seed(MODEL_SEED + 2718 + 0, SAVE_AT),  # TP rank 0 on both
            f"{DATA_PARALLEL_RNG}@cpu": derived_seed(MODEL_SEED + 100 * 0, SAVE_AT),
        }
        assert state.keys() == expected.keys(), state.keys()
        for key, seed in expected.items():
            assert torch.equal(state[key], torch.Generator().manual_seed(seed).get_state()), (rank, key)
            assert not torch.equal(state[key], saved[key]), (rank, key)
    assert resumed["samples"] == tp2_run["samples"][SAVE_AT:]
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(tp2_run["losses"][SAVE_AT:]), rtol=0.05, atol=0
    )  # other dropout masks: close, not equal


def test_global_batch_change_continues_at_the_consumed_samples(tp2_run, tmp_path):
    (tmp_path / "gbs16").mkdir()
    checkpoints = tmp_path / "gbs16" / "ckpts"
    resumed = _run(
        tmp_path / "gbs16",
        LAYOUTS["tp2"],
        gbs=2 * GBS,
        steps=SAVE_AT + 2,
        ckpt_path=tp2_run["checkpoint"],
        callbacks=[ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1)],
    )
    start = SAVE_AT * GBS
    assert resumed["samples"] == [list(range(start, start + 16)), list(range(start + 16, start + 32))]
    assert _consumed(str(checkpoints / f"epoch=0-step={SAVE_AT + 1}.ckpt")) == start + 16
    assert _consumed(str(checkpoints / f"epoch=0-step={SAVE_AT + 2}.ckpt")) == start + 32
    assert NOTE not in resumed["log"]  # the same layout: the RNG states were restored
