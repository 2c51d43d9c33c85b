"""Hugging Face ``config.json`` <-> :class:`GPTConfig` for Llama-architecture models.

Supported: ``llama`` (Llama 2/3/3.1, SmolLM, ...), ``mistral`` without a sliding window, ``qwen2`` (bias on
q/k/v only) and dense ``qwen3`` (per-head RMSNorm of queries and keys: ``qk_layernorm``; a head width of its own)
-- RMSNorm, SwiGLU, RoPE (plain, ``linear`` or ``llama3`` scaling), grouped-query attention, tied or untied
embeddings -- and their mixtures of experts ``mixtral``, ``qwen2_moe`` and ``qwen3_moe``
(:mod:`~megatron_lite.core.checkpoint.hf.moe` maps the experts); weights unquantized or in block-scaled FP8
(:mod:`~megatron_lite.core.checkpoint.hf.fp8_blocks`, dequantized as they are read). Anything else is refused by
name before a weight is read: a model we would load "successfully" but compute differently from transformers is
worse than no model.

Both config formats are read: transformers 4's ``rope_theta`` / ``rope_scaling`` and transformers 5's
``rope_parameters``. Export writes the 4.x keys, which every transformers version since 4.43 (Llama 3.1) reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_lite.core.checkpoint.errors import UnsupportedHFModel
from megatron_lite.core.checkpoint.hf import deepseek, moe
from megatron_lite.core.checkpoint.hf.fp8_blocks import fp8_blocks
from megatron_lite.core.models.config import GPTConfig

CAUSAL_LM = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **moe.CAUSAL_LM,
    **deepseek.CAUSAL_LM,
}

# transformers' Qwen defaults: the vocabulary and context of every Qwen (Qwen3's head width is its own)
_QWEN: dict[str, Any] = dict(vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=False)
_QWEN2_DEFAULTS: dict[str, Any] = dict(
    _QWEN,
    hidden_size=4096,
    intermediate_size=22016,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
)
# Mistral's shape is Mixtral's; Qwen2-MoE's and Qwen3-MoE's routers share their defaults.
_MISTRAL: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096 * 32,
    tie_word_embeddings=False,
)
_QWEN_MOE: dict[str, Any] = dict(
    _QWEN, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, router_aux_loss_coef=0.001
)
# What transformers assumes for a key a config.json leaves out (configs saved as a diff against the defaults).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    "mistral": dict(_MISTRAL, sliding_window=4096),
    "qwen2": _QWEN2_DEFAULTS,
    "qwen3": {**_QWEN2_DEFAULTS, "head_dim": 128},
    # (the expert count has two names: its default is moe.DEFAULT_EXPERTS)
    "mixtral": dict(
        _MISTRAL,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.001,
        router_jitter_noise=0.0,
    ),
    "qwen2_moe": dict(
        _QWEN_MOE,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_experts_per_tok=4,
        qkv_bias=True,
    ),
    "qwen3_moe": dict(
        _QWEN_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
    ),
    deepseek.MODEL_TYPE: deepseek.DEFAULTS,
}
_COMMON_DEFAULTS = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    attention_bias=False,
    mlp_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
)
# Keys that mean experts in a dense model type (an MoE of another architecture).
_MOE_KEYS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts")
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


_refuse = UnsupportedHFModel.config_option


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope theta, the GPTConfig rope-scaling fields) from either config format."""
    params = hf.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise _refuse(f"rope_parameters per layer type ({sorted(params)})", "every layer uses one RoPE here")
    scaling = hf.get("rope_scaling") or params
    theta = params.get("rope_theta", hf.get("rope_theta", _COMMON_DEFAULTS["rope_theta"]))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _refuse(f"partial_rotary_factor={partial}", "Llama rotates every channel of a head")
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return float(theta), {}

    def need(key: str, default: Any = None) -> Any:
        value = scaling.get(key, default)
        if value is None:
            raise UnsupportedHFModel(f"HF config: rope scaling {kind!r} without {key!r}; add it to config.json.")
        return value

    if kind == "yarn" and hf.get("model_type") == deepseek.MODEL_TYPE:
        return float(theta), deepseek.yarn_fields(hf, scaling)
    if kind == "linear":
        return float(theta), dict(rope_scaling_type="linear", rope_scaling_factor=float(need("factor")))
    if kind == "llama3":
        return float(theta), dict(
            rope_scaling_type="llama3",
            rope_scaling_factor=float(need("factor")),
            rope_low_freq_factor=float(need("low_freq_factor")),
            rope_high_freq_factor=float(need("high_freq_factor")),
            rope_original_max_position_embeddings=int(
                need("original_max_position_embeddings", hf.get("max_position_embeddings"))
            ),
        )
    raise _refuse(f"rope scaling type {kind!r}", "supported: default, 'linear', 'llama3' and DeepSeek-V3's 'yarn'")


