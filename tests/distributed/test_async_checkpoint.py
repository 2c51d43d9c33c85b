"""Asynchronous checkpoint saves (MegatronStrategy(async_save=True)) through a real 2-rank Trainer with
Lightning's own ModelCheckpoint (every_n_train_steps, save_last, save_top_k + monitor).

- The saves really are handed to the background (a save is still in flight when the next step starts),
  training is not perturbed (the same losses), and every checkpoint equals, tensor for tensor, the one a
  synchronous run writes at the same step (model, optimizer state, RNG states; TP2 with a vocabulary
  that pads unevenly, so the uneven-shard views are staged too). Top-k removal keeps the same set.
- Resuming from an asynchronously written checkpoint continues like the uninterrupted run.
- The same with DP2 and the distributed optimizer (ZeRO-1), whose state is gathered for the save.
- A run that fails with a save in flight raises its own error and leaves only complete checkpoints.
- A real write failure in the background (the rank processes' file-size limit, so the OS refuses the
  shard) surfaces in the training process as an error naming the checkpoint and the cause, and nothing
  is committed.
"""

import json
import re
import resource
import signal
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from parity_utils import run, tiny_config
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_lite.core.checkpoint.format.integrity import verify_checkpoint
from megatron_lite.core.checkpoint.format.safe_reader import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta

LEFTOVER = re.compile(r"^\..+\.(tmp|old|del)-[0-9a-f]{8}$")
CONFIG = dict(vocab_size=1000, make_vocab_size_divisible_by=96)  # padded to 1152 at TP2: uneven real rows


def _checkpoints(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".ckpt"))


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds (model, optimizer, RNG), read in this process."""
    assert verify_checkpoint(path).status == "ok"
    metadata = read_dcp_metadata(path / ".metadata").state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), no_dist=True)
    return state


class InFlight(L.Callback):
    """Records, at the start of every step, the checkpoint the strategy is still writing in the background."""

    def __init__(self, out: Path):
        self.out, self.seen = out, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        checkpointer = trainer.strategy.checkpoints.in_use
        pending = checkpointer.pending if checkpointer is not None else None
        self.seen.append([trainer.global_step, pending.name if pending is not None else None])

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.seen))


def _checkpointing(dirpath: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True, save_top_k=2, monitor="train/loss")


def test_async_saves_equal_synchronous_ones_and_resume(tmp_path):
    config = tiny_config(**CONFIG)
    sync_dir, async_dir = tmp_path / "sync_ckpts", tmp_path / "async_ckpts"
    reference = run(tmp_path / "sync", devices=2, tp=2, steps=8, config=config, callbacks=[_checkpointing(sync_dir)])
    flights = tmp_path / "in_flight.json"
    result = run(
        tmp_path / "async",
        devices=2,
        tp=2,
        steps=8,
        config=config,
        strategy_kwargs={"async_save": True},
        callbacks=[_checkpointing(async_dir), InFlight(flights)],
    )

    # the saves after steps 2, 4 and 6 were still in flight when the next step began: training went on
    in_flight = {step: name for step, name in json.loads(flights.read_text())}
    assert in_flight[2] == in_flight[4] == in_flight[6] == "last.ckpt", in_flight  # last.ckpt is saved after top-k
    assert result["losses"] == reference["losses"]

    names = _checkpoints(sync_dir)
    assert len(names) == 3 and "last.ckpt" in names  # two kept by top-k, and last
    assert _checkpoints(async_dir) == names
    assert not [p.name for p in async_dir.iterdir() if LEFTOVER.match(p.name)]
    for name in names:
        expected, actual = _all_tensors(sync_dir / name), _all_tensors(async_dir / name)
        assert actual.keys() == expected.keys() and any(k.startswith("optimizer_0.") for k in expected)
        for key, tensor in expected.items():
            assert torch.equal(actual[key], tensor), f"{name}: {key} differs"
        saved_step = read_checkpoint_meta(sync_dir / name)["global_step"]
        assert read_checkpoint_meta(async_dir / name)["global_step"] == saved_step
    assert read_checkpoint_meta(async_dir / "last.ckpt")["global_step"] == 8

    # resume from the earliest kept checkpoint: the later steps are those of the uninterrupted run
    earliest = min((n for n in names if n != "last.ckpt"), key=lambda n: int(re.search(r"step=(\d+)", n)[1]))
    step = read_checkpoint_meta(async_dir / earliest)["global_step"]
    assert step < 8
    resumed = run(
        tmp_path / "resumed",
        devices=2,
        tp=2,
        steps=8,
        config=config,
        strategy_kwargs={"async_save": True},
        ckpt_path=str(async_dir / earliest),
        callbacks=[_checkpointing(tmp_path / "resumed_ckpts")],
    )
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(reference["losses"][step:]), rtol=1e-5, atol=0
    )


def test_async_saves_with_the_distributed_optimizer_equal_synchronous_ones(tmp_path):
    """DP2 with ZeRO-1: the optimizer state is gathered over DP into fresh tensors for the save; staged and
    written in the background it equals the synchronous save."""
    import megatron_lite as ml

    zero1 = ml.OptimizerConfig(
        lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, use_distributed_optimizer=True
    )
    dirs = {}
    for mode in ("sync", "async"):
        dirs[mode] = tmp_path / f"{mode}_ckpts"
        run(
            tmp_path / mode,
            devices=2,
            steps=4,
            optimizer=zero1,
            strategy_kwargs={"async_save": mode == "async"},
            callbacks=[ModelCheckpoint(dirpath=dirs[mode], every_n_train_steps=2, save_top_k=-1)],
        )
    names = _checkpoints(dirs["sync"])
    assert names == _checkpoints(dirs["async"]) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    for name in names:
        expected, actual = _all_tensors(dirs["sync"] / name), _all_tensors(dirs["async"] / name)
        assert actual.keys() == expected.keys() and any(".master" in k or ".exp_avg" in k for k in expected)
        for key, tensor in expected.items():
            assert torch.equal(actual[key], tensor), f"{name}: {key} differs"


class FileSizeLimit(L.Callback):
    """Limits the size of any file the rank process writes, so writing a checkpoint shard fails in the OS
    (EFBIG) -- in the background thread that writes it."""

    def on_train_start(self, trainer, pl_module):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def test_background_write_error_surfaces_in_training(tmp_path):
    ckpt_dir = tmp_path / "ckpts"
    with pytest.raises(Exception) as failure:
        run(
            tmp_path / "run",
            devices=2,
            tp=2,
            steps=4,
            config=tiny_config(**CONFIG),
            strategy_kwargs={"async_save": True},
            callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1), FileSizeLimit()],
        )
    message = str(failure.value)
    assert "could not be written in the background" in message, message
    # the cause, from the rank's DCP write (the OS cut the shard short at the limit, which torch's
    # serializer reports as a position mismatch)
    assert "epoch=0-step=2.ckpt" in message and "torch.distributed.checkpoint failed writing" in message, message
    assert not _checkpoints(ckpt_dir)  # nothing was committed


class FailAtStep(L.Callback):
    """Raises on every rank when a step starts after the given one (the save before it still in flight)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            assert trainer.strategy.checkpoints.in_use.pending is not None  # the save is the run's last act
            raise ValueError(f"failing on purpose at step {self.step}")


