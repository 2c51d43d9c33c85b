"""The rerun state machine on the training engine in one process (no process group, no Lightning):
spikes against the first values, the replay restoring the dropout streams, nothing applied twice, the
policies, the fp16 path (loss checked, overflowing gradients left to the loss scaler), its state."""

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.engine import TrainingEngine
from megatron_lite.core.optim.optimizer import MegatronOptimizer
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.schedules import gpt_forward_step, masked_token_loss
from megatron_lite.core.rerun import RerunConfig, RerunStateMachine

LAYOUT = ParallelLayout.single()


class Objective:
    def forward_step(self, part, microbatch, input_tensor):
        return gpt_forward_step(part, microbatch, input_tensor)

    def loss(self, output, microbatch):
        return masked_token_loss(output, microbatch)


def _engine(**rerun):
    torch.manual_seed(0)
    config = ml.GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=128,
        seq_length=8,
        hidden_dropout=0.2,
        attention_dropout=0.1,
    )
    model = ml.GPTModel(config, LAYOUT, seed=5)
    engine = TrainingEngine(model, LAYOUT, Objective(), MegatronOptimizer(model, ml.OptimizerConfig(lr=1e-2), LAYOUT))
    if rerun:
        engine.rerun = RerunStateMachine(RerunConfig(**rerun))
    return engine


def _batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [[{"tokens": torch.randint(0, 128, (2, 9), generator=g)} for _ in range(2)] for _ in range(steps)]


def _train(engine, steps: int = 6):
    losses, skipped = [], []
    for microbatches in _batches(steps):
        step, result = engine.train_step(microbatches)
        losses.append(float(step.loss))
        skipped.append(result.skipped)
    return losses, skipped, {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_a_spike_after_the_window_is_replayed_and_a_transient_one_changes_nothing():
    reference = _train(_engine())
    engine = _engine(spike_window=3, inject="spike_loss@4", on_reproducible="exit")
    losses, skipped, params = _train(engine)
    counts = engine.rerun.counts
    assert (counts.rejected, counts.transient, counts.reproducible, counts.skipped) == (1, 1, 0, 0)
    assert "loss" in counts.reasons[0][1] and ">= 10 x" in counts.reasons[0][1]
    assert losses == reference[0] and not any(skipped)  # same dropout masks on the replay, nothing applied twice
    for name, value in reference[2].items():
        assert torch.equal(params[name], value), name


def test_no_spike_check_before_the_window_is_full():
    engine = _engine(spike_window=10, inject="spike_loss@4")
    _train(engine)
    assert engine.rerun.counts.rejected == 0


def test_grad_norm_spikes_are_checked_only_when_asked():
    quiet = _engine(spike_window=2, check_loss=False, inject="spike_grad@3")
    _train(quiet)
    assert quiet.rerun.counts.rejected == 0
    strict = _engine(spike_window=2, check_loss=False, check_grad_norm_spikes=True, inject="spike_grad@3")
    _train(strict)
    assert strict.rerun.counts.rejected == 1 and "grad_norm" in strict.rerun.counts.reasons[0][1]


@pytest.mark.parametrize("policy", ["skip", "exit"])
def test_a_reproducible_fault_drops_the_update(policy):
    engine = _engine(inject="nan_loss@2:always", on_reproducible=policy)
    losses, skipped, params = _train(engine)
    assert skipped == [False, False, True, False, False, False]
    assert engine.rerun.exit_requested == (policy == "exit")
    assert engine.optimizer.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in params.values())


def test_continue_applies_a_reproducible_fault_and_the_nan_check_still_guards_the_weights():
    engine = _engine(inject="nan_loss@2:always", on_reproducible="continue")
    with pytest.raises(FloatingPointError, match="check_for_nan_in_grad=False"):
        _train(engine)
    assert engine.rerun.counts.reproducible == 1


def test_state_round_trip():
    engine = _engine(spike_window=3)
    _train(engine, steps=4)
    state = engine.rerun.state_dict()
    fresh = RerunStateMachine(RerunConfig(spike_window=3))
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state and len(state["references"]["loss"]) == 3
