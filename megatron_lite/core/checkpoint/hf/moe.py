"""The mixture-of-experts half of an HF ``config.json`` <-> :class:`GPTConfig`: Mixtral, Qwen2-MoE and Qwen3-MoE.

The field-by-field mapping is the table in ``docs/hugging-face.md``.

Why the router settings are exact: for softmax scores Megatron's ``pre_softmax=False`` softmaxes the k largest
logits among themselves, which is transformers' softmax over all experts renormalised over its top k (same
experts, same weights); ``pre_softmax=True`` is the softmax over all experts, top k kept as they are.

An export picks the architecture from the model: q/k norms make a Qwen3-MoE, a (gated) shared expert a
Qwen2-MoE, neither a Mixtral; every option of ours that changes what the model computes and that the chosen
architecture cannot express is refused by name. Options of training alone (the load-balancing type other than
its coefficient, z-loss, input jitter, the dispatcher, grouped GEMM) are not written: transformers has none.
"""

from __future__ import annotations

from typing import Any

from megatron_lite.core.checkpoint.errors import UnsupportedHFModel
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.moe_config import moe_layer_pattern

CAUSAL_LM = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# The expert count has two names (below); transformers' default when a config.json gives neither (its other
# defaults are in config.py's, with the dense models').
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts")
DEFAULT_EXPERTS = {"mixtral": 8, "qwen2_moe": 60, "qwen3_moe": 128}
_refuse = UnsupportedHFModel.config_option


def _experts(model_type: str, hf: dict[str, Any]) -> int:
    """The expert count, under either name (transformers 5 saves Qwen3-MoE's as ``num_local_experts``, 4 as
    ``num_experts``; Mixtral's is ``num_local_experts`` with ``num_experts`` as an alias)."""
    given = {key: hf[key] for key in _EXPERT_COUNT_KEYS if hf.get(key) is not None}
    if len(set(given.values())) > 1:
        raise _refuse(f"{given}", "the two names of the expert count must agree")
    experts = next(iter(given.values()), DEFAULT_EXPERTS[model_type])
    if not isinstance(experts, int) or experts < 1:
        name = next(iter(given), _EXPERT_COUNT_KEYS[0])
        raise _refuse(f"{name}={experts!r}", f"a {model_type} model without experts is a dense model")
    return experts


def _layer_freq(hf: dict[str, Any]) -> int | list[int]:
    """transformers' Qwen rule: layer i is MoE unless listed in ``mlp_only_layers``, when (i + 1) is a multiple of
    ``decoder_sparse_step``; as ``moe_layer_freq`` (1 when every layer is MoE, else one 0/1 per layer)."""
    step, dense = hf["decoder_sparse_step"], set(hf["mlp_only_layers"] or ())
    if not isinstance(step, int) or step < 1:
        raise _refuse(f"decoder_sparse_step={step!r}", "every step-th layer is MoE: a step is a positive integer")
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
    if not any(pattern):
        raise _refuse(
            f"decoder_sparse_step={step} with mlp_only_layers={sorted(dense)}",
            "no layer is MoE: import it as the dense model it is",
        )
    return 1 if all(pattern) else pattern


def moe_fields_from_hf(model_type: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The GPTConfig MoE fields of an MoE ``config.json`` (``hf`` with transformers' defaults filled in, but for the
    expert count)."""
    fields: dict[str, Any] = dict(
        num_moe_experts=_experts(model_type, hf),
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(hf["router_aux_loss_coef"] or 0.0),
    )
    if model_type == "mixtral":
        jitter = hf["router_jitter_noise"]
        if jitter:
            raise _refuse(
                f"router_jitter_noise={jitter}",
                "Mixtral multiplies the whole MoE input (the experts' too) by noise in training, "
                'moe_input_jitter_eps the router\'s input alone; set "router_jitter_noise": 0 in config.json to '
                "import it (inference is the same)",
            )
        return dict(fields, moe_ffn_hidden_size=hf["intermediate_size"], moe_router_pre_softmax=False)
    fields.update(
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_router_pre_softmax=not hf["norm_topk_prob"],
        moe_layer_freq=_layer_freq(hf),
    )
    if model_type == "qwen2_moe":
        shared = hf["shared_expert_intermediate_size"]
        if not isinstance(shared, int) or shared < 1:
            raise _refuse(f"shared_expert_intermediate_size={shared!r}", "Qwen2-MoE's shared expert has a width")
        fields.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return fields


def moe_model_type(config: GPTConfig) -> str:
    """The HF architecture an MoE ``config`` is written as; raise naming every option it cannot express."""
    problems = []
    if config.moe_router_score_function != "softmax":
        problems.append(f"moe_router_score_function={config.moe_router_score_function!r} (HF routes by softmax)")
    if config.moe_router_load_balancing_type == "sinkhorn":
        problems.append("moe_router_load_balancing_type='sinkhorn' (it routes by other weights than HF's softmax)")
    if config.moe_router_topk_scaling_factor is not None:
        problems.append(f"moe_router_topk_scaling_factor={config.moe_router_topk_scaling_factor}")
    if config.moe_router_num_groups is not None:
        problems.append(f"moe_router_num_groups={config.moe_router_num_groups} (group-limited routing)")
    if config.moe_expert_capacity_factor is not None:
        problems.append(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (tokens are dropped in evaluation "
            f"too; HF's experts take every token)"
        )
    shared = config.moe_shared_expert_intermediate_size is not None
    if shared and not config.moe_shared_expert_gate:
        problems.append("a shared expert without moe_shared_expert_gate (Qwen2-MoE's shared expert is gated)")
    if config.qk_layernorm:
        model_type = "qwen3_moe"
        if shared:
            problems.append("qk_layernorm with a shared expert (Qwen3-MoE has q/k norms and no shared expert)")
    elif shared:
        model_type = "qwen2_moe"
    else:
        model_type = "mixtral"
        if config.add_qkv_bias:
            problems.append("add_qkv_bias without a shared expert (Qwen2-MoE, the MoE with q/k/v biases, has one)")
        dense = [i for i, moe in enumerate(moe_layer_pattern(config)) if not moe]
        if dense:
            problems.append(f"dense layers {dense[:8]} (moe_layer_freq; every layer of a Mixtral is MoE)")
        if config.moe_router_pre_softmax:
            problems.append("moe_router_pre_softmax=True (Mixtral renormalises the top-k weights)")
    if problems:
        raise UnsupportedHFModel(
            f"this MoE model cannot be written as an HF Mixtral, Qwen2-MoE or Qwen3-MoE: {'; '.join(problems)}."
        )
    return model_type


def moe_hf_fields(config: GPTConfig, model_type: str) -> dict[str, Any]:
    """The MoE keys of ``config.json`` for ``config`` written as ``model_type`` (from :func:`moe_model_type`)."""
    hf: dict[str, Any] = dict(
        num_experts_per_tok=config.moe_router_topk,
        router_aux_loss_coef=config.moe_aux_loss_coeff,
        output_router_logits=False,
    )
    if model_type == "mixtral":
        return dict(
            hf,
            num_local_experts=config.num_moe_experts,
            intermediate_size=config.moe_ffn_hidden_size,
            router_jitter_noise=0.0,
        )
    hf.update(
        num_experts=config.num_moe_experts,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        norm_topk_prob=not config.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(moe_layer_pattern(config)) if not moe],
    )
    if model_type == "qwen2_moe":
        hf.update(
            shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size, qkv_bias=config.add_qkv_bias
        )
    return hf
