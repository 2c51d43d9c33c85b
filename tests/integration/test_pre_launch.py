"""The run description and the pre-launch protocol through a real Trainer (fork launcher, 2 ranks on gloo).

MegatronStrategy builds one :class:`RunSpec` in the launching process and hands that very object to the module's,
the datamodule's and each callback's ``check_before_launch``, in that order; every rank builds an equal one and
checks again. A callback's refusal stops ``fit`` in the launching process, before any rank is forked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Optional

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.data import DataGeometry, MockGPTDataModule
from megatron_lite.strategies.pre_launch import PreLaunchCheck

sys.path.insert(0, str(Path(__file__).parent))
from test_bad_input import fork_marker  # noqa: E402,F401  (the probe that a rank was forked: a pytest fixture)


def _config() -> ml.GPTConfig:
    return ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)


class _Seen:
    """Where each check_before_launch call is recorded: in this process the RunSpec objects themselves (in call
    order), in a forked rank a JSON file per process and caller."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.launcher_pid, self.calls = directory, os.getpid(), []

    def record(self, who: str, run: RunSpec) -> None:
        if os.getpid() == self.launcher_pid:
            self.calls.append((who, run))
        else:
            (self.directory / f"{who}-{os.getpid()}.json").write_text(json.dumps(dataclasses.asdict(run)))


class _Module(ml.GPTModule):
    def __init__(self, seen: _Seen) -> None:
        super().__init__(_config())
        self.seen = seen

    def check_before_launch(self, run, trainer, module, datamodule) -> None:
        super().check_before_launch(run, trainer, module, datamodule)
        self.seen.record("module", run)


class _Data(MockGPTDataModule):
    def __init__(self, seen: _Seen) -> None:
        super().__init__(seq_length=16, micro_batch_size=2, global_batch_size=8, vocab_size=256)
        self.seen = seen

    def check_before_launch(self, run, trainer=None, module=None, datamodule=None) -> None:
        super().check_before_launch(run, trainer, module, datamodule)
        self.seen.record("datamodule", run)


class _Check(L.Callback):
    """A user's callback: it implements the protocol, nothing else."""

    def __init__(self, seen: _Seen, refuse: Optional[str] = None) -> None:
        self.seen, self.refuse, self.set_up = seen, refuse, False

    def check_before_launch(self, run, trainer, module, datamodule) -> None:
        self.seen.record("callback", run)
        if self.refuse:
            raise ValueError(self.refuse)

    def setup(self, trainer, pl_module, stage) -> None:
        self.set_up = True


def _trainer(callback: _Check) -> L.Trainer:
    strategy = ml.MegatronStrategy(
        start_method="fork", log_metrics=False, ddp_bucket_size=4096, overlap_grad_reduce=True
    )
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )


def test_one_run_spec_reaches_the_module_the_data_and_the_callbacks_and_each_rank_builds_an_equal_one(tmp_path):
    seen = _Seen(tmp_path)
    module, data, callback = _Module(seen), _Data(seen), _Check(seen)
    trainer = _trainer(callback)
    assert isinstance(module, PreLaunchCheck) and isinstance(data, PreLaunchCheck)
    assert isinstance(callback, PreLaunchCheck)
    trainer.fit(module, data)

    run = trainer.strategy.run_spec
    assert run == RunSpec(
        ml.ParallelConfig(),
        world_size=2,
        data=DataGeometry(2, 8, 16),
        precision="32-true",
        ddp_bucket_size=4096,
        overlap_grad_reduce=True,
    )
    assert run.data_parallel_size == 2 and run.num_microbatches == 2 and run.data == data.geometry
    # the launching process: one object, built once, handed to each in the documented order
    assert [who for who, _ in seen.calls] == ["module", "datamodule", "callback"]
    assert all(received is run for _, received in seen.calls)
    # every rank: its own, equal to the launcher's, received by all three
    files = sorted(tmp_path.glob("*.json"))
    assert len({path.stem.split("-")[1] for path in files}) == 2  # two rank processes
    assert sorted(path.stem.split("-")[0] for path in files) == sorted(["callback", "datamodule", "module"] * 2)
    for path in files:
        assert json.loads(path.read_text()) == dataclasses.asdict(run), path.name


def test_a_callbacks_refusal_stops_fit_before_any_rank_starts(tmp_path, fork_marker):  # noqa: F811 (the fixture)
    seen = _Seen(tmp_path)
    module, data = _Module(seen), _Data(seen)
    callback = _Check(seen, refuse="this run is refused by MyCheck: set the thing it names")
    with pytest.raises(ValueError, match="^this run is refused by MyCheck: set the thing it names$"):
        _trainer(callback).fit(module, data)
    assert not fork_marker.exists(), "a rank was started before the callback's refusal"
    assert [who for who, _ in seen.calls] == ["module", "datamodule", "callback"]  # the callback's check ran last
    assert module.model is None and not callback.set_up  # nothing was built, no hook ran
