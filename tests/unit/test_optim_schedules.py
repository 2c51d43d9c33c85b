"""Megatron's LR and weight-decay schedules, parameter groups and their validation.

Every sequence is compared with the formulas of DESIGN.md section 3, written out here again
independently of megatron_lite.core.optim.scheduler, and read back from the optimizer's own
param_groups after each scheduler step.
"""

import math

import pytest
import torch
from torch import nn

import megatron_lite as ml
from megatron_lite.core.optim import (
    MegatronLRScheduler,
    build_optimizer,
    model_param_entries,
    param_groups,
    schedule_lengths,
)

LR_STYLES = [
    ("constant", None),
    ("linear", None),
    ("cosine", None),
    ("inverse-square-root", None),
    ("WSD", "linear"),
    ("WSD", "cosine"),
    ("WSD", "exponential"),
    ("WSD", "minus_sqrt"),
]
WD_STYLES = {
    "constant": dict(weight_decay=0.1),
    "linear": dict(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1),
    "cosine": dict(weight_decay_incr_style="cosine", start_weight_decay=0.02, end_weight_decay=0.2),
}
LR_MULT = 0.25


# --- the reference (DESIGN.md section 3) -----------------------------------------------------------
def reference_lr(n, *, max_lr, min_lr, init, warmup, decay, style, wsd=None, wsd_style=None):
    if warmup > 0 and n <= warmup:
        return init + (max_lr - init) * n / warmup
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1)))
    r = (n - warmup) / (decay - warmup)
    if style == "linear":
        c = 1 - r
    elif style == "cosine":
        c = 0.5 * (math.cos(math.pi * r) + 1)
    elif n <= decay - wsd:  # WSD, stable phase
        c = 1.0
    else:
        rr = (n - (decay - wsd)) / wsd
        c = {
            "linear": 1 - rr,
            "cosine": 0.5 * (math.cos(math.pi * rr) + 1),
            "exponential": 2 * 0.5**rr - 1,
            "minus_sqrt": 1 - math.sqrt(rr),
        }[wsd_style]
    return min_lr + c * (max_lr - min_lr)


def reference_wd(n, *, start, end, incr, style):
    if style == "constant" or n > incr:
        return end
    r = n / incr
    c = r if style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
    return start + c * (end - start)


# --- a tiny model with one parameter in each of the four groups --------------------------------------
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)  # weight: decayed; bias: not
        self.norm = nn.LayerNorm(3)  # 1-D: not decayed
        self.output_layer = nn.Linear(3, 2)  # lr x LR_MULT; its bias also without weight decay


def make_config(lr_style, wsd_style, wd_style, sample_based, **extra):
    kw = dict(
        lr=1.0,
        min_lr=0.1,
        lr_warmup_init=0.05,
        lr_decay_style=lr_style,
        lr_mult=LR_MULT,
        scale_lr_params=["output_layer.*"],
        **WD_STYLES[wd_style],
    )
    if sample_based:
        kw.update(lr_warmup_samples=20, lr_decay_samples=200)
        if wsd_style:
            kw.update(lr_wsd_decay_samples=60, lr_wsd_decay_style=wsd_style)
    else:
        kw.update(lr_warmup_iters=5, lr_decay_iters=40)
        if wsd_style:
            kw.update(lr_wsd_decay_iters=10, lr_wsd_decay_style=wsd_style)
    kw.update(extra)
    return ml.OptimizerConfig(**kw)


def ramp_increments():
    """Samples per step of a batch-size ramp-up that lands off every phase boundary, then runs past the end."""
    return [4, 4, 8, 8, 12, 12] + [16] * 16


def expected_groups(n, cfg, *, warmup, decay, wsd, incr):
    lr = reference_lr(
        n,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        init=cfg.lr_warmup_init,
        warmup=warmup,
        decay=decay,
        style=cfg.lr_decay_style,
        wsd=wsd,
        wsd_style=cfg.lr_wsd_decay_style,
    )
    wd = reference_wd(
        n,
        start=cfg.weight_decay_range()[0],
        end=cfg.weight_decay_range()[1],
        incr=incr,
        style=cfg.weight_decay_incr_style,
    )
    # The four groups in build order: (wd 1, lr 1), (wd 0, lr 1), (wd 1, lr_mult), (wd 0, lr_mult).
    return [lr, wd, lr, 0.0, lr * LR_MULT, wd, lr * LR_MULT, 0.0]


