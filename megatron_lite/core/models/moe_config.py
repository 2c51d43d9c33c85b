"""GPTConfig's MoE fields checked as Megatron's TransformerConfig checks them (a sibling of config.py, not inside moe/:
the config reads it and the MoE layers read the config), plus the options that would have no effect in the chosen
configuration (refused rather than silently ignored)."""

from __future__ import annotations

import importlib.util
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megatron_lite.core.models.config import GPTConfig

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = ("fp32", "fp64")
DISPATCHERS = ("allgather", "alltoall", "flex")


def _fail(message: str) -> None:
    raise ValueError(message)


def check_moe_fields(config: "GPTConfig") -> None:
    """Raise a ValueError naming the fix for an impossible or ineffective MoE option; resolve moe_ffn_hidden_size."""
    experts = config.num_moe_experts
    if experts is None:
        changed = [f.name for f in fields(config) if f.name.startswith("moe_") and getattr(config, f.name) != f.default]
        if changed:
            verb = "apply" if len(changed) > 1 else "applies"
            _fail(
                f"{', '.join(changed)} only {verb} to a mixture-of-experts model: set num_moe_experts (e.g. 8) or "
                f"leave {'them' if len(changed) > 1 else 'it'} at the default."
            )
        return
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        _fail(f"num_moe_experts must be a positive integer or None (dense), got {experts!r}")
    _check_layer_freq(config)
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    _positive_int("moe_ffn_hidden_size", config.moe_ffn_hidden_size)
    _positive_int("moe_router_topk", config.moe_router_topk)
    if config.moe_router_topk > experts:
        _fail(
            f"moe_router_topk ({config.moe_router_topk}) must be <= num_moe_experts ({experts}): a token cannot go "
            f"to more experts than there are; lower moe_router_topk or add experts."
        )
    _one_of("moe_router_score_function", config.moe_router_score_function, SCORE_FUNCTIONS)
    _one_of("moe_router_load_balancing_type", config.moe_router_load_balancing_type, LOAD_BALANCING_TYPES)
    _one_of("moe_token_drop_policy", config.moe_token_drop_policy, TOKEN_DROP_POLICIES)
    _one_of("moe_token_dispatcher_type", config.moe_token_dispatcher_type, DISPATCHERS)
    if config.moe_router_dtype is not None:
        _one_of("moe_router_dtype", config.moe_router_dtype, ROUTER_DTYPES)
    if config.moe_router_pre_softmax and config.moe_router_score_function != "softmax":
        _fail("moe_router_pre_softmax=True applies to moe_router_score_function='softmax' only; set one of them back.")
    _check_group_limited(config, experts)
    _check_losses(config)
    _check_capacity(config)
    if config.moe_shared_expert_intermediate_size is not None:
        _positive_int("moe_shared_expert_intermediate_size", config.moe_shared_expert_intermediate_size)
    elif config.moe_shared_expert_gate:
        _fail("moe_shared_expert_gate=True gates the shared expert: set moe_shared_expert_intermediate_size too.")
    if config.moe_input_jitter_eps is not None and not 0.0 < config.moe_input_jitter_eps < 1.0:
        _fail(f"moe_input_jitter_eps must be in (0, 1) or None, got {config.moe_input_jitter_eps}")
    if config.moe_router_topk_scaling_factor is not None and config.moe_router_topk_scaling_factor <= 0:
        _fail(f"moe_router_topk_scaling_factor must be positive or None, got {config.moe_router_topk_scaling_factor}")
    if config.moe_token_dispatcher_type == "flex":
        if importlib.util.find_spec("deep_ep") is None:
            _fail(
                "moe_token_dispatcher_type='flex' runs DeepEP's kernels (NVIDIA GPUs with NVLink/RDMA), and deep_ep "
                "is not installed here; use 'alltoall' (or 'allgather'), or install DeepEP."
            )
        _fail(
            "moe_token_dispatcher_type='flex' (DeepEP) is not wired into megatron-lite yet: it needs GPUs to build "
            "and prove; use 'alltoall', which sends the same tokens over NCCL."
        )


def moe_layer_pattern(config: "GPTConfig") -> list[bool]:
    """For each layer (global index), whether it is an MoE layer."""
    if config.num_moe_experts is None:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(config.num_layers)]
    return [bool(flag) for flag in freq]


def check_moe_parallelism(config: "GPTConfig", parallel, sequence_parallel: Optional[bool] = None) -> None:
    """The expert layout of ``parallel`` (a ParallelConfig) against the model: raise naming the fix."""
    experts, ep, etp = config.num_moe_experts, parallel.expert_model_parallel_size, parallel.etp_size
    if experts is None:
        if ep > 1 or parallel.expert_tensor_parallel_size is not None:
            _fail(
                "expert_model_parallel_size / expert_tensor_parallel_size split the experts of MoE layers, and this "
                "model has none (num_moe_experts is None): leave them at their defaults or set num_moe_experts."
            )
        return
    if experts % ep:
        _fail(
            f"num_moe_experts ({experts}) must be divisible by expert_model_parallel_size ({ep}): every expert-"
            f"parallel rank holds the same number of experts; choose an expert_model_parallel_size dividing {experts}."
        )
    assert config.moe_ffn_hidden_size is not None  # resolved by check_moe_fields
    if config.moe_ffn_hidden_size % etp:
        _fail(
            f"moe_ffn_hidden_size ({config.moe_ffn_hidden_size}) must be divisible by expert_tensor_parallel_size "
            f"({etp}); choose an expert_tensor_parallel_size dividing it."
        )
    if config.add_bias_linear and etp > 1 and etp != parallel.tensor_model_parallel_size:
        _fail(
            f"add_bias_linear=True with expert_tensor_parallel_size={etp} != tensor_model_parallel_size "
            f"({parallel.tensor_model_parallel_size}): the experts' output bias is reduced over the TP group; set "
            f"expert_tensor_parallel_size to 1 or to the TP size, or add_bias_linear=False."
        )
    shared = config.moe_shared_expert_intermediate_size
    tp = parallel.tensor_model_parallel_size
    if shared is not None and shared % tp:
        _fail(f"moe_shared_expert_intermediate_size ({shared}) must be divisible by tensor_model_parallel_size ({tp}).")
    sp = parallel.sequence_parallel if sequence_parallel is None else sequence_parallel
    if tp > 1 and not sp:
        _fail(
            f"an MoE model with tensor_model_parallel_size={tp} needs sequence_parallel=True in training (as in "
            f"Megatron: the experts then see each token once, not once per TP rank); set sequence_parallel=True."
        )


