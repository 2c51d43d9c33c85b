"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) <-> :class:`GPTConfig` and our state: multi-latent attention, YaRN RoPE and
DeepSeek's mixture of experts. The field-by-field mapping is the table in ``docs/deepseek.md``.

Why the mapping is exact:
- attention: transformers' ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj`` are our MLA's ``linear_q_proj`` or ``linear_q_down_proj``/
  ``q_layernorm``/``linear_q_up_proj``, ``linear_kv_down_proj``, ``kv_layernorm``, ``linear_kv_up_proj`` and
  ``linear_proj``, with the same row layouts (per head ``[positionless; rotated]`` queries, ``[key; value]``
  up-projected latents, ``[latent; RoPE key]`` down-projected). DeepSeek's checkpoints rotate interleaved channel
  pairs (``rope_interleave``, transformers' default); ours rotates halves. Rotating pairs ``(x0, x1), (x2, x3)``
  is rotating halves after moving the even channels first, and queries and keys move alike (their product is
  the same), so the rows that produce rotated channels are permuted on import and back on export.
- router: sigmoid scores, the ``e_score_correction_bias`` added for the choice only (our ``expert_bias``),
  group-limited choice, the chosen weights renormalised and scaled by ``routed_scaling_factor`` -- Megatron's
  sigmoid routing when a group's score is the sum of its best ``topk // group_topk`` experts (transformers sums the
  best two: refused otherwise) and the weights are renormalised (``norm_topk_prob``; refused when false).
- the first ``first_k_dense_replace`` layers are dense (``moe_layer_freq`` list); the shared experts are one
  un-gated MLP ``n_shared_experts x moe_intermediate_size`` wide.
- the latent norms: transformers builds them with eps 1e-6 whatever ``rms_norm_eps`` says, ours with
  ``layernorm_epsilon``: another ``rms_norm_eps`` is refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_lite.core.checkpoint.errors import UnsupportedHFModel
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.moe_config import moe_layer_pattern

MODEL_TYPE = "deepseek_v3"
CAUSAL_LM = {MODEL_TYPE: "DeepseekV3ForCausalLM"}
# transformers' DeepseekV3Config defaults, for keys a config.json leaves out.
DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_interleave=True,
)
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which its latent norms keep
_refuse = UnsupportedHFModel.config_option


