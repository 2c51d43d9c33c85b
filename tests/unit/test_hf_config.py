"""HF config.json <-> GPTConfig without transformers: both config formats, the RoPE scaling fields, refusals by
name, and the weight-layout helpers (fused QKV in Megatron's grouped order, vocabulary rows)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lite.core.checkpoint.errors import UnsupportedHFModel
from megatron_lite.core.checkpoint.hf.config import gpt_config_from_hf, hf_config_from_gpt
from megatron_lite.core.checkpoint.hf.weights import fit_vocab_rows, hf_shapes, hf_to_state, state_to_hf
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
        ({"model_type": "mixtral_v2"}, "model_type 'mixtral_v2'"),
        (
            {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]},
            "LlamaForSequenceClassification",
        ),
        ({"model_type": "llama", "num_local_experts": 8}, "num_local_experts=8 (mixture of experts) in a llama model"),
        ({"model_type": "mixtral", "router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
        ({"model_type": "mixtral", "sliding_window": 4096}, "sliding_window=4096 (Mixtral's"),
        ({"model_type": "mixtral", "num_local_experts": 8, "num_experts": 4}, "the two names of the expert count"),
        ({"model_type": "qwen2_moe", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "qwen2_moe", "num_experts": 0}, "num_experts=0"),
        ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
        ({"model_type": "qwen2_moe", "decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ({"model_type": "qwen3_moe", "num_hidden_layers": 2, "mlp_only_layers": [0, 1]}, "no layer is MoE"),
        ({"model_type": "qwen3_moe", "attention_bias": True}, "attention_bias=True for qwen3_moe"),
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
        ({"model_type": "qwen3_moe", "architectures": ["Qwen3ForCausalLM"]}, "a qwen3_moe model is imported as"),
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


SMALL_MOE = dict(SMALL_GQA, num_experts_per_tok=2, router_aux_loss_coef=0.01)


def test_mixtral_maps_to_renormalised_softmax_top_k_and_back():
    # transformers 4's keys, its defaults for the rest (rope theta 1e6, 8 experts)
    mixtral = {"model_type": "mixtral", **SMALL_MOE, "rope_theta": 1e6, "sliding_window": None}
    config = gpt_config_from_hf(mixtral)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 96)
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
    assert config.moe_layer_freq == 1 and config.moe_shared_expert_intermediate_size is None
    assert config.moe_router_load_balancing_type == "aux_loss" and config.moe_aux_loss_coeff == 0.01
    assert (
        config.rotary_base == 1e6
        and gpt_config_from_hf({k: v for k, v in mixtral.items() if k != "rope_theta"}) == config
    )
    exported = hf_config_from_gpt(config, "float32")
    assert exported["model_type"] == "mixtral" and exported["architectures"] == ["MixtralForCausalLM"]
    assert (exported["num_local_experts"], exported["intermediate_size"], exported["router_jitter_noise"]) == (
        8,
        96,
        0.0,
    )
    assert gpt_config_from_hf(exported) == config


def test_qwen2_moe_maps_its_shared_expert_and_dense_layers_and_back():
    qwen2_moe = {
        "model_type": "qwen2_moe",
        **SMALL_MOE,
        "num_hidden_layers": 6,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 2,  # layers 1, 3, 5 are MoE ...
        "mlp_only_layers": [3],  # ... but layer 3
    }
    config = gpt_config_from_hf(qwen2_moe)
    assert config.moe_layer_freq == [0, 1, 0, 0, 0, 1] and config.ffn_hidden_size == 96
    assert config.moe_router_pre_softmax  # norm_topk_prob=False (the default): the top k are not renormalised
    assert (config.moe_shared_expert_intermediate_size, config.moe_shared_expert_gate) == (48, True)
    assert config.add_qkv_bias and not config.qk_layernorm and config.moe_ffn_hidden_size == 32
    assert not gpt_config_from_hf({**qwen2_moe, "qkv_bias": False}).add_qkv_bias  # transformers 5's option
    assert not gpt_config_from_hf({**qwen2_moe, "norm_topk_prob": True}).moe_router_pre_softmax
    exported = hf_config_from_gpt(config, "float32")
    assert exported["model_type"] == "qwen2_moe" and exported["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (exported["decoder_sparse_step"], exported["mlp_only_layers"]) == (1, [0, 2, 3, 4])
    assert (exported["norm_topk_prob"], exported["qkv_bias"], exported["shared_expert_intermediate_size"]) == (
        False,
        True,
        48,
    )
    assert gpt_config_from_hf(exported) == config


def test_qwen3_moe_under_either_name_of_its_expert_count_and_back():
    qwen3_moe = {"model_type": "qwen3_moe", **SMALL_MOE, "moe_intermediate_size": 32, "norm_topk_prob": True}
    v4 = gpt_config_from_hf({**qwen3_moe, "num_experts": 4})
    v5 = gpt_config_from_hf({**qwen3_moe, "num_local_experts": 4})  # what transformers 5 saves
    assert v4 == v5 and v4.num_moe_experts == 4 and v4.qk_layernorm and not v4.add_qkv_bias
    assert not v4.moe_router_pre_softmax and v4.moe_layer_freq == 1 and v4.kv_channels == 16  # no head_dim default
    exported = hf_config_from_gpt(v4, "float32")
    assert exported["model_type"] == "qwen3_moe" and exported["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (exported["norm_topk_prob"], exported["mlp_only_layers"], exported["attention_bias"]) == (True, [], False)
    assert gpt_config_from_hf(exported) == v4


MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, num_moe_experts=4)


@pytest.mark.parametrize(
    "fields,named",
    [
        (dict(moe_router_score_function="sigmoid"), "moe_router_score_function='sigmoid'"),
        (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type='sinkhorn'"),
        (dict(moe_router_topk_scaling_factor=2.5), "moe_router_topk_scaling_factor=2.5"),
        (dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_num_groups=2"),
        (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor=1.0"),
        (dict(moe_shared_expert_intermediate_size=32), "a shared expert without moe_shared_expert_gate"),
        (
            dict(qk_layernorm=True, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True),
            "qk_layernorm with a shared expert",
        ),
        (dict(add_qkv_bias=True), "add_qkv_bias without a shared expert"),
        (dict(moe_layer_freq=2), r"dense layers \[1\]"),
        (dict(moe_router_pre_softmax=True), "moe_router_pre_softmax=True"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_moe_options_transformers_cannot_express_are_not_exported(fields, named):
    with pytest.raises(
        UnsupportedHFModel, match="cannot be written as an HF Mixtral, Qwen2-MoE or Qwen3-MoE: .*" + named
    ):
        hf_config_from_gpt(GPTConfig(**MOE, **fields), "float32")


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


@pytest.mark.parametrize("fused", [False, True], ids=["one tensor per expert", "transformers 5 fused"])
def test_expert_layouts_round_trip(fused):
    """Experts' [gate; up] land in our global linear_fc1 [E, 2f, h] expert by expert, the shared expert's in its
    dense linear_fc1; back out (from the blocked [E, 2, f, h] our checkpoints store) bit for bit, one tensor each."""
    config = GPTConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        ffn_hidden_size=6,
        vocab_size=10,
        num_moe_experts=3,
        moe_ffn_hidden_size=4,
        moe_layer_freq=[0, 1],
        moe_shared_expert_intermediate_size=2,
        moe_shared_expert_gate=True,
    )
    shapes = hf_shapes(config, fused_experts=fused)
    hf = {name: torch.randn(shape) for name, shape in shapes.items()}
    state = hf_to_state(hf, config)
    p, ours = "model.layers.1.mlp.", "layers.1.mlp."
    fc1, fc2 = state[ours + "experts.linear_fc1.weight"], state[ours + "experts.linear_fc2.weight"]
    assert fc1.shape == (3, 8, 8) and fc2.shape == (3, 8, 4)
    if fused:
        assert torch.equal(fc1, hf[p + "experts.gate_up_proj"]) and torch.equal(fc2, hf[p + "experts.down_proj"])
    else:
        for j in range(3):
            assert torch.equal(fc1[j, :4], hf[f"{p}experts.{j}.gate_proj.weight"])
            assert torch.equal(fc1[j, 4:], hf[f"{p}experts.{j}.up_proj.weight"])
            assert torch.equal(fc2[j], hf[f"{p}experts.{j}.down_proj.weight"])
    assert torch.equal(state[ours + "shared_experts.linear_fc1.weight"][2:], hf[p + "shared_expert.up_proj.weight"])
    assert torch.equal(state[ours + "shared_experts.gate_weight"], hf[p + "shared_expert_gate.weight"])
    assert torch.equal(state[ours + "router.weight"], hf[p + "gate.weight"])
    assert "layers.0.mlp.linear_fc1.weight" in state  # layer 0 is dense
    state[ours + "experts.linear_fc1.weight"] = fc1.reshape(3, 2, 4, 8)  # as saved
    back = state_to_hf(state, config)
    per_expert = hf_to_state(back, config)
    assert back.keys() == hf_shapes(config).keys() and per_expert.keys() == state.keys()
    for name in per_expert:
        assert torch.equal(per_expert[name].flatten(), state[name].flatten()), name


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
