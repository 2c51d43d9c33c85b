"""Fault 6 (issue 13): the rerun state machine through a real Trainer on real forked ranks (gloo).

A NaN injected into one step's loss once is a transient fault: the step is replayed on the same
microbatches with the same RNG streams and training goes on exactly as if nothing had happened (the
final parameters equal an uninjected run's bit for bit, with dropout on). Injected into every attempt
of the step, it is reproducible and the policy applies: 'skip' drops that update (and only that one),
'exit' saves a checkpoint and ends every rank with Megatron's exit code 16; the run resumes from it.
"""

import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.multiprocessing import ProcessExitedException

from megatron_lite.callbacks import RerunValidation
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta
from megatron_lite.core.rerun import INJECT_ENV, FaultInjection, RerunConfig

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))
sys.path.insert(0, str(Path(__file__).parent))
from parity_utils import run, tiny_config  # noqa: E402
from reliability_record import record  # noqa: E402

STEPS = 5
CONFIG = dict(
    num_layers=1,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
    seq_length=16,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)


class Counts(L.Callback):
    """Rank 0's per-step view: loss, whether the step was skipped, the rerun counts, a parameter checksum."""

    def __init__(self, out: Path):
        self.out, self.rows = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.rows.append(
            {
                "step": trainer.global_step,
                "loss": float(outputs["loss"]),
                "skipped_steps": int(m["train/skipped_steps"]),
                **{k: int(m[f"train/rerun_{k}"]) for k in ("rejected", "transient", "reproducible", "skipped")},
                "checksum": sum(float(p.detach().double().sum()) for p in pl_module.model.parameters()),
            }
        )
        if trainer.global_rank == 0:
            torch.save(self.rows, self.out / "counts.pt")


def _run(tmp_path: Path, name: str, tp: int = 2, **rerun):
    out = tmp_path / name
    out.mkdir()
    callbacks = [RerunValidation(**rerun), Counts(out)]  # the counts are logged before Counts reads them
    result = run(out, devices=2, tp=tp, steps=STEPS, gbs=4, mbs=2, config=tiny_config(**CONFIG), callbacks=callbacks)
    return result, torch.load(out / "counts.pt")


def test_a_nan_loss_injected_once_is_transient_and_training_goes_on_unchanged(tmp_path):
    reference, _ = _run(tmp_path, "reference", on_reproducible="exit")
    start = time.perf_counter()
    result, rows = _run(tmp_path, "once", inject="nan_loss@2", on_reproducible="exit")
    elapsed = time.perf_counter() - start
    last = rows[-1]
    assert (last["rejected"], last["transient"], last["reproducible"], last["skipped"]) == (1, 1, 0, 0)
    assert [r["transient"] for r in rows] == [0, 0, 1, 1, 1]  # counted at the step it happened
    assert result["global_step"] == STEPS and result["skipped_steps"] == 0
    # the replay ran on the same microbatches with the same dropout masks, and nothing was applied twice
    assert result["losses"] == reference["losses"]
    for name, value in reference["params"].items():
        assert torch.equal(result["params"][name], value), name
    record(
        "6a-nan-once",
        "NaN loss injected once (step 2, TP2, dropout on)",
        "replayed on the same microbatches; classified transient; counted (train/rerun_transient=1); training "
        "continued and ended with the uninjected run's parameters bit for bit",
        0,
        "none",
        None,
        wall_s=round(elapsed, 1),
    )


def test_nan_gradients_with_a_finite_loss_are_caught_by_the_grad_norm_check(tmp_path):
    result, rows = _run(tmp_path, "grad", tp=1, inject="nan_grad@1")
    assert (rows[-1]["rejected"], rows[-1]["transient"]) == (1, 1)
    assert all(torch.isfinite(p).all() for p in result["params"].values())


