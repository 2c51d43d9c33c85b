"""The core optimizer step in one process: gradient hooks, unused parameters, checkpoint state without
masters, NaN handling, overlapped reduction with unused parameters (multi-rank parity lives in
tests/distributed/test_optimizer_parity.py)."""

import copy

import pytest
import torch
from torch import nn

import megatron_lite as ml
from megatron_lite.core.optim.distributed import DistributedOptimizer
from megatron_lite.core.optim.optimizer import MegatronOptimizer
from megatron_lite.core.parallel.layout import ParallelLayout

LAYOUT = ParallelLayout.single()


class TwoLinears(nn.Module):
    """``used`` takes part in the loss; ``unused`` never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4, bias=False)
        self.unused = nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return self.used(x).pow(2).sum()


def _step(opt: MegatronOptimizer, model: nn.Module) -> None:
    opt.zero_grad()
    model(torch.ones(2, 4, dtype=model.unused.dtype)).backward()
    result = opt.prepare_step()
    opt.optimizer.step()
    opt.finish_step(result)


def config(**kwargs):
    return ml.OptimizerConfig(lr=1e-2, weight_decay=0.1, lr_decay_style="constant", clip_grad=0.0, **kwargs)


@pytest.mark.parametrize("kind", ["plain", "zero1"])
def test_a_parameter_without_gradient_still_takes_megatrons_step(kind):
    """Megatron's gradient buffers give every parameter a (zero) gradient: weight decay applies to it
    under every optimizer and precision alike."""
    torch.manual_seed(0)
    model = TwoLinears()
    opt = (
        MegatronOptimizer(model, config(), LAYOUT)
        if kind == "plain"
        else DistributedOptimizer(model, config(use_distributed_optimizer=True), LAYOUT)
    )
    for _ in range(3):
        _step(opt, model)
    # AdamW with a zero gradient: only the decoupled decay moves it, by (1 - lr * wd) per step
    torch.testing.assert_close(model.unused.detach(), torch.full((4, 4), (1 - 1e-2 * 0.1) ** 3))


@pytest.mark.parametrize("cls", [MegatronOptimizer, DistributedOptimizer])
def test_a_new_optimizer_on_the_same_model_detaches_the_old_one(cls):
    model = TwoLinears().to(torch.bfloat16)
    first = cls(model, config(), LAYOUT)
    first.remove_hooks()  # what GPTModule does before building the next one (a second fit)
    second = cls(model, config(), LAYOUT)
    _step(second, model)

    def buffers(o):
        return [b.buffer for b in o.grad_buffers.buckets]

    assert all(b.abs().sum() == 0 for b in buffers(first)), "the old optimizer still receives gradients"
    assert any(b.abs().sum() > 0 for b in buffers(second))
    # a deep copy (or pickle) of the optimizer carries no hook handles
    assert copy.deepcopy(second).grad_buffers._hooks == []


def test_two_optimizers_on_one_model_without_detaching_fail_with_the_fix():
    model = TwoLinears()
    MegatronOptimizer(model, config(), LAYOUT)
    second = MegatronOptimizer(model, config(), LAYOUT)
    second.zero_grad()
    with pytest.raises(RuntimeError, match="call remove_hooks"):
        model(torch.ones(2, 4)).backward()


def test_zero1_master_shard_is_refreshed_from_loaded_weights_when_the_checkpoint_has_no_masters():
    """A checkpoint written at fp32/bf16-mixed has no fp32 masters: loading it into bf16 weights with
    ZeRO-1 must take the masters from the loaded weights, not keep the pre-load ones."""
    model = TwoLinears().to(torch.bfloat16)
    opt = DistributedOptimizer(model, config(use_distributed_optimizer=True), LAYOUT)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)  # what DCP writes into the weights
    opt.load_checkpoint_state({})
    assert all(torch.all(p == 7.0) for p in model.parameters())
    assert all(torch.all(s.main_shard[: s.bucket.numel] == 7.0) for s in opt.shards)


def test_non_finite_gradients_without_a_loss_scaler_stop_with_the_fix():
    model = TwoLinears()
    opt = MegatronOptimizer(model, config(), LAYOUT)
    opt.zero_grad()
    (model(torch.ones(2, 4)) * float("inf")).backward()
    with pytest.raises(FloatingPointError, match="check_for_nan_in_grad=False"):
        opt.prepare_step()
    before = model.used.weight.detach().clone()
    opt.remove_hooks()  # a second optimizer on the same model takes over its gradients
    lenient = MegatronOptimizer(model, config(check_for_nan_in_grad=False), LAYOUT)
    lenient.zero_grad()
    (model(torch.ones(2, 4)) * float("inf")).backward()
    assert not torch.isfinite(lenient.prepare_step().grad_norm)
    assert torch.equal(model.used.weight.detach(), before)  # nothing stepped yet


def test_overlap_refuses_a_step_in_which_a_bucket_missed_gradients():
    """Launching a missed bucket late would order the collectives differently across ranks."""
    model = TwoLinears()
    opt = DistributedOptimizer(
        model, config(use_distributed_optimizer=True), LAYOUT, bucket_size=16, overlap_grad_reduce=True
    )
    assert len(opt.grad_buffers.buckets) == 2  # one bucket per 16-element parameter
    opt.zero_grad()
    model(torch.ones(2, 4)).backward()
    with pytest.raises(RuntimeError, match="overlap_grad_reduce=False"):
        opt.prepare_step()