def group_values(optimizer):
    return [value for group in optimizer.param_groups for value in (group["lr"], group["weight_decay"])]


def run_schedule(cfg, max_steps, increments, *, restore_after=None):
    """(position, [lr, weight_decay of every optimizer group]) after construction and after every step."""
    optimizer = build_optimizer(Tiny(), cfg)
    scheduler = MegatronLRScheduler(optimizer, cfg, max_steps)
    position, seen = 0, []
    for i, increment in enumerate(increments + [None]):
        seen.append((position, group_values(optimizer)))
        if increment is None:
            break
        if i == restore_after:  # a fresh optimizer + scheduler resumed from the counters
            state = scheduler.state_dict()
            optimizer = build_optimizer(Tiny(), cfg)
            scheduler = MegatronLRScheduler(optimizer, cfg, max_steps)
            scheduler.load_state_dict(state)
            assert group_values(optimizer) == seen[-1][1]  # the next optimizer step already uses them
        optimizer.step()
        scheduler.step(increment=increment if cfg.sample_based else None)
        position += increment
    return seen


@pytest.mark.parametrize("wd_style", list(WD_STYLES))
@pytest.mark.parametrize("lr_style, wsd_style", LR_STYLES)
def test_iteration_schedule_sets_every_group(lr_style, wsd_style, wd_style):
    cfg = make_config(lr_style, wsd_style, wd_style, sample_based=False)
    max_steps = 45  # decay ends at 40, weight decay at 45; the run goes on to 55
    seen = run_schedule(cfg, max_steps, [1] * 55)
    assert [n for n, _ in seen] == list(range(56))
    for n, groups in seen:
        expected = expected_groups(n, cfg, warmup=5, decay=40, wsd=10, incr=max_steps)
        assert groups == pytest.approx(expected, rel=1e-12, abs=1e-15), f"step {n}"


@pytest.mark.parametrize("wd_style", list(WD_STYLES))
@pytest.mark.parametrize("lr_style, wsd_style", LR_STYLES)
def test_sample_schedule_follows_consumed_samples_through_a_ramp_up(lr_style, wsd_style, wd_style):
    cfg = make_config(lr_style, wsd_style, wd_style, sample_based=True)
    assert cfg.sample_based
    seen = run_schedule(cfg, None, ramp_increments())
    assert seen[-1][0] > 200  # past the end of the decay
    for n, groups in seen:
        expected = expected_groups(n, cfg, warmup=20, decay=200, wsd=60, incr=200)
        assert groups == pytest.approx(expected, rel=1e-12, abs=1e-15), f"sample {n}"


def test_decay_defaults_to_max_steps_and_warmup_fraction_scales_it():
    cfg = ml.OptimizerConfig(
        lr=1.0,
        min_lr=0.0,
        lr_warmup_fraction=0.25,
        lr_decay_style="linear",
        weight_decay_incr_style="linear",
        start_weight_decay=0.0,
        end_weight_decay=0.4,
    )
    seen = run_schedule(cfg, 30, [1] * 34)
    for n, groups in seen:
        lr = reference_lr(n, max_lr=1.0, min_lr=0.0, init=0.0, warmup=7.5, decay=30, style="linear")
        wd = reference_wd(n, start=0.0, end=0.4, incr=30, style="linear")
        assert groups == pytest.approx([lr, wd, lr, 0.0], rel=1e-12, abs=1e-15)
    sample_cfg = ml.OptimizerConfig(lr=1.0, lr_warmup_fraction=0.1, lr_decay_samples=200)
    assert schedule_lengths(sample_cfg, max_steps=7).warmup == pytest.approx(20.0)


@pytest.mark.parametrize("sample_based", [False, True])
@pytest.mark.parametrize("lr_style, wsd_style", [("cosine", None), ("WSD", "minus_sqrt")])
def test_resuming_mid_run_reproduces_the_remaining_sequence(lr_style, wsd_style, sample_based):
    cfg = make_config(lr_style, wsd_style, "cosine", sample_based)
    increments = ramp_increments() if sample_based else [1] * 50
    uninterrupted = run_schedule(cfg, 45, increments)
    for restore_after in (3, 9, len(increments) - 3):
        assert run_schedule(cfg, 45, increments, restore_after=restore_after) == uninterrupted


