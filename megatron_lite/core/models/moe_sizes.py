"""Parameter counts of the MLP side of a model, MoE layers included: what ``GPTConfig.num_parameters()`` (every
parameter) and ``num_active_parameters()`` (those one token goes through) add for the layers' MLPs.

An MoE layer holds the router ``[E, H]``, ``E`` experts (each an MLP of width ``moe_ffn_hidden_size``) and an
optional shared expert (an MLP of width ``moe_shared_expert_intermediate_size``, with a ``[1, H]`` sigmoid gate
under ``moe_shared_expert_gate``). A token goes through the router, its ``moe_router_topk`` experts and the shared
expert. The expert-bias buffer of aux-loss-free balancing is no parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_lite.core.models.moe_config import moe_layer_pattern

if TYPE_CHECKING:
    from megatron_lite.core.models.config import GPTConfig


def mlp_weights(config: "GPTConfig", width: int) -> int:
    """The two weight matrices of one MLP of inner width ``width``: fc1 ``[fc1, H]`` (fc1 = 2 x width for SwiGLU's
    gate and up) and fc2 ``[H, width]`` (one multiply-add each per token: what FLOPs count)."""
    return config.hidden_size * width * (3 if config.activation == "swiglu" else 2)


def mlp_parameters(config: "GPTConfig", width: int) -> int:
    """One MLP of inner width ``width``: its weights and, with ``add_bias_linear``, its biases ``[fc1]`` and ``[H]``."""
    fc1 = width * (2 if config.activation == "swiglu" else 1)
    return mlp_weights(config, width) + ((fc1 + config.hidden_size) if config.add_bias_linear else 0)


def moe_router_parameters(config: "GPTConfig") -> int:
    """The router's weight ``[E, H]`` of one MoE layer (0 for a dense model)."""
    return (config.num_moe_experts or 0) * config.hidden_size


def moe_expert_parameters(config: "GPTConfig") -> int:
    """One routed expert's MLP."""
    assert config.moe_ffn_hidden_size is not None  # resolved for MoE models by check_moe_fields
    return mlp_parameters(config, config.moe_ffn_hidden_size)


def moe_shared_expert_parameters(config: "GPTConfig") -> int:
    """The shared expert of one MoE layer with its gate (0 without one)."""
    width = config.moe_shared_expert_intermediate_size
    if width is None:
        return 0
    return mlp_parameters(config, width) + (config.hidden_size if config.moe_shared_expert_gate else 0)


def moe_layer_parameters(config: "GPTConfig", active: bool = False) -> int:
    """One MoE layer's MLP side: router, experts (all of them, or the ``moe_router_topk`` a token is routed to
    when ``active``) and the shared expert."""
    assert config.num_moe_experts is not None  # an MoE model
    experts = config.moe_router_topk if active else config.num_moe_experts
    return (
        moe_router_parameters(config) + experts * moe_expert_parameters(config) + moe_shared_expert_parameters(config)
    )


def mlp_side_parameters(config: "GPTConfig", active: bool = False) -> int:
    """The MLPs of all ``num_layers`` layers: the dense MLP where ``moe_layer_pattern`` is False, the MoE layer
    (all experts, or a token's top-k when ``active``) where it is True."""
    assert config.ffn_hidden_size is not None  # resolved by GPTConfig.__post_init__
    pattern = moe_layer_pattern(config)
    moe = sum(pattern)
    dense = (len(pattern) - moe) * mlp_parameters(config, config.ffn_hidden_size)
    return dense + (moe * moe_layer_parameters(config, active) if moe else 0)
