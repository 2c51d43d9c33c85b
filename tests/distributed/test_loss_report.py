"""Metrics an objective reports from its loss (``core/parallel/loss_report.py``).

Proves: a toy objective's report, reduced by the engine under PP2 (only the last stage computes it), DP2 and
PP2 x DP2 (forked gloo ranks, no Lightning), equals the one-process value on every rank, for training and
forward-only steps, with the loss unchanged; a loss that returns the old ``(sum, count)`` still trains, with an
empty report; a loss that reports a name it did not report at the first step, or an entry that is not a
``[sum, count]`` pair, gets one clear error; GPTModule logs a reported metric in validation as the epoch's
count-weighted mean (as val/loss is token-weighted).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from spawn_utils import run_ranks

import megatron_lite as ml
from megatron_lite.core.engine import TrainingEngine
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.loss_report import report_entry
from megatron_lite.core.parallel.schedules import gpt_forward_step, masked_token_loss

CONFIG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=128,
    seq_length=8,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
MICROBATCHES, MBS = 4, 2


class ReportingObjective:
    """Next-token loss; reports the share of tokens whose loss is below 5 (counts: exact) and the mean
    squared per-token loss over the masked tokens."""

    def forward_step(self, part, microbatch, input_tensor):
        return gpt_forward_step(part, microbatch, input_tensor)

    def loss(self, per_token, microbatch):
        total, count = masked_token_loss(per_token, microbatch)
        mask = microbatch["loss_mask"].to(per_token.dtype)
        report = {
            "low_share": report_entry(((per_token.detach() < 5.0).to(mask.dtype) * mask).sum(), count),
            "loss_sq": report_entry((per_token.detach() ** 2 * mask).sum(), count),
        }
        return total, count, report


class PlainObjective(ReportingObjective):
    def loss(self, per_token, microbatch):
        return masked_token_loss(per_token, microbatch)


def _microbatches() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, CONFIG["vocab_size"], (MICROBATCHES, MBS, CONFIG["seq_length"] + 1), generator=g)
    masks = (torch.rand(MICROBATCHES, MBS, CONFIG["seq_length"], generator=g) < 0.7).float()
    return [{"tokens": tokens[i], "loss_mask": masks[i]} for i in range(MICROBATCHES)]


def _steps(layout: ParallelLayout, objective) -> list[dict]:
    """One training step's and one forward-only step's loss and report on this rank (the DP ranks take
    alternate microbatches of the global batch)."""
    model = ml.GPTModel(ml.GPTConfig(**CONFIG), layout, seed=7)
    engine = TrainingEngine(model, layout, objective)
    mine = _microbatches()[layout.dp_rank :: layout.dp_size]
    out = []
    for forward_only in (False, True):
        step = engine.forward_backward(mine, forward_only=forward_only)
        out.append({"loss": step.loss, "report": step.report, "means": step.report_means()})
    return out


def _rank(rank: int, world: int, pp: int) -> list[dict]:
    torch.manual_seed(0)
    return _steps(ParallelLayout.build(ParallelConfig(pipeline_model_parallel_size=pp)), ReportingObjective())


@pytest.fixture(scope="module")
def one_process() -> list[dict]:
    return _steps(ParallelLayout.single(), ReportingObjective())


@pytest.mark.parametrize("world,pp", [(2, 2), (2, 1), (4, 2)], ids=["pp2", "dp2", "pp2_dp2"])
def test_the_report_is_reduced_over_the_pipeline_and_dp_like_the_loss(world, pp, one_process):
    expected_share = one_process[0]["means"]["low_share"]
    assert 0 < expected_share < 1  # the metric separates tokens
    for rank_steps in run_ranks(_rank, world, pp):
        for step, expected in zip(rank_steps, one_process):  # training, then forward-only
            assert set(step["report"]) == {"low_share", "loss_sq"}
            torch.testing.assert_close(step["loss"], expected["loss"], rtol=1e-5, atol=0)
            # the counts and the share are sums of whole tokens: exact at any layout
            assert torch.equal(step["report"]["low_share"], expected["report"]["low_share"])
            torch.testing.assert_close(step["report"]["loss_sq"], expected["report"]["loss_sq"], rtol=1e-5, atol=0)
            torch.testing.assert_close(step["means"]["loss_sq"], expected["means"]["loss_sq"], rtol=1e-5, atol=0)


def test_a_loss_returning_sum_and_count_still_trains_with_an_empty_report(one_process):
    plain = _steps(ParallelLayout.single(), PlainObjective())
    for step, reported in zip(plain, one_process):
        assert step["report"] == {} and step["means"] == {}
        assert torch.equal(step["loss"], reported["loss"])


def test_a_name_not_reported_at_the_first_step_is_refused():
    class Growing(ReportingObjective):
        calls = 0

        def loss(self, per_token, microbatch):
            total, count, report = super().loss(per_token, microbatch)
            Growing.calls += 1
            return total, count, (report if Growing.calls > MICROBATCHES else {"low_share": report["low_share"]})

    layout = ParallelLayout.single()
    engine = TrainingEngine(ml.GPTModel(ml.GPTConfig(**CONFIG), layout, seed=7), layout, Growing())
    engine.forward_backward(_microbatches())
    with pytest.raises(ValueError, match=r"reported \['loss_sq'\], which it did not report at the first step"):
        engine.forward_backward(_microbatches())


def test_a_report_entry_that_is_not_a_sum_and_count_is_refused():
    class Bad(ReportingObjective):
        def loss(self, per_token, microbatch):
            total, count = masked_token_loss(per_token, microbatch)
            return total, count, {"mean": total / count}

    layout = ParallelLayout.single()
    engine = TrainingEngine(ml.GPTModel(ml.GPTConfig(**CONFIG), layout, seed=7), layout, Bad())
    with pytest.raises(TypeError, match=r"report entry 'mean' must be its \[sum, count\]"):
        engine.forward_backward(_microbatches())


class ReportingModule(ml.GPTModule):
    """Reports the mean label id over the loss tokens: known without running the model."""

    def loss(self, output, microbatch):
        total, count = masked_token_loss(output, microbatch)
        labels = microbatch["tokens"][:, 1:].to(output.dtype)
        return total, count, {"label_mean": report_entry((labels * microbatch["loss_mask"]).sum(), count)}


def test_validation_logs_a_reported_metric_weighted_by_its_count():
    """Two validation batches with very different counts and means: val/label_mean is the mean over every
    counted token of the split, not the mean of the two batches' means."""
    from torch.utils.data import DataLoader

    batches = _microbatches()[:2]
    batches[1]["loss_mask"] = torch.zeros_like(batches[1]["loss_mask"])
    batches[1]["loss_mask"][0, :2] = 1  # two tokens count, both labelled 0
    batches[1]["tokens"][0, 1:3] = 0

    class Data(L.LightningDataModule):
        micro_batch_size, global_batch_size, seq_length = MBS, MBS, CONFIG["seq_length"]

        def val_dataloader(self):
            return DataLoader(batches, batch_size=None)

    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    (metrics,) = trainer.validate(ReportingModule(ml.GPTConfig(**CONFIG), seed=3), Data())
    sums = [float((b["tokens"][:, 1:] * b["loss_mask"]).sum()) for b in batches]
    counts = [float(b["loss_mask"].sum()) for b in batches]
    assert sums[1] == 0 and sums[0] > 0  # the mean of the batch means would be half the first batch's
    assert metrics["val/label_mean"] == pytest.approx(sum(sums) / sum(counts), rel=1e-6)