def yarn_fields(hf: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's YaRN fields from the rope parameters ``scaling`` of a DeepSeek-V3 ``hf`` (transformers' rules for
    the defaults)."""
    if scaling.get("attention_factor") is not None:
        raise _refuse(
            f"YaRN attention_factor={scaling['attention_factor']}", "the cos/sin scale follows from factor and mscale"
        )
    if scaling.get("truncate", True) is not True:
        raise _refuse("YaRN truncate=false", "the ramp's bounds are rounded outwards here, as DeepSeek does")
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise UnsupportedHFModel("HF config: rope scaling 'yarn' without 'original_max_position_embeddings'.")
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if all_dim and not mscale:
        # transformers then scales cos/sin by mscale(factor, 1) but the softmax by mscale(factor, all_dim)^2
        raise _refuse(f"YaRN mscale_all_dim={all_dim} without mscale", "give both (DeepSeek-V3: 1.0 and 1.0)")
    return dict(
        rope_scaling_type="yarn",
        rope_scaling_factor=float(factor),
        rope_original_max_position_embeddings=int(original),
        rope_beta_fast=float(scaling.get("beta_fast") or 32),
        rope_beta_slow=float(scaling.get("beta_slow") or 1),
        rope_mscale=float(mscale) if all_dim and mscale else 1.0,
        rope_mscale_all_dim=float(all_dim or 0.0),
    )


def gpt_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The attention and MoE GPTConfig fields of a DeepSeek-V3 ``config.json`` (``hf`` with the defaults filled in;
    the generic reader reads the rest, RoPE with :func:`yarn_fields`)."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if scaling.get("mscale_all_dim") and scaling.get("rope_type", scaling.get("type")) != "yarn":
        raise _refuse("mscale_all_dim without YaRN", "the softmax rescaling comes with YaRN here")
    if hf["attention_bias"]:
        raise _refuse("attention_bias=True", "MLA's projections here have no biases")
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads") not in (None, heads):
        raise _refuse(
            f"num_key_value_heads={hf['num_key_value_heads']} with {heads} heads",
            "multi-latent attention expands one key and value per head (set it to num_attention_heads)",
        )
    if float(hf["rms_norm_eps"]) != LATENT_NORM_EPS:
        raise _refuse(
            f"rms_norm_eps={hf['rms_norm_eps']}",
            f"transformers normalizes DeepSeek's latents with eps {LATENT_NORM_EPS} whatever rms_norm_eps says, "
            f"megatron-lite every norm with one eps",
        )
    fields: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
    )
    if hf.get("num_nextn_predict_layers"):  # the MTP layers kept after the decoder's (transformers ignores them)
        fields["mtp_num_layers"] = int(hf["num_nextn_predict_layers"])
    fields.update(_moe_fields(hf))
    return fields


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    layers, dense = hf["num_hidden_layers"], hf["first_k_dense_replace"] or 0
    experts = hf["n_routed_experts"]
    if dense >= layers or not experts:
        return {}  # a dense model: transformers builds no MoE layer
    topk, groups, group_topk = hf["num_experts_per_tok"], hf["n_group"] or 1, hf["topk_group"] or 1
    if not hf["norm_topk_prob"] and topk > 1:
        raise _refuse("norm_topk_prob=False", "sigmoid routing here renormalises the chosen experts' weights")
    if hf["norm_topk_prob"] and topk == 1:
        raise _refuse("norm_topk_prob=True with one expert per token", "its weight would be 1 in transformers")
    fields: dict[str, Any] = dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_topk=topk,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.0,
        moe_layer_freq=1 if dense == 0 else [0] * dense + [1] * (layers - dense),
    )
    factor = hf["routed_scaling_factor"]
    if factor is not None and float(factor) != 1.0:
        fields["moe_router_topk_scaling_factor"] = float(factor)
    if groups > 1:
        if topk // group_topk != 2:
            raise _refuse(
                f"num_experts_per_tok={topk} with topk_group={group_topk}",
                "transformers scores a group by its best two experts, Megatron's rule by its best "
                "num_experts_per_tok // topk_group: they agree when that is 2 (DeepSeek-V3: 8 // 4)",
            )
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    shared = hf["n_shared_experts"]
    if shared:
        fields["moe_shared_expert_intermediate_size"] = shared * hf["moe_intermediate_size"]
    return fields


def hf_fields(config: GPTConfig) -> dict[str, Any]:
    """The DeepSeek-V3 keys of a ``config.json`` for an MLA ``config`` (rope written by the generic writer, YaRN here);
    raise naming every option DeepSeek-V3 cannot express."""
    problems = []
    if config.layernorm_epsilon != LATENT_NORM_EPS:
        problems.append(f"layernorm_epsilon={config.layernorm_epsilon} (its latent norms use {LATENT_NORM_EPS})")
    pattern = moe_layer_pattern(config)
    dense = pattern.index(True) if any(pattern) else config.num_layers
    hf: dict[str, Any] = dict(
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_head_dim,
        qk_rope_head_dim=config.qk_pos_emb_head_dim,
        v_head_dim=config.v_head_dim,
        head_dim=config.qk_pos_emb_head_dim,
        rope_interleave=True,
        attention_bias=False,
        first_k_dense_replace=dense,
        num_nextn_predict_layers=config.mtp_num_layers or 0,
    )
    if config.num_moe_experts is None:
        hf.update(n_routed_experts=1, n_shared_experts=0, num_experts_per_tok=1, n_group=1, topk_group=1)
        hf.update(moe_intermediate_size=config.ffn_hidden_size, routed_scaling_factor=1.0, norm_topk_prob=False)
    else:
        problems += _moe_problems(config, pattern, dense)
        shared = config.moe_shared_expert_intermediate_size
        hf.update(
            n_routed_experts=config.num_moe_experts,
            moe_intermediate_size=config.moe_ffn_hidden_size,
            n_shared_experts=(shared // config.moe_ffn_hidden_size) if shared and config.moe_ffn_hidden_size else 0,
            num_experts_per_tok=config.moe_router_topk,
            n_group=config.moe_router_num_groups or 1,
            topk_group=config.moe_router_group_topk or 1,
            routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
            norm_topk_prob=config.moe_router_topk > 1,
        )
    if problems:
        raise UnsupportedHFModel(f"this MLA model cannot be written as an HF DeepSeek-V3: {'; '.join(problems)}.")
    return hf


def _moe_problems(config: GPTConfig, pattern: list[bool], dense: int) -> list[str]:
    problems = []
    if config.moe_router_score_function != "sigmoid":
        problems.append(f"moe_router_score_function={config.moe_router_score_function!r} (DeepSeek's is sigmoid)")
    if pattern != [False] * dense + [True] * (config.num_layers - dense):
        problems.append("moe_layer_freq other than dense first layers then MoE (DeepSeek's first_k_dense_replace)")
    shared, width = config.moe_shared_expert_intermediate_size, config.moe_ffn_hidden_size
    if shared is not None and (config.moe_shared_expert_gate or width is None or shared % width):
        problems.append("a shared expert that is gated or not a multiple of moe_ffn_hidden_size wide")
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if groups is not None and group_topk is not None and config.moe_router_topk // group_topk != 2:
        problems.append("group-limited routing with moe_router_topk // moe_router_group_topk != 2")
    if config.moe_expert_capacity_factor is not None:
        problems.append(f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (HF drops no token)")
    if config.moe_router_load_balancing_type == "sinkhorn":
        problems.append("moe_router_load_balancing_type='sinkhorn'")
    return problems


def yarn_hf_dict(config: GPTConfig) -> dict[str, Any]:
    """transformers' rope parameters of a 'yarn' ``config``."""
    scaling = config.rope_scaling()
    assert scaling is not None and scaling.kind == "yarn"
    return {
        "rope_type": "yarn",
        "factor": scaling.factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
        "beta_fast": scaling.beta_fast,
        "beta_slow": scaling.beta_slow,
        "mscale": scaling.mscale,
        "mscale_all_dim": scaling.mscale_all_dim,
    }