def test_a_nan_loss_injected_every_time_is_reproducible_and_skip_drops_only_that_update(tmp_path):
    result, rows = _run(tmp_path, "always", tp=1, inject="nan_loss@2:always", on_reproducible="skip")
    last = rows[-1]
    assert (last["rejected"], last["transient"], last["reproducible"], last["skipped"]) == (1, 0, 1, 1)
    assert last["skipped_steps"] == 1 and result["global_step"] == STEPS
    checksums = [r["checksum"] for r in rows]
    assert checksums[2] == checksums[1]  # step 2 changed nothing
    assert len(set(checksums[:2] + checksums[3:])) == 4  # every other step did
    assert all(torch.isfinite(p).all() for p in result["params"].values())
    record(
        "6b-nan-always-skip",
        "NaN loss injected at every attempt of step 2, policy 'skip' (DP2)",
        "replayed; classified reproducible; that update dropped (train/rerun_skipped=1, train/skipped_steps=1); "
        "every other step applied, weights finite",
        1,
        "one global batch not learned from",
        None,
    )


def test_the_exit_policy_saves_and_ends_every_rank_with_code_16_then_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "nan_loss@2:always")  # the environment variable drives the injection
    checkpoints = tmp_path / "ckpt"
    start = time.perf_counter()
    with pytest.raises(ProcessExitedException) as caught:
        run(
            tmp_path / "exit",
            devices=2,
            steps=STEPS,
            gbs=4,
            mbs=2,
            config=tiny_config(**CONFIG),
            callbacks=[RerunValidation(), ModelCheckpoint(dirpath=checkpoints, save_top_k=0)],
        )
    assert caught.value.exit_code == 16
    last = checkpoints / "last.ckpt"
    assert (last / ".metadata").is_file()
    meta = read_checkpoint_meta(last)
    assert meta["global_step"] == 3  # steps 0, 1 applied; step 2 skipped (its batch consumed); saved after it
    monkeypatch.delenv(INJECT_ENV)
    resumed = run(
        tmp_path / "resumed",
        devices=2,
        steps=STEPS,
        gbs=4,
        mbs=2,
        config=tiny_config(**CONFIG),
        callbacks=[RerunValidation(), ModelCheckpoint(dirpath=checkpoints, save_top_k=0)],
        ckpt_path="last",
    )
    elapsed = time.perf_counter() - start
    assert resumed["global_step"] == STEPS and len(resumed["losses"]) == STEPS - 3
    assert all(torch.isfinite(torch.tensor(resumed["losses"])))
    record(
        "6c-nan-always-exit",
        "NaN loss injected at every attempt of step 2, policy 'exit' (DP2)",
        "replayed; reproducible; update dropped; last.ckpt saved; every rank exited with code 16; "
        "ckpt_path='last' resumed at step 3 and finished",
        1,
        "one global batch not learned from",
        elapsed,
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("nan_loss@3", FaultInjection("nan", "loss", 3)),
        ("inf_grad@0:always", FaultInjection("inf", "grad", 0, always=True)),
        ("spike_loss@7:once:rank1", FaultInjection("spike", "loss", 7, rank=1)),
    ],
)
def test_fault_injection_syntax(text, expected):
    assert FaultInjection.parse(text) == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(inject="nan@3"), r"is not <nan\|inf\|spike>_<loss\|grad>@<step>"),
        (dict(on_reproducible="ignore"), "must be one of"),
        (dict(spike_factor=1.0), "must be a finite number > 1"),
        (dict(spike_window=0), "must be a positive number of steps"),
    ],
)
def test_bad_rerun_settings_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RerunConfig(**kwargs)


def test_a_transient_fault_under_pipeline_parallelism_changes_nothing(tmp_path):
    """PP2 (1F1B): the loss exists on the last stage only; every stage replays and agrees on the verdict."""
    config = tiny_config(**{**CONFIG, "num_layers": 2})
    common = dict(devices=2, pp=2, steps=4, gbs=4, mbs=1, config=config)
    reference = run(tmp_path / "reference", **common, callbacks=[RerunValidation()])
    result = run(
        tmp_path / "once", **common, callbacks=[RerunValidation(inject="nan_loss@1"), Counts(tmp_path / "once")]
    )
    rows = torch.load(tmp_path / "once" / "counts.pt")
    assert (rows[-1]["rejected"], rows[-1]["transient"]) == (1, 1)
    assert result["losses"] == reference["losses"]
    for name, value in reference["params"].items():
        assert torch.equal(result["params"][name], value), name