def test_scheduler_state_holds_counters_only_and_checks_the_unit():
    iteration_cfg = make_config("cosine", None, "constant", sample_based=False)
    optimizer = build_optimizer(Tiny(), iteration_cfg)
    scheduler = MegatronLRScheduler(optimizer, iteration_cfg, 45)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    assert state == {"num_steps": 3, "unit": "iters", "last_epoch": 3, "_step_count": 4}
    sample_cfg = make_config("cosine", None, "constant", sample_based=True)
    sample_scheduler = MegatronLRScheduler(build_optimizer(Tiny(), sample_cfg), sample_cfg, None)
    with pytest.raises(ValueError, match="counted in iters but this config counts in samples"):
        sample_scheduler.load_state_dict(state)


# --- parameter groups ------------------------------------------------------------------------------
def test_groups_come_from_the_model_params_even_for_flat_master_copies():
    model = Tiny().to(torch.bfloat16)
    model.norm.bias.requires_grad_(False)
    cfg = ml.OptimizerConfig(weight_decay=0.3, lr=0.5, lr_mult=2.0, scale_lr_params=["*output_layer*"])
    # fp32 master copies flattened to 1-D, as a distributed optimizer's shards are.
    masters = {name: p.detach().float().flatten() for name, p in model.named_parameters()}
    entries = [(name, p, masters[name]) for name, p in model.named_parameters()]
    groups = param_groups(entries, cfg)
    members = [{next(n for n, m in masters.items() if m is q) for q in g["params"]} for g in groups]
    assert members == [{"proj.weight"}, {"proj.bias", "norm.weight"}, {"output_layer.weight"}, {"output_layer.bias"}]
    assert [(g["wd_mult"], g["lr_mult"], g["weight_decay"], g["lr"]) for g in groups] == [
        (1.0, 1.0, 0.3, 0.5),
        (0.0, 1.0, 0.0, 0.5),
        (1.0, 2.0, 0.3, 1.0),
        (0.0, 2.0, 0.0, 1.0),
    ]
    assert all(q.dtype == torch.float32 and q.ndim == 1 for g in groups for q in g["params"])


def test_the_same_tensor_twice_is_an_error():
    weight = nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match="'a.weight' and 'b.weight' share one optimizer tensor"):
        param_groups([("a.weight", weight, weight), ("b.weight", weight, weight)], ml.OptimizerConfig())


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_optimizer_applies_each_groups_lr_and_weight_decay(optimizer):
    # With zero gradients one AdamW step (and the first SGD step, whose L2 term is the whole
    # gradient) multiplies each parameter by exactly 1 - lr x weight_decay of its group.
    cfg = ml.OptimizerConfig(
        optimizer=optimizer,
        lr=0.5,
        lr_decay_style="constant",
        weight_decay=0.2,
        lr_mult=0.5,
        scale_lr_params=["output_layer.*"],
    )
    model = Tiny()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = build_optimizer(model_param_entries(model), cfg)
    assert opt.defaults["foreach"] is True
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    factors = {"proj.weight": 1 - 0.5 * 0.2, "output_layer.weight": 1 - 0.25 * 0.2}
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name] * factors.get(name, 1.0), rtol=1e-6, atol=0)