def _check_architecture(hf: dict[str, Any]) -> str:
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type not in CAUSAL_LM:
        raise _refuse(
            f"model_type {model_type!r} (architectures {architectures})",
            f"megatron-lite imports Llama-architecture models: {sorted(CAUSAL_LM)}",
        )
    other = [a for a in architectures if a != CAUSAL_LM[model_type]]
    if other:
        raise _refuse(f"architectures {other}", f"a {model_type} model is imported as {CAUSAL_LM[model_type]}")
    fp8_blocks(hf)  # block-scaled FP8 is dequantized as it is read; any other quantization is refused
    for key in _MOE_KEYS if model_type not in (*moe.CAUSAL_LM, *deepseek.CAUSAL_LM) else ():
        if hf.get(key):
            raise _refuse(
                f"{key}={hf[key]} (mixture of experts) in a {model_type} model",
                f"the mixtures of experts read are {sorted(moe.CAUSAL_LM)}",
            )
    return model_type


def _check_attention_window(model_type: str, hf: dict[str, Any]) -> None:
    layer_types = hf.get("layer_types") or []
    sliding_layers = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if model_type.startswith("qwen") and hf.get("use_sliding_window"):
        raise _refuse("use_sliding_window=true", "attention here always sees the whole causal context")
    if model_type == "mixtral" and hf.get("sliding_window") is not None:
        raise _refuse(
            f"sliding_window={hf['sliding_window']} (Mixtral's sliding-window attention)",
            "attention here always sees the whole causal context; for sequences no longer than the window "
            'the result is the same: set "sliding_window": null in config.json to import it anyway',
        )
    if model_type == "mistral" and hf.get("sliding_window", _DEFAULTS["mistral"]["sliding_window"]) is not None:
        raise _refuse(
            f"sliding_window={hf.get('sliding_window', 4096)} (Mistral's sliding-window attention)",
            "attention here always sees the whole causal context; for sequences no longer than the window "
            'the result is the same: set "sliding_window": null in config.json to import it anyway',
        )
    if sliding_layers:
        raise _refuse(
            f"layer_types with {layer_types[sliding_layers[0]]!r} layers {sliding_layers[:4]}",
            "every layer uses full causal attention here",
        )


