"""GPTConfig / OptimizerConfig validation, Megatron's vocabulary padding and LR schedule."""
import math

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.optim import MegatronLRScheduler, build_optimizer, lr_at_step


def test_derived_defaults_and_megatron_vocab_padding():
    c = ml.GPTConfig(hidden_size=96, num_attention_heads=6, vocab_size=50257)
    assert (c.num_query_groups, c.ffn_hidden_size, c.kv_channels, c.max_position_embeddings) == (6, 384, 16, 128)
    assert c.padded_vocab_size(1) == 50304  # Megatron's GPT-2 padding to 128
    assert c.padded_vocab_size(8) == 51200  # multiple of 128 x 8


@pytest.mark.parametrize("kwargs", [
    dict(normalization="LayerNorm", activation="gelu", position_embedding_type="learned_absolute",
         add_bias_linear=True, share_embeddings_and_output_weights=True),
    dict(num_query_groups=2, ffn_hidden_size=88, add_qkv_bias=True),
])
def test_num_parameters_matches_the_model(kwargs):
    config = ml.GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16, **kwargs)
    model = ml.GPTModel(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden_size=30, num_attention_heads=4), "hidden_size .30. must be divisible by num_attention_heads"),
    (dict(num_attention_heads=4, num_query_groups=3), "divisible by num_query_groups"),
    (dict(normalization="BatchNorm"), "normalization must be one of"),
    (dict(activation="relu"), "activation must be one of"),
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(hidden_dropout=1.0), "hidden_dropout must be in"),
])
def test_gpt_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ml.GPTConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=1e-4, min_lr=1e-3), r"min_lr \(0.001\) must be between 0 and lr"),
    (dict(lr_warmup_iters=10, lr_decay_iters=10), r"lr_warmup_iters \(10\) must be smaller than lr_decay_iters"),
    (dict(lr_decay_style="step"), "lr_decay_style must be one of"),
    (dict(lr_decay_style="WSD", lr_decay_iters=100), "needs lr_wsd_decay_iters"),
    (dict(lr_decay_style="WSD", lr_decay_iters=100, lr_wsd_decay_iters=200), "longer than the decay phase"),
])
def test_optimizer_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ml.OptimizerConfig(**kwargs)


def _reference_lr(n, max_lr, min_lr, warmup, decay, style, init=0.0, wsd=None, wsd_style=None):
    """DESIGN.md section 3, written out independently of the implementation."""
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
    else:
        start = decay - wsd
        if n <= start:
            c = 1.0
        else:
            rr = (n - start) / wsd
            c = {"linear": 1 - rr, "cosine": 0.5 * (math.cos(math.pi * rr) + 1), "exponential": 2 * 0.5 ** rr - 1,
                 "minus_sqrt": 1 - math.sqrt(rr)}[wsd_style]
    return min_lr + c * (max_lr - min_lr)


@pytest.mark.parametrize("style, wsd_style", [("constant", None), ("linear", None), ("cosine", None),
                                              ("inverse-square-root", None), ("WSD", "linear"), ("WSD", "cosine"),
                                              ("WSD", "exponential"), ("WSD", "minus_sqrt")])
def test_lr_schedule_follows_megatron_over_a_full_run_and_a_restore(style, wsd_style):
    kw = dict(lr=1.0, min_lr=0.1, lr_warmup_iters=5, lr_warmup_init=0.05, lr_decay_iters=40, lr_decay_style=style)
    if wsd_style:
        kw.update(lr_wsd_decay_iters=10, lr_wsd_decay_style=wsd_style)
    cfg = ml.OptimizerConfig(**kw)
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg)
    sched = MegatronLRScheduler(opt, cfg, 40)
    seen = []
    for step in range(50):
        seen.append(opt.param_groups[0]["lr"])
        if step == 20:  # save and restore mid-run into a fresh optimizer + scheduler
            state = sched.state_dict()
            opt = build_optimizer(torch.nn.Linear(2, 2), cfg)
            sched = MegatronLRScheduler(opt, cfg, 40)
            sched.load_state_dict(state)
        opt.step()
        sched.step()
    expected = [_reference_lr(n, 1.0, 0.1, 5, 40, style, 0.05, 10, wsd_style) for n in range(50)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=1e-12)