# --- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=1e-4, min_lr=1e-3), r"min_lr \(0.001\) must be between 0 and lr"),
        (
            dict(lr_warmup_iters=10, lr_decay_iters=10),
            r"lr_warmup_iters \(10\) must be smaller than lr_decay_iters \(10\)",
        ),
        (
            dict(lr_warmup_samples=64, lr_decay_samples=32),
            r"lr_warmup_samples \(64\) must be smaller than lr_decay_samples \(32\)",
        ),
        (
            dict(lr_decay_style="WSD", lr_warmup_iters=10, lr_decay_iters=100, lr_wsd_decay_iters=95),
            r"lr_wsd_decay_iters \(95\) is longer than the decay phase \(90 iters",
        ),
        (
            dict(lr_decay_style="WSD", lr_decay_samples=100, lr_wsd_decay_samples=101),
            r"lr_wsd_decay_samples \(101\) is longer than the decay phase \(100 samples",
        ),
        (dict(lr_decay_style="WSD", lr_decay_samples=100), "needs lr_wsd_decay_samples"),
        (
            dict(weight_decay=0.1, end_weight_decay=0.2),
            r"'constant' needs start_weight_decay == end_weight_decay \(got 0.1 and 0.2\); set weight_decay_incr_style",
        ),
        (dict(weight_decay_incr_style="exp"), "weight_decay_incr_style must be one of"),
        (dict(start_weight_decay=-0.1, weight_decay_incr_style="linear"), "start_weight_decay must be >= 0"),
        (
            dict(lr_warmup_iters=5, lr_decay_samples=100),
            r"mixes iteration-based fields \(lr_warmup_iters\) and sample-based fields \(lr_decay_samples\); "
            r"remove lr_warmup_iters .* or lr_decay_samples",
        ),
        (dict(lr_warmup_samples=5), "sample-based schedule .lr_warmup_samples. needs lr_decay_samples"),
        (dict(lr_warmup_fraction=0.1, lr_warmup_iters=3), "lr_warmup_fraction and lr_warmup_iters both set the warmup"),
        (dict(lr_warmup_fraction=1.0), r"lr_warmup_fraction must be in \[0, 1\)"),
        (dict(lr_decay_samples=0), "lr_decay_samples must be positive"),
        (dict(lr_mult=0.1), "lr_mult=0.1 applies only to parameters matching scale_lr_params, which is empty"),
        (dict(lr_mult=0.0, scale_lr_params=["x"]), "lr_mult must be positive"),
        (dict(loss_scale=-1.0), "loss_scale must be positive"),
        (dict(hysteresis=0), "hysteresis must be positive"),
        (dict(loss_scale_window=0), "loss_scale_window must be positive"),
        (dict(min_loss_scale=8.0, initial_loss_scale=4.0), r"min_loss_scale \(8.0\) must be <= initial_loss_scale"),
    ],
)
def test_optimizer_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ml.OptimizerConfig(**kwargs)


def test_scale_lr_params_must_be_a_list():
    with pytest.raises(TypeError, match=r"write \['\*output\*'\]"):
        ml.OptimizerConfig(lr_mult=0.5, scale_lr_params="*output*")


@pytest.mark.parametrize(
    "kwargs, max_steps, message",
    [
        (dict(lr_warmup_iters=5), 3, r"lr_warmup_iters \(5\) must be smaller than lr_decay_iters \(3\)"),
        (
            dict(lr_decay_style="cosine"),
            None,
            "lr_decay_style='cosine' needs a decay length: set optimizer.lr_decay_it",
        ),
        (dict(lr_decay_style="constant", lr_warmup_fraction=0.1), -1, "lr_warmup_fraction needs a decay length"),
        (
            dict(lr_decay_style="constant", weight_decay_incr_style="linear", end_weight_decay=0.5),
            None,
            "weight_decay_incr_style='linear' needs the run length",
        ),
    ],
)
def test_schedule_lengths_reject(kwargs, max_steps, message):
    cfg = ml.OptimizerConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        MegatronLRScheduler(build_optimizer(Tiny(), cfg), cfg, max_steps)


def test_step_increment_must_match_the_unit():
    sample_cfg = ml.OptimizerConfig(lr_decay_samples=100)
    optimizer = build_optimizer(Tiny(), sample_cfg)
    scheduler = MegatronLRScheduler(optimizer, sample_cfg, None)
    optimizer.step()
    with pytest.raises(ValueError, match=r"counted in samples .* call scheduler.step\(increment=<samples"):
        scheduler.step()
    with pytest.raises(ValueError, match="increment must be a non-negative number of samples"):
        scheduler.step(increment=-4)
    iteration_cfg = ml.OptimizerConfig(lr_decay_iters=100)
    scheduler = MegatronLRScheduler(build_optimizer(Tiny(), iteration_cfg), iteration_cfg, None)
    with pytest.raises(ValueError, match=r"counted in optimizer steps .* drop increment=8"):
        scheduler.step(increment=8)
