"""Fault 7 (issue 13): invalid configurations across strategy, model, data, optimizer, checkpoint and
fault-tolerance options, table-driven. Each must fail with one clear error that names the fix, in this
process, before any process group exists and before any rank is forked (``trainer.fit`` through the
fork launcher at devices=2 for the settings only a run can check; the constructor for the others).
"""

import gzip
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import lightning as L
import pytest
import torch

import megatron_lite as ml
from megatron_lite.callbacks import GracefulExit, HangWatchdog, RerunValidation, StragglerReport
from megatron_lite.data import MockGPTDataModule, SFTDataModule, TextCorpusDataModule
from megatron_lite.tokenizers import NullTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from reliability_record import record  # noqa: E402

_MARKER: Optional[Path] = None


def _mark_forked_child() -> None:
    if _MARKER is not None:
        _MARKER.touch()


os.register_at_fork(after_in_child=_mark_forked_child)


def _config(**kw) -> ml.GPTConfig:
    return ml.GPTConfig(
        **{**dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16), **kw}
    )


def _data(**kw) -> MockGPTDataModule:
    return MockGPTDataModule(**{**dict(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=256), **kw})


def _fit(
    devices: int = 2, module=None, data=None, strategy: Optional[dict] = None, callbacks=(), ckpt_path=None, **trainer
) -> None:
    t = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", **(strategy or {})),
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        **trainer,
    )
    t.fit(
        module if module is not None else ml.GPTModule(_config()),
        data if data is not None else _data(),
        ckpt_path=ckpt_path,
    )


def _module_with_lr_set_later() -> ml.GPTModule:
    module = ml.GPTModule(_config())
    module.optimizer_config.lr = math.nan
    return module


class _PlainModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


def _empty_sft(tmp: Path) -> SFTDataModule:
    (tmp / "empty.jsonl").write_text("\n")
    return SFTDataModule(
        str(tmp / "empty.jsonl"), NullTokenizer(256), seq_length=16, micro_batch_size=2, global_batch_size=4
    )


def _empty_corpus(tmp: Path) -> None:
    with gzip.open(tmp / "empty.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": ""}) + "\n")
    TextCorpusDataModule(str(tmp / "empty.jsonl.gz"))


def _file_checkpoint(tmp: Path) -> None:
    (tmp / "model.ckpt").write_bytes(b"not a directory")
    _fit(ckpt_path=str(tmp / "model.ckpt"))


def _directory_that_is_not_a_checkpoint(tmp: Path) -> None:
    (tmp / "notackpt").mkdir()
    _fit(ckpt_path=str(tmp / "notackpt"))