# --- weights ------------------------------------------------------------------------------------------------------
_NORMS = (("q_a_layernorm", "q_layernorm"), ("kv_a_layernorm", "kv_layernorm"))


def _names(config: GPTConfig) -> list[tuple[str, str]]:
    """(HF name under ``self_attn.``, ours under ``self_attention.``) of one MLA layer's weights."""
    names = [
        ("kv_a_proj_with_mqa", "linear_kv_down_proj"),
        ("kv_b_proj", "linear_kv_up_proj"),
        ("o_proj", "linear_proj"),
    ]
    if config.q_lora_rank is None:
        return [("q_proj", "linear_q_proj"), *names]
    return [("q_a_proj", "linear_q_down_proj"), ("q_b_proj", "linear_q_up_proj"), *names]


def attention_shapes(prefix: str, config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """HF names (under ``prefix``, a layer's ``self_attn.``) and shapes of one MLA layer's tensors."""
    assert config.kv_lora_rank and config.qk_head_dim and config.qk_pos_emb_head_dim and config.v_head_dim  # MLA's
    h, heads, rank = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
    q_width = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    shapes = {
        prefix + "kv_a_proj_with_mqa.weight": (rank + config.qk_pos_emb_head_dim, h),
        prefix + "kv_a_layernorm.weight": (rank,),
        prefix + "kv_b_proj.weight": (heads * (config.qk_head_dim + config.v_head_dim), rank),
        prefix + "o_proj.weight": (h, heads * config.v_head_dim),
    }
    if config.q_lora_rank is None:
        shapes[prefix + "q_proj.weight"] = (q_width, h)
    else:
        shapes.update(
            {
                prefix + "q_a_proj.weight": (config.q_lora_rank, h),
                prefix + "q_a_layernorm.weight": (config.q_lora_rank,),
                prefix + "q_b_proj.weight": (q_width, config.q_lora_rank),
            }
        )
    return shapes


def _rotated_rows(config: GPTConfig, hf_name: str) -> Optional[torch.Tensor]:
    """For a weight whose output rows include rotated channels, the row order that turns DeepSeek's interleaved pairs
    into our halves (``ours = theirs[order]``); None for the others."""
    assert config.qk_head_dim is not None and config.qk_pos_emb_head_dim is not None and config.kv_lora_rank
    pos = config.qk_pos_emb_head_dim
    halves = torch.cat([torch.arange(0, pos, 2), torch.arange(1, pos, 2)])
    if hf_name == "kv_a_proj_with_mqa":
        return torch.cat([torch.arange(config.kv_lora_rank), config.kv_lora_rank + halves])
    if hf_name in ("q_proj", "q_b_proj"):
        width, nope = config.qk_head_dim + pos, config.qk_head_dim
        per_head = torch.cat([torch.arange(nope), nope + halves])
        return torch.cat([head * width + per_head for head in range(config.num_attention_heads)])
    return None


def attention_to_state(
    source: Any, hf_prefix: str, ours: str, config: GPTConfig, interleaved: bool
) -> dict[str, torch.Tensor]:
    """Our tensors (under ``ours``, a layer's ``self_attention.``) of one HF MLA layer (under ``hf_prefix``)."""
    state = {}
    for hf_name, our_name in _names(config):
        weight = source[f"{hf_prefix}{hf_name}.weight"]
        order = _rotated_rows(config, hf_name) if interleaved else None
        state[f"{ours}{our_name}.weight"] = weight[order] if order is not None else weight
    for hf_norm, our_norm in _NORMS[0 if config.q_lora_rank is not None else 1 :]:
        state[f"{ours}{our_norm}.weight"] = source[f"{hf_prefix}{hf_norm}.weight"]
    return state


def attention_to_hf(source: Any, hf_prefix: str, ours: str, config: GPTConfig) -> dict[str, torch.Tensor]:
    """One MLA layer's HF tensors in DeepSeek's interleaved-RoPE layout (``rope_interleave: true``)."""
    out = {}
    for hf_name, our_name in _names(config):
        weight = source[f"{ours}{our_name}.weight"]
        order = _rotated_rows(config, hf_name)
        out[f"{hf_prefix}{hf_name}.weight"] = weight[torch.argsort(order)] if order is not None else weight
    for hf_norm, our_norm in _NORMS[0 if config.q_lora_rank is not None else 1 :]:
        out[f"{hf_prefix}{hf_norm}.weight"] = source[f"{ours}{our_norm}.weight"]
    return out