def gpt_config_from_hf(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of an HF ``config.json`` (a dict); ``overrides`` replace fields afterwards
    (``seq_length``, ``make_vocab_size_divisible_by``, dropout, recomputation, ...)."""
    model_type = _check_architecture(hf)
    _check_attention_window(model_type, hf)
    # A null means "the default" (num_key_value_heads: one per head, head_dim: hidden / heads).
    # pretraining_tp is not read: it only slices the same matmuls inside transformers.
    given = hf
    hf = {**_COMMON_DEFAULTS, **_DEFAULTS[model_type], **{k: v for k, v in hf.items() if v is not None}}
    if hf["hidden_act"] not in ("silu", "swish"):
        raise _refuse(f"hidden_act={hf['hidden_act']!r}", "the MLP here is SwiGLU (gate: silu)")
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf["qkv_bias"]))
    qk_layernorm = model_type in ("qwen3", "qwen3_moe")
    all_bias = False
    if qk_layernorm and hf["attention_bias"]:
        raise _refuse(
            f"attention_bias=True for {model_type}",
            "its biases are on q/k/v and o_proj but not the MLP: here either the QKV projection alone or "
            "every linear layer has one",
        )
    if model_type == "llama":
        attention_bias, mlp_bias = bool(hf["attention_bias"]), bool(hf["mlp_bias"])
        if attention_bias != mlp_bias:
            raise _refuse(
                f"attention_bias={attention_bias} with mlp_bias={mlp_bias}",
                "biases are on every linear layer (both true) or on none",
            )
        all_bias = attention_bias
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    theta, rope_scaling = _rope(hf)
    fields: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=head_dim,
        vocab_size=hf["vocab_size"],
        seq_length=hf["max_position_embeddings"],
        max_position_embeddings=hf["max_position_embeddings"],
        normalization="RMSNorm",
        layernorm_epsilon=float(hf["rms_norm_eps"]),
        activation="swiglu",
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=1.0,
        share_embeddings_and_output_weights=bool(hf["tie_word_embeddings"]),
        add_bias_linear=all_bias,
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
        init_method_std=float(hf.get("initializer_range") or 0.02),
        **rope_scaling,
    )
    if model_type in moe.CAUSAL_LM:
        fields.update(moe.moe_fields_from_hf(model_type, hf))
    if model_type == deepseek.MODEL_TYPE:
        del fields["kv_channels"], fields["num_query_groups"]  # MLA's own head widths
        # (DeepSeek's null q_lora_rank means no query compression, not the default)
        fields.update(deepseek.gpt_fields_from_hf({**hf, "q_lora_rank": given.get("q_lora_rank", hf["q_lora_rank"])}))
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {unknown}; overrides must be GPTConfig fields")
    return GPTConfig(**{**fields, **overrides})


def check_exportable(config: GPTConfig) -> None:
    """Raise :class:`UnsupportedHFModel` naming every field of ``config`` an HF Llama/Qwen2/Qwen3 cannot express."""
    problems = []
    if config.normalization != "RMSNorm":
        problems.append(f"normalization={config.normalization!r} (HF Llama uses RMSNorm)")
    if config.activation != "swiglu":
        problems.append(f"activation={config.activation!r} (HF Llama's MLP is SwiGLU)")
    if config.position_embedding_type != "rope":
        problems.append(f"position_embedding_type={config.position_embedding_type!r} (HF Llama uses RoPE)")
    elif config.rotary_percent != 1.0:
        problems.append(f"rotary_percent={config.rotary_percent} (HF Llama rotates whole heads)")
    if config.add_bias_linear and config.add_qkv_bias:
        problems.append("add_bias_linear with add_qkv_bias")
    if config.qk_layernorm and (config.add_bias_linear or config.add_qkv_bias):
        problems.append(
            "qk_layernorm with add_qkv_bias or add_bias_linear (HF Qwen3, the model with q/k norms, has biases "
            "on q/k/v and o_proj together or none)"
        )
    if config.mtp_num_layers and not config.multi_latent_attention:
        problems.append(
            f"mtp_num_layers={config.mtp_num_layers} (of the HF models, only DeepSeek-V3, with multi_latent_attention, "
            f"keeps multi-token prediction layers)"
        )
    if problems:
        raise UnsupportedHFModel(f"this model cannot be written as an HF Llama: {'; '.join(problems)}.")


def hf_config_from_gpt(config: GPTConfig, dtype: str, source: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """An HF ``config.json`` (a dict) for ``config``. ``source`` is the config.json the model was imported
    from, if any: its token ids and model type are kept."""
    check_exportable(config)
    source = source or {}
    if config.multi_latent_attention:
        model_type = deepseek.MODEL_TYPE
    elif config.num_moe_experts is not None:
        model_type = moe.moe_model_type(config)
    elif config.qk_layernorm:
        model_type = "qwen3"  # per-head norms of queries and keys: Qwen3's attention
    elif config.add_qkv_bias:
        model_type = "qwen2"  # bias on q/k/v only: Qwen2's attention
    else:
        imported = source.get("model_type")
        model_type = imported if imported in ("llama", "mistral") else "llama"
    hf: dict[str, Any] = {
        "architectures": [CAUSAL_LM[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": float(config.rotary_base),
        "rope_scaling": _rope_scaling_dict(config),
        "tie_word_embeddings": config.share_embeddings_and_output_weights,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if model_type.startswith("qwen"):
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
    if model_type in ("qwen3", "qwen3_moe"):
        hf.update(attention_bias=False)
    elif model_type in ("mistral", "mixtral"):
        hf.update(sliding_window=None)
    if model_type in moe.CAUSAL_LM:
        hf.update(moe.moe_hf_fields(config, model_type))
    if model_type == deepseek.MODEL_TYPE:
        hf.update(deepseek.hf_fields(config), num_key_value_heads=config.num_attention_heads)
    if model_type == "llama":
        hf.update(attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear)
    elif config.add_bias_linear:
        raise UnsupportedHFModel(
            f"add_bias_linear=True cannot be written as an HF {model_type} model "
            f"(its attention output and MLP have no bias)"
        )
    for key in _TOKEN_KEYS:
        if key in source:
            hf[key] = source[key]
    return hf


def _rope_scaling_dict(config: GPTConfig) -> Optional[dict[str, Any]]:
    scaling = config.rope_scaling()
    if scaling is None:
        return None
    if scaling.kind == "yarn":
        return deepseek.yarn_hf_dict(config)
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }
