"""HF config.json <-> GPTConfig without transformers: both config formats, the RoPE scaling fields, refusals by
name, and the weight-layout helpers (fused QKV in Megatron's grouped order, vocabulary rows)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lite.core.checkpoint.errors import UnsupportedHFModel
from megatron_lite.core.checkpoint.hf.config import gpt_config_from_hf, hf_config_from_gpt
from megatron_lite.core.checkpoint.hf.weights import fit_vocab_rows, hf_to_state, state_to_hf
from megatron_lite.core.models import GPTConfig
from megatron_lite.core.models.rope import RopeScaling, inverse_frequencies

LLAMA31 = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    hidden_act="silu",
)
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_llama31_in_both_config_formats():
    v4 = gpt_config_from_hf({**LLAMA31, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **SCALING}})
    v5 = gpt_config_from_hf({**LLAMA31, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **SCALING}})
    assert v4 == v5
    assert (v4.num_query_groups, v4.kv_channels, v4.ffn_hidden_size, v4.layernorm_epsilon) == (8, 128, 14336, 1e-5)
    assert v4.rotary_base == 500000.0 and v4.rope_scaling() == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert not v4.share_embeddings_and_output_weights and not v4.add_qkv_bias and not v4.add_bias_linear
    exported = hf_config_from_gpt(v4, "bfloat16", source={**LLAMA31, "bos_token_id": 128000, "eos_token_id": 128001})
    assert exported["rope_theta"] == 500000.0 and exported["rope_scaling"] == {"rope_type": "llama3", **SCALING}
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (128000, 128001)
    assert gpt_config_from_hf(exported) == v4


def test_defaults_of_keys_a_config_leaves_out_and_overrides():
    config = gpt_config_from_hf(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 96,
            "vocab_size": 100,
        },
        seq_length=32,
    )
    # transformers' Llama defaults: MHA, eps 1e-6, theta 10000, untied, 2048 positions
    assert (config.num_query_groups, config.layernorm_epsilon, config.rotary_base) == (4, 1e-6, 10000.0)
    assert config.max_position_embeddings == 2048 and config.seq_length == 32
    with pytest.raises(ValueError, match=r"unknown GPTConfig field\(s\) \['hidden'\]"):
        gpt_config_from_hf({"model_type": "llama"}, hidden=3)


SMALL_GQA = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=96,
    vocab_size=100,
)


def test_qwen2_maps_to_qkv_bias_and_back():
    config = gpt_config_from_hf(
        {
            "model_type": "qwen2",
            **SMALL_GQA,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 2,
        }
    )
    assert config.add_qkv_bias and not config.add_bias_linear and config.share_embeddings_and_output_weights
    exported = hf_config_from_gpt(config, "float32")
    assert exported["model_type"] == "qwen2" and exported["architectures"] == ["Qwen2ForCausalLM"]
    assert gpt_config_from_hf(exported) == config


def test_qwen3_maps_to_qk_layernorm_with_its_own_head_width_and_back():
    qwen3 = {
        "model_type": "qwen3",
        **SMALL_GQA,
        "use_sliding_window": False,
        "sliding_window": 4096,  # ignored without use_sliding_window, as transformers ignores it
    }
    config = gpt_config_from_hf(qwen3)
    assert config.qk_layernorm and not config.add_qkv_bias and not config.add_bias_linear
    assert config.kv_channels == 128  # transformers' Qwen3 default head_dim, not hidden / heads
    assert not config.share_embeddings_and_output_weights
    exported = hf_config_from_gpt(config, "float32")
    assert exported["model_type"] == "qwen3" and exported["architectures"] == ["Qwen3ForCausalLM"]
    assert exported["head_dim"] == 128 and exported["attention_bias"] is False
    assert gpt_config_from_hf(exported) == config
    tied = gpt_config_from_hf({**qwen3, "head_dim": 24, "tie_word_embeddings": True})
    assert tied.kv_channels == 24 and tied.share_embeddings_and_output_weights
    assert gpt_config_from_hf(hf_config_from_gpt(tied, "float32")) == tied


@pytest.mark.parametrize(
    "hf,named",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2'"),
        ({"model_type": "mixtral"}, "model_type 'mixtral'"),
        (
            {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
            "LlamaForSequenceClassification",
        ),
        ({"model_type": "llama", "num_local_experts": 8}, "num_local_experts=8"),
        ({"model_type": "llama", "quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias=True with mlp_bias=False"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096"),
        ({"model_type": "mistral"}, "sliding_window=4096"),  # transformers' Mistral default has a window
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
        ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
        ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=True for qwen3"),
        ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, "model_type 'qwen3_moe'"),
        ({"model_type": "llama", "layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "without 'low_freq_factor'"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_models_and_options_are_refused_by_name(hf, named):
    with pytest.raises(
        UnsupportedHFModel,
        match="HF config: .*" + named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
    ):
        gpt_config_from_hf(hf)


def test_models_transformers_cannot_load_are_not_exported():
    with pytest.raises(UnsupportedHFModel, match=r"normalization='LayerNorm'.*activation='gelu'.*learned_absolute"):
        hf_config_from_gpt(
            GPTConfig(normalization="LayerNorm", activation="gelu", position_embedding_type="learned_absolute"),
            "float32",
        )
    with pytest.raises(UnsupportedHFModel, match=r"qk_layernorm with add_qkv_bias or add_bias_linear"):
        hf_config_from_gpt(GPTConfig(qk_layernorm=True, add_qkv_bias=True), "float32")


def test_rope_scaling_fields_are_validated():
    assert GPTConfig(rope_scaling_type="llama3").rope_scaling() == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert GPTConfig(rotary_base=500000.0).rotary_base == 500000.0
    with pytest.raises(ValueError, match="rope_scaling_factor=2.0 needs rope_scaling_type"):
        GPTConfig(rope_scaling_factor=2.0)
    with pytest.raises(ValueError, match="'linear' needs rope_scaling_factor"):
        GPTConfig(rope_scaling_type="linear")
    with pytest.raises(ValueError, match="rope_low_freq_factor only applies to rope_scaling_type='llama3'"):
        GPTConfig(rope_scaling_type="linear", rope_scaling_factor=2.0, rope_low_freq_factor=1.0)
    with pytest.raises(ValueError, match="rope_low_freq_factor .4.0. must be positive and below"):
        GPTConfig(rope_scaling_type="llama3", rope_low_freq_factor=4.0, rope_high_freq_factor=1.0)
    with pytest.raises(ValueError, match="rotary_base must be a positive number"):
        GPTConfig(rotary_base=0)


def test_llama3_inverse_frequencies_by_hand():
    """Each of the three regimes of Llama 3.1's scaling, computed by hand for one frequency."""
    dim, base, s = 16, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    plain, scaled = inverse_frequencies(dim, base), inverse_frequencies(dim, base, s)
    for f, g in zip(plain.tolist(), scaled.tolist()):
        wavelength = 2 * math.pi / f
        if wavelength < 64 / 4:
            expected = f
        elif wavelength > 64 / 1:
            expected = f / 8
        else:
            t = (64 / wavelength - 1) / (4 - 1)
            expected = (1 - t) * f / 8 + t * f
        assert g == pytest.approx(expected, rel=1e-6)
    regimes = {("kept" if 2 * math.pi / f < 16 else "slowed" if 2 * math.pi / f > 64 else "blended") for f in plain}
    assert regimes == {"kept", "slowed", "blended"}
    torch.testing.assert_close(inverse_frequencies(dim, base, RopeScaling("linear", 4.0)), plain / 4)


