"""Activation bytes of a Mixture-of-Experts layer (router -> token dispatcher -> experts -> combine, and the shared
expert), what it keeps for backward in place of a dense MLP and what its dispatcher holds while it runs.

How many rows an expert gets depends on the routing, which depends on the data: the estimate assumes **balanced
routing** (every expert gets ``top-k x T / E`` of the ``T`` tokens), the expectation of a dropless layer and the
most a capacity factor lets through. Per rank (``T`` its sequence-parallel share of a microbatch's tokens):

* the experts run ``top-k x T x ETP`` rows (the ``E / EP`` local experts get the tokens of the whole ETP x EP
  group that are routed to them, each ETP rank every row of its experts): their inputs, the MLP's intermediate
  activations at width ``moe_ffn_hidden_size / ETP``, and under autocast a low-precision copy of every local
  expert weight per microbatch (cast per expert in each forward, not cached for the step like dense weights);
* the router keeps its fp32 input and a few ``[T, top-k]`` / ``[T, E]`` tensors (scores, indices, masks, the
  auxiliary losses' softmax and z-loss logits);
* the combine keeps the experts' outputs weighted by their routing probabilities (fp32) for the rows this rank
  combines: all of them with ``allgather``, its own tokens' ``top-k x T`` with ``alltoall``;
* while it dispatches and combines, ``allgather`` holds the tokens of the whole ETP x EP group (``EP x ETP x T x
  H``: gathered, then twice while they are summed before the reduce-scatter), ``alltoall`` the ``top-k x T x H``
  permuted tokens (``x ETP`` more where the expert tensor-parallel ranks exchange them) or twice its ``T x H``
  sum: a transient on top of what is held.

Measured against the saved-tensor probe on CPU (torch 2.13) for the loop over experts; torch's grouped GEMM
keeps the same tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_lite.core.estimator.precision_bytes import PRECISION_BYTES
from megatron_lite.core.models.config import GPTConfig

if TYPE_CHECKING:  # memory.py imports activations.py, which imports this module: the type only
    from megatron_lite.core.estimator.memory import EstimateLayout

AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def _sizes(config: GPTConfig, layout: "EstimateLayout") -> tuple:
    """(tokens of a microbatch per rank before the MoE split, T: the MoE layer's tokens per rank, rows the local
    experts run, rows this rank combines)."""
    assert config.num_moe_experts is not None  # an MoE layer
    tp, etp = layout.tensor_model_parallel_size, layout.etp_size
    tokens = layout.local_seq_length * layout.micro_batch_size
    local = tokens // tp  # the MoE layer takes its sequence-parallel share of the tokens
    factor = config.moe_expert_capacity_factor
    # Balanced routing: a capacity of at least the even share drops nothing; padding fills every expert to it.
    fill = 1.0 if factor is None else (factor if config.moe_pad_expert_input_to_capacity else min(factor, 1.0))
    routed = int(config.moe_router_topk * local * fill)
    rows = routed * etp
    combined = rows if config.moe_token_dispatcher_type == "allgather" else routed
    return tokens, local, rows, combined


def moe_layer_parts(config: GPTConfig, layout: "EstimateLayout", residual: int = 0) -> dict:
    """Bytes the MLP side of one MoE layer keeps for backward on one rank for one microbatch, by part (the
    attention side and the norms are the dense layer's); ``residual``: bytes per element of the layer's residual
    stream where it is not the precision's (an MTP depth's layer)."""
    pb = PRECISION_BYTES[layout.precision]
    c, n = pb.compute, residual or pb.residual  # matmul outputs; the norm's output (autocast leaves norms alone)
    h, experts, k = config.hidden_size, config.num_moe_experts, config.moe_router_topk
    assert experts is not None and config.moe_ffn_hidden_size is not None  # an MoE layer
    tokens, local, rows, combined = _sizes(config, layout)
    split = layout.tensor_model_parallel_size > 1
    router = 8 if config.moe_router_dtype == "fp64" else 4
    shared = config.moe_shared_expert_intermediate_size
    gate = config.moe_shared_expert_gate
    jitter = bool(config.moe_input_jitter_eps)

    # The layer's input x (the norm's output, [T, H]) is kept by whichever of router, shared expert and gate
    # multiplies it as it is; each that needs another dtype keeps a copy of its own.
    x_kept = (router == n and not jitter) or (c == n and shared is not None and (not split or gate))
    inputs = local * h * n if x_kept else 0
    if jitter:  # the noise, and the jittered input (in the router's dtype)
        inputs += local * h * n + local * h * router
    elif router != n:
        inputs += local * h * router
    if shared is not None:
        inputs += tokens * h * c if split or c != n else 0  # the shared fc1's input (all-gathered under SP)
        inputs += local * h * c if gate and c != n else 0
    parts = {"moe_inputs": inputs}

    scores = local * experts * 4
    kind = config.moe_router_load_balancing_type
    if kind == "sinkhorn":
        routing = scores + local * experts  # the softmax and the chosen-experts mask
    elif config.moe_router_score_function == "sigmoid":
        routing = local * k * 8 + scores + ((local * k * 4 + local * 4) if k > 1 else 0)  # top-k renormalised
    else:
        routing = local * k * 8 + (scores if config.moe_router_pre_softmax else local * k * 4)
    if config.moe_aux_loss_coeff > 0 and kind in AUX_LOSS_TYPES:
        routing += scores  # the scores the load-balancing loss differentiates
    if config.moe_z_loss_coeff:
        routing += scores + local * 4  # logits kept by the log-sum-exp
    if config.moe_router_num_groups:
        routing += local * experts  # the mask of the chosen groups
    if config.moe_expert_capacity_factor is not None:
        routing += local * experts  # the mask of the kept (token, expert) pairs
    if pb.weight != router:  # the router multiplies an fp32 copy of its weight
        routing += experts * h * router
    parts["router"] = routing

    # Sorting by expert keeps each routed pair's (token, expert) indices and routing weight (fp32).
    parts["dispatch"] = (24 * rows if config.moe_token_dispatcher_type == "allgather" else 16 * combined + 8 * rows) + (
        4 * combined
    )

    # An fp32 bias added to 16-bit GEMM outputs (autocast over fp32 weights) promotes them to fp32.
    act = 4 if config.add_bias_linear and c < pb.weight else c
    width = config.moe_ffn_hidden_size // layout.etp_size
    if config.activation == "swiglu":  # fc1 output [gate; up], silu output, product (and its 16-bit cast for fc2)
        mlp = rows * width * (4 * act + (c if act != c else 0))
    else:  # fc1 output, GeLU output (the 16-bit cast fc2 multiplies)
        mlp = rows * width * (act + c)
    local_experts = experts // layout.expert_model_parallel_size
    fc1 = width * (2 if config.activation == "swiglu" else 1)
    copies = local_experts * (fc1 * h + h * width) * c if c < pb.weight else 0
    parts["experts"] = rows * h * c + mlp + copies + (2 * rows * 8 if config.add_bias_linear else 0)
    # The experts' outputs as combined (fp32 for the weighting, and weighted); alltoall's reorder keeps them too.
    parts["combine"] = combined * h * (4 + act) + (
        rows * h * act if config.moe_token_dispatcher_type == "alltoall" else 0
    )

    if shared is not None:
        parts["shared_expert"] = tokens * (shared // layout.tensor_model_parallel_size) * c * (
            4 if config.activation == "swiglu" else 2
        ) + ((local * h * c + local * c) if gate else 0)  # the gated output: the shared output and its gate
    return parts


def moe_dispatch_transient(config: GPTConfig, layout: "EstimateLayout") -> int:
    """Bytes the dispatcher of one MoE layer holds while it moves the tokens, beyond what the layer keeps (see the
    module docstring): the most of its dispatch (the gathered or permuted tokens) and its combine (the weighted
    sum of the rows it combines, a zeroed tensor and the sum, before the reduce-scatter of ``allgather``)."""
    c = PRECISION_BYTES[layout.precision].compute
    h, etp = config.hidden_size, layout.etp_size
    _, local, rows, _ = _sizes(config, layout)
    if config.moe_token_dispatcher_type == "allgather":
        return 2 * layout.expert_model_parallel_size * etp * local * h * c
    permuted = rows // etp * h * c * (1 + (etp if etp > 1 else 0))
    return max(permuted, 2 * local * h * c)