def test_a_failing_run_leaves_only_complete_checkpoints(tmp_path):
    """The run's own error is the one raised while a save (last.ckpt) is in flight. Forked ranks end at
    once on an error (the launching process stops the others), so that save may be abandoned: whatever
    is visible afterwards is complete, the latest record names a complete checkpoint, and the save the
    in-flight one waited for (step 2's top-k checkpoint) is there."""
    ckpt_dir = tmp_path / "ckpts"
    with pytest.raises(Exception, match="failing on purpose at step 2"):
        run(
            tmp_path / "run",
            devices=2,
            tp=2,
            steps=4,
            config=tiny_config(**CONFIG),
            strategy_kwargs={"async_save": True},
            callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_last=True), FailAtStep(2)],
        )
    names = _checkpoints(ckpt_dir)
    assert "epoch=0-step=2.ckpt" in names and set(names) <= {"epoch=0-step=2.ckpt", "last.ckpt"}
    for name in names:
        assert verify_checkpoint(ckpt_dir / name).status == "ok"
        assert read_checkpoint_meta(ckpt_dir / name)["global_step"] == 2
    assert json.loads((ckpt_dir / "latest_checkpoint.json").read_text())["name"] in names


def test_storage_options_other_than_async_save_are_refused():
    from megatron_lite.strategies.checkpointing import saves_asynchronously

    with pytest.raises(TypeError, match="storage_options=\\{'async_save': True\\}"):
        saves_asynchronously(False, {"compression": "zstd"}, live=True, module=None, trainer=None)
    assert saves_asynchronously(False, {"async_save": True}, live=True, module=None, trainer=None)
    # no ranks: nothing to overlap
    assert not saves_asynchronously(False, {"async_save": True}, live=False, module=None, trainer=None)