def test_qkv_and_gate_up_layouts_round_trip():
    config = GPTConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=2,
        ffn_hidden_size=6,
        vocab_size=10,
        add_qkv_bias=True,
    )
    names = {
        "model.embed_tokens.weight": (10, 8),
        "model.norm.weight": (8,),
        "lm_head.weight": (10, 8),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.0.post_attention_layernorm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.self_attn.q_proj.bias": (8,),
        "model.layers.0.self_attn.k_proj.bias": (4,),
        "model.layers.0.self_attn.v_proj.bias": (4,),
        "model.layers.0.mlp.gate_proj.weight": (6, 8),
        "model.layers.0.mlp.up_proj.weight": (6, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 6),
    }
    hf = {name: torch.randn(shape) for name, shape in names.items()}
    state = hf_to_state(hf, config)
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    # group g: its 2 query heads (rows 4g..4g+3 of q), then its key head, then its value head (2 rows each)
    expected = torch.cat(
        [torch.cat([q[4 * g : 4 * g + 4], k[2 * g : 2 * g + 2], v[2 * g : 2 * g + 2]]) for g in range(2)]
    )
    torch.testing.assert_close(state["layers.0.self_attention.linear_qkv.weight"], expected, rtol=0, atol=0)
    torch.testing.assert_close(state["layers.0.mlp.linear_fc1.weight"][:6], hf["model.layers.0.mlp.gate_proj.weight"])
    padded = dict(state, **{"embedding.weight": fit_vocab_rows(state["embedding.weight"], 16)})
    padded["layers.0.mlp.linear_fc1.weight"] = padded["layers.0.mlp.linear_fc1.weight"].reshape(2, 6, 8)  # as saved
    back = state_to_hf(padded, config)
    assert back.keys() == hf.keys()
    for name in hf:
        torch.testing.assert_close(back[name], hf[name], rtol=0, atol=0)
    assert fit_vocab_rows(torch.ones(10, 2), 16)[10:].abs().sum() == 0