def refuse_experts(config: Any, feature: str) -> None:
    """Refuse, naming it, a feature that does not handle a mixture-of-experts model yet (rather than leave its
    experts silently out of it, or fail deep inside on their shapes)."""
    experts = getattr(config, "num_moe_experts", None)
    if experts is not None:
        _fail(
            f"{feature} does not handle mixture-of-experts models yet (this one has num_moe_experts={experts}): "
            f"its experts would be left out; use a dense model for it."
        )


def _check_layer_freq(config: "GPTConfig") -> None:
    freq = config.moe_layer_freq
    if isinstance(freq, bool) or not isinstance(freq, (int, list)):
        _fail(f"moe_layer_freq must be an int (every N-th layer) or a list of 0/1 per layer, got {freq!r}")
    if isinstance(freq, int):
        if freq < 1:
            _fail(f"moe_layer_freq must be >= 1 (1: every layer is MoE), got {freq}")
        return
    if len(freq) != config.num_layers or any(flag not in (0, 1) for flag in freq):
        _fail(
            f"moe_layer_freq as a list needs one 0 (dense) or 1 (MoE) per layer: {config.num_layers} entries, got "
            f"{freq!r}"
        )


def _check_group_limited(config: "GPTConfig", experts: int) -> None:
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        _fail("group-limited routing needs both moe_router_num_groups and moe_router_group_topk (or neither).")
    assert groups is not None and group_topk is not None
    _positive_int("moe_router_num_groups", groups)
    _positive_int("moe_router_group_topk", group_topk)
    if experts % groups:
        _fail(
            f"moe_router_num_groups ({groups}) must divide num_moe_experts ({experts}): the experts are cut into "
            f"equal groups; choose a divisor of {experts}."
        )
    if group_topk > groups:
        _fail(f"moe_router_group_topk ({group_topk}) must be <= moe_router_num_groups ({groups}).")
    if config.moe_router_topk > group_topk * (experts // groups):
        _fail(
            f"moe_router_topk ({config.moe_router_topk}) must be <= the experts in the chosen groups "
            f"(moe_router_group_topk x experts per group = {group_topk} x {experts // groups}); raise "
            f"moe_router_group_topk or lower moe_router_topk."
        )


def _check_losses(config: "GPTConfig") -> None:
    kind = config.moe_router_load_balancing_type
    if config.moe_aux_loss_coeff < 0:
        _fail(f"moe_aux_loss_coeff must be >= 0, got {config.moe_aux_loss_coeff}")
    if config.moe_aux_loss_coeff > 0 and kind in ("sinkhorn", "none"):
        _fail(
            f"moe_aux_loss_coeff={config.moe_aux_loss_coeff} has no effect with moe_router_load_balancing_type="
            f"{kind!r} (no auxiliary loss); set the coefficient to 0 or choose 'aux_loss', 'seq_aux_loss' or "
            f"'global_aux_loss'."
        )
    if config.moe_z_loss_coeff is not None and config.moe_z_loss_coeff <= 0:
        _fail(f"moe_z_loss_coeff must be positive or None (off), got {config.moe_z_loss_coeff}")
    if config.moe_router_enable_expert_bias:
        if config.moe_router_score_function != "sigmoid":
            _fail(
                "moe_router_enable_expert_bias=True (aux-loss-free balancing) needs moe_router_score_function="
                "'sigmoid', as in Megatron and DeepSeek-V3: a bias on softmax scores would shift every expert's "
                "probability; set moe_router_score_function='sigmoid'."
            )
        if kind == "sinkhorn":
            _fail(
                "moe_router_enable_expert_bias=True has no effect with moe_router_load_balancing_type='sinkhorn' "
                "(Sinkhorn balances the choice itself); turn one of them off."
            )
        if config.moe_router_bias_update_rate <= 0:
            _fail(f"moe_router_bias_update_rate must be positive, got {config.moe_router_bias_update_rate}")


def _check_capacity(config: "GPTConfig") -> None:
    factor = config.moe_expert_capacity_factor
    if factor is not None and (isinstance(factor, bool) or not factor > 0):
        _fail(f"moe_expert_capacity_factor must be > 0 or None (dropless), got {factor!r}")
    if factor is None and config.moe_pad_expert_input_to_capacity:
        _fail("moe_pad_expert_input_to_capacity=True needs moe_expert_capacity_factor (the capacity to pad to).")
    if factor is None and config.moe_token_drop_policy != "probs":
        _fail("moe_token_drop_policy only applies with moe_expert_capacity_factor set (dropless drops nothing).")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(f"{name} must be a positive integer, got {value!r}")


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        _fail(f"{name} must be one of {allowed}, got {value!r}")