# (id, area, what to run (takes tmp_path), exception type, message that names the fix)
CASES: list[tuple[str, str, Callable[[Path], object], type, str]] = [
    # --- strategy ---
    (
        "tp-zero",
        "strategy",
        lambda t: ml.MegatronStrategy(tensor_model_parallel_size=0),
        ValueError,
        r"tensor_model_parallel_size must be a positive integer",
    ),
    (
        "sp-without-tp",
        "strategy",
        lambda t: ml.MegatronStrategy(sequence_parallel=True),
        ValueError,
        r"sequence_parallel=True needs tensor_model_parallel_size > 1",
    ),
    (
        "start-method",
        "strategy",
        lambda t: ml.MegatronStrategy(start_method="thread"),
        ValueError,
        r"start_method must be 'popen', 'spawn', 'fork' or 'forkserver'",
    ),
    (
        "bucket-size",
        "strategy",
        lambda t: ml.MegatronStrategy(ddp_bucket_size=0),
        ValueError,
        r"ddp_bucket_size must be a positive number of elements",
    ),
    (
        "vpp-without-pp",
        "strategy",
        lambda t: ml.MegatronStrategy(virtual_pipeline_model_parallel_size=2),
        ValueError,
        r"needs pipeline_model_parallel_size > 1",
    ),
    (
        "schedule-name",
        "strategy",
        lambda t: ml.MegatronStrategy(pipeline_model_parallel_size=2, pipeline_schedule="1F1B"),
        ValueError,
        r"pipeline_schedule must be one of",
    ),
    (
        "world-size",
        "strategy",
        lambda t: _fit(devices=3, strategy=dict(tensor_model_parallel_size=2)),
        ValueError,
        r"world size \(3 processes\) must be divisible by the model-parallel size",
    ),
    (
        "fsdp-with-pp",
        "strategy",
        lambda t: _fit(strategy=dict(use_torch_fsdp2=True, pipeline_model_parallel_size=2)),
        ValueError,
        r"not composed yet",
    ),
    (
        "fsdp-with-zero1",
        "strategy",
        lambda t: _fit(
            module=ml.GPTModule(_config(), ml.OptimizerConfig(use_distributed_optimizer=True)),
            strategy=dict(use_torch_fsdp2=True),
        ),
        ValueError,
        r"set OptimizerConfig\(use_distributed_optimizer=False\) or drop use_torch_fsdp2",
    ),
    (
        "fsdp-half-weights",
        "strategy",
        lambda t: _fit(strategy=dict(use_torch_fsdp2=True), precision="bf16-true"),
        ValueError,
        r"use precision='bf16-mixed'",
    ),
    (
        "precision",
        "strategy",
        lambda t: _fit(precision="64-true"),
        ValueError,
        r"pass Trainer\(precision=...\) with one of 32-true",
    ),
    (
        "accumulate",
        "strategy",
        lambda t: _fit(accumulate_grad_batches=2),
        ValueError,
        r"raise the datamodule's global_batch_size instead",
    ),
    (
        "lightning-clip",
        "strategy",
        lambda t: _fit(gradient_clip_val=1.0),
        ValueError,
        r"set OptimizerConfig\(clip_grad=...\) instead",
    ),
    # --- model ---
    (
        "heads-tp",
        "model",
        lambda t: _fit(
            devices=4,
            module=ml.GPTModule(_config(hidden_size=48, num_attention_heads=6)),
            strategy=dict(tensor_model_parallel_size=4),
        ),
        ValueError,
        r"num_attention_heads \(6\) must be divisible by tensor_model_parallel_size \(4\)",
    ),
    (
        "groups-tp",
        "model",
        lambda t: _fit(module=ml.GPTModule(_config(num_query_groups=1)), strategy=dict(tensor_model_parallel_size=2)),
        ValueError,
        r"num_query_groups \(1\) must be divisible by tensor_model_parallel_size \(2\)",
    ),
    (
        "layers-pp",
        "model",
        lambda t: _fit(module=ml.GPTModule(_config(num_layers=3)), strategy=dict(pipeline_model_parallel_size=2)),
        ValueError,
        r"num_layers \(3\) must be divisible by pipeline_model_parallel_size \(2\)",
    ),
    (
        "dropout-nan",
        "model",
        lambda t: _config(hidden_dropout=math.nan),
        ValueError,
        r"GPTConfig\(hidden_dropout=nan\): hidden_dropout must be a finite number",
    ),
    (
        "init-std-nan",
        "model",
        lambda t: _config(init_method_std=math.nan),
        ValueError,
        r"init_method_std must be a finite number",
    ),
    ("data-vocab", "model", lambda t: _fit(data=_data(vocab_size=512)), ValueError, r"set model.config.vocab_size=512"),
    (
        "data-longer-than-model",
        "model",
        lambda t: _fit(data=_data(seq_length=32)),
        ValueError,
        r"set GPTConfig\(seq_length=32\) or the datamodule's seq_length to at most 16",
    ),
    # --- data ---
    (
        "gbs-mbs-dp",
        "data",
        lambda t: _fit(data=_data(global_batch_size=6)),
        ValueError,
        r"global_batch_size \(6\) must be divisible by micro_batch_size \(2\) x data-parallel size \(2\) = 4",
    ),
    (
        "seq-sp",
        "data",
        lambda t: _fit(
            module=ml.GPTModule(_config(seq_length=15)),
            data=_data(seq_length=15),
            strategy=dict(tensor_model_parallel_size=2, sequence_parallel=True),
        ),
        ValueError,
        r"seq_length \(15\) must be divisible by tensor_model_parallel_size \(2\)",
    ),
    (
        "corpus-missing",
        "data",
        lambda t: TextCorpusDataModule(str(t / "missing.jsonl.gz")),
        FileNotFoundError,
        r"does not exist; pass data.path=",
    ),
    ("corpus-empty", "data", _empty_corpus, ValueError, r"holds no non-empty text"),
    ("sft-empty", "data", lambda t: _fit(data=_empty_sft(t)), ValueError, r"empty.jsonl holds no conversations"),
    (
        "rampup-iterations",
        "data",
        lambda t: _fit(
            module=ml.GPTModule(_config(), ml.OptimizerConfig(lr_warmup_iters=1)),
            data=_data(global_batch_size=8, rampup_batch_size=[4, 4, 16]),
        ),
        ValueError,
        r"set the schedule in samples",
    ),
    # --- optimizer ---
    (
        "lr-nan",
        "optimizer",
        lambda t: ml.OptimizerConfig(lr=math.nan),
        ValueError,
        r"OptimizerConfig\(lr=nan\): lr must be a finite number",
    ),
    (
        "beta2-one",
        "optimizer",
        lambda t: ml.OptimizerConfig(adam_beta2=1.0),
        ValueError,
        r"adam_beta2 must be in \[0, 1\)",
    ),
    ("eps-zero", "optimizer", lambda t: ml.OptimizerConfig(adam_eps=0.0), ValueError, r"e.g. adam_eps=1e-8"),
    (
        "warmup-longer",
        "optimizer",
        lambda t: _fit(module=ml.GPTModule(_config(), ml.OptimizerConfig(lr_warmup_iters=5))),
        ValueError,
        r"lr_warmup_iters \(5\) must be smaller than lr_decay_iters \(2\)",
    ),
    (
        "lr-set-later",
        "optimizer",
        lambda t: _fit(module=_module_with_lr_set_later()),
        ValueError,
        r"OptimizerConfig\(lr=nan\): lr must be a finite number",
    ),
    # --- checkpoint ---
    (
        "ckpt-missing",
        "checkpoint",
        lambda t: _fit(ckpt_path=str(t / "nope")),
        FileNotFoundError,
        r"ckpt_path=.* does not exist; pass the directory that trainer.save_checkpoint\(\) or ModelCheckpoint wrote",
    ),
    ("ckpt-file", "checkpoint", _file_checkpoint, ValueError, r"is a file, not a megatron-lite checkpoint directory"),
    ("ckpt-not-dcp", "checkpoint", _directory_that_is_not_a_checkpoint, ValueError, r"no DCP .metadata inside"),
    # --- fault tolerance ---
    (
        "exit-signal",
        "fault tolerance",
        lambda t: GracefulExit(signals=("SIGKILL",)),
        ValueError,
        r"SIGKILL cannot be handled",
    ),
    (
        "exit-interval",
        "fault tolerance",
        lambda t: GracefulExit(exit_interval=-5),
        ValueError,
        r"exit_interval=-5\) must be a positive number of steps",
    ),
    (
        "exit-duration",
        "fault tolerance",
        lambda t: GracefulExit(exit_duration_in_mins=math.inf),
        ValueError,
        r"exit_duration_in_mins=inf\) must be a positive finite number of minutes",
    ),
    (
        "watchdog-timeout",
        "fault tolerance",
        lambda t: HangWatchdog(timeout_s=-1),
        ValueError,
        r"timeout_s=-1\) must be a positive finite number of seconds",
    ),
    (
        "straggler-interval",
        "fault tolerance",
        lambda t: StragglerReport(interval=0),
        ValueError,
        r"interval=0\) must be a positive integer",
    ),
    ("rerun-injection", "fault tolerance", lambda t: RerunValidation(inject="nan@3"), ValueError, r"e.g. 'nan_loss@3'"),
    (
        "rerun-policy",
        "fault tolerance",
        lambda t: RerunValidation(on_reproducible="ignore"),
        ValueError,
        r"on_reproducible='ignore'\) must be one of",
    ),
    (
        "rerun-without-engine",
        "fault tolerance",
        lambda t: _fit(module=_PlainModule(), callbacks=[RerunValidation()]),
        TypeError,
        r"use it with GPTModule or another module that trains through TrainingEngine.train_step",
    ),
]


@pytest.fixture(scope="module")
def outcomes():
    seen: dict = {}
    yield seen
    if len(seen) == len(CASES):
        areas = sorted({area for _, area, *_ in CASES})
        record(
            "7-bad-config",
            f"{len(CASES)} invalid configurations ({', '.join(areas)})",
            f"{sum(seen.values())} of {len(CASES)} refused in the launching process with one message naming the "
            f"fix; no rank forked, no process group created",
            None,
            "none",
            None,
        )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_invalid_configuration_is_refused_before_any_process_group(case, tmp_path, outcomes):
    global _MARKER
    case_id, area, action, kind, message = case
    _MARKER = tmp_path / "forked"
    try:
        with pytest.raises(kind, match=message) as caught:
            action(tmp_path)
    finally:
        _MARKER, forked = None, _MARKER.exists()
    assert not forked, "a rank was started before the configuration was refused"
    assert not torch.distributed.is_initialized()
    assert "\n" not in str(caught.value), f"not one line: {caught.value}"
    outcomes[case_id] = True


def test_the_table_is_large_enough():
    assert len(CASES) >= 30 and len({c[1] for c in CASES}) >= 5
