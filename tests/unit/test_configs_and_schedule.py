"""GPTConfig / OptimizerConfig validation and Megatron's vocabulary padding (the LR/WD schedules:
test_optim_schedules.py)."""

import pytest

import megatron_lite as ml


def test_derived_defaults_and_megatron_vocab_padding():
    c = ml.GPTConfig(hidden_size=96, num_attention_heads=6, vocab_size=50257)
    assert (c.num_query_groups, c.ffn_hidden_size, c.kv_channels, c.max_position_embeddings) == (6, 384, 16, 128)
    assert c.padded_vocab_size(1) == 50304  # Megatron's GPT-2 padding to 128
    assert c.padded_vocab_size(8) == 51200  # multiple of 128 x 8


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(
            normalization="LayerNorm",
            activation="gelu",
            position_embedding_type="learned_absolute",
            add_bias_linear=True,
            share_embeddings_and_output_weights=True,
        ),
        dict(num_query_groups=2, ffn_hidden_size=88, add_qkv_bias=True),
        dict(num_query_groups=2, kv_channels=12, qk_layernorm=True),
    ],
)
def test_num_parameters_matches_the_model(kwargs):
    config = ml.GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16, **kwargs)
    model = ml.GPTModel(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hidden_size=30, num_attention_heads=4), "hidden_size .30. must be divisible by num_attention_heads"),
        (dict(num_attention_heads=4, num_query_groups=3), "divisible by num_query_groups"),
        (dict(normalization="BatchNorm"), "normalization must be one of"),
        (dict(activation="relu"), "activation must be one of"),
        (dict(num_layers=0), "num_layers must be a positive integer"),
        (dict(hidden_dropout=1.0), "hidden_dropout must be in"),
    ],
)
def test_gpt_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ml.GPTConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=1e-4, min_lr=1e-3), r"min_lr \(0.001\) must be between 0 and lr"),
        (dict(lr_warmup_iters=10, lr_decay_iters=10), r"lr_warmup_iters \(10\) must be smaller than lr_decay_iters"),
        (dict(lr_decay_style="step"), "lr_decay_style must be one of"),
        (dict(lr_decay_style="WSD", lr_decay_iters=100), "needs lr_wsd_decay_iters"),
        (dict(lr_decay_style="WSD", lr_decay_iters=100, lr_wsd_decay_iters=200), "longer than the decay phase"),
    ],
)
def test_optimizer_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ml.OptimizerConfig(**kwargs)
