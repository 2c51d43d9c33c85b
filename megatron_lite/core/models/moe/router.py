"""The MoE router: a linear gate, Megatron's top-k routing, token dropping and the auxiliary losses."""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.models.moe.aux_loss import (
    LOAD_BALANCING_TYPES,
    METRIC_NAMES,
    AuxLossScope,
    attach_aux_loss,
    aux_loss_multiplier,
    group_size,
    reduced_tokens_per_expert,
    switch_load_balancing_loss_func,
    z_loss_func,
)
from megatron_lite.core.models.moe.routing import (
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    sinkhorn_routing,
    topk_routing_with_score_function,
)
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import mark_parameter

_ROUTER_DTYPES = {None: torch.float32, "fp32": torch.float32, "fp64": torch.float64}


class RouterConfig(Protocol):
    """The fields of the model config the router reads (Megatron's names; ``GPTConfig`` documents them)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def init_method_std(self) -> float: ...
    @property
    def num_moe_experts(self) -> Optional[int]: ...
    @property
    def moe_router_topk(self) -> int: ...
    @property
    def moe_router_score_function(self) -> str: ...
    @property
    def moe_router_pre_softmax(self) -> bool: ...
    @property
    def moe_router_topk_scaling_factor(self) -> Optional[float]: ...
    @property
    def moe_router_num_groups(self) -> Optional[int]: ...
    @property
    def moe_router_group_topk(self) -> Optional[int]: ...
    @property
    def moe_router_dtype(self) -> Optional[str]: ...
    @property
    def moe_input_jitter_eps(self) -> Optional[float]: ...
    @property
    def moe_router_load_balancing_type(self) -> str: ...
    @property
    def moe_aux_loss_coeff(self) -> float: ...
    @property
    def moe_z_loss_coeff(self) -> Optional[float]: ...
    @property
    def moe_router_enable_expert_bias(self) -> bool: ...
    @property
    def moe_router_bias_update_rate(self) -> float: ...
    @property
    def moe_expert_capacity_factor(self) -> Optional[float]: ...
    @property
    def moe_token_drop_policy(self) -> str: ...
    @property
    def moe_pad_expert_input_to_capacity(self) -> bool: ...


class TopKRouter(nn.Module):
    """Route each token to ``moe_router_topk`` experts (Megatron's ``TopKRouter``).

    ``forward``: input jitter (training) -> fp32/fp64 logits -> z-loss -> top-k or Sinkhorn routing ->
    token dropping (``moe_expert_capacity_factor``) -> the load-balancing loss attached to the probs.
    ``moe_router_load_balancing_type`` is a single string (Megatron's list of several types is not supported).

    State: ``weight`` ``[E, H]`` (replicated over TP; its gradient is partial per TP rank under sequence
    parallelism); with ``moe_router_enable_expert_bias`` the checkpointed ``expert_bias`` ``[E]`` and the
    step's ``local_tokens_per_expert`` (see :func:`~megatron_lite.core.models.moe.aux_loss.update_expert_bias`);
    with global_aux_loss the token counts of the step's microbatches so far (:meth:`reset_global_aux_counts`).
    These buffers stay fp32 whatever dtype the module is cast to.
    """

    expert_bias: Optional[torch.Tensor]
    local_tokens_per_expert: Optional[torch.Tensor]
    global_tokens_per_expert: Optional[torch.Tensor]
    ga_steps: Optional[torch.Tensor]

    def __init__(self, config: RouterConfig, layout: ParallelLayout, layer_number: int):
        super().__init__()
        if config.num_moe_experts is None:
            raise ValueError("TopKRouter needs num_moe_experts")
        kind = config.moe_router_load_balancing_type
        if not isinstance(kind, str) or kind not in LOAD_BALANCING_TYPES:
            raise ValueError(f"moe_router_load_balancing_type={kind!r} must be one of {LOAD_BALANCING_TYPES}")
        if config.moe_router_dtype not in _ROUTER_DTYPES:
            raise ValueError(f"moe_router_dtype={config.moe_router_dtype!r} must be 'fp32', 'fp64' or None (fp32)")
        if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
            raise ValueError("moe_router_enable_expert_bias needs moe_router_score_function='sigmoid'")
        self.config = config
        self.layer_number = layer_number
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        mark_parameter(
            self.weight, ("normal", config.init_method_std), None, sequence_parallel_grad=layout.sequence_parallel
        )
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts))
            self.register_buffer("local_tokens_per_expert", torch.zeros(self.num_experts), persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        if kind == "global_aux_loss" and config.moe_aux_loss_coeff > 0:
            self.register_buffer("global_tokens_per_expert", torch.zeros(self.num_experts), persistent=False)
            self.register_buffer("ga_steps", torch.zeros(()), persistent=False)
        else:
            self.global_tokens_per_expert = self.ga_steps = None

    def reset_global_aux_counts(self) -> None:
        """Start global_aux_loss's running token counts afresh (call at each optimizer step)."""
        if self.global_tokens_per_expert is not None and self.ga_steps is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, E]`` in ``moe_router_dtype`` (fp32 by default), whatever autocast is active."""
        dtype = _ROUTER_DTYPES[self.config.moe_router_dtype]
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.to(dtype), self.weight.to(dtype))

    def forward(
        self, x: torch.Tensor, scope: AuxLossScope, seq_length: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, H]`` (this rank's tokens, ``T = seq_length * batch_size``, seq-major like Megatron's
        ``[s, b, h]`` flattened) -> (probs ``[T, E]`` in the router dtype (fp32 unless fp64), zero where not
        routed; routing_map ``[T, E]`` bool).

        Input jitter (training only; Megatron's also jitters in evaluation) draws from the default generator of
        ``x``'s device: run the router where that stream is the same on every TP rank (the data-parallel
        stream), so that replicated tokens route alike.
        """
        if x.dim() != 2 or x.shape[0] != seq_length * batch_size:
            raise ValueError(
                f"router input must be [seq_length * batch_size, hidden] = [{seq_length * batch_size}, H], "
                f"got {tuple(x.shape)}"
            )
        config = self.config
        # The losses exist where a backward follows; outside a recompute pass they are also attached,
        # recorded and counted (a recompute pass reproduces only the tensors the original backward reads).
        with_losses = self.training and torch.is_grad_enabled()
        first_pass = with_losses and not scope.recomputing
        if self.training and config.moe_input_jitter_eps:
            eps = config.moe_input_jitter_eps
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        logits = self.gating(x)
        if with_losses and config.moe_z_loss_coeff:
            logits = self._apply_z_loss(logits, config.moe_z_loss_coeff, scope, first_pass)

        kind = config.moe_router_load_balancing_type
        if kind == "sinkhorn":
            probs, routing_map = sinkhorn_routing(logits, self.topk, self.training)
        else:
            probs, routing_map = topk_routing_with_score_function(
                logits,
                self.topk,
                score_function=config.moe_router_score_function,
                pre_softmax=config.moe_router_pre_softmax,
                num_groups=config.moe_router_num_groups,
                group_topk=config.moe_router_group_topk,
                scaling_factor=config.moe_router_topk_scaling_factor,
                expert_bias=self.expert_bias,
            )
        if config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs,
                routing_map,
                self.topk,
                config.moe_expert_capacity_factor,
                config.moe_token_drop_policy,
                config.moe_pad_expert_input_to_capacity,
            )
        if with_losses and kind in METRIC_NAMES and config.moe_aux_loss_coeff > 0:
            probs = self._apply_load_balancing_loss(probs, logits, scope, first_pass, seq_length, batch_size)
        if first_pass and self.local_tokens_per_expert is not None:
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def _apply_z_loss(self, logits: torch.Tensor, coeff: float, scope: AuxLossScope, attach: bool) -> torch.Tensor:
        # Each TP/CP rank computes the z-loss of its own tokens: the coefficient is split among them.
        coeff = coeff / group_size(scope.tp_cp_group)
        z_loss = z_loss_func(logits, coeff)
        if not attach:
            return logits
        _record(scope, "z_loss", z_loss / coeff)
        return attach_aux_loss(logits, z_loss, aux_loss_multiplier(scope, logits.shape[0]))

    def _apply_load_balancing_loss(
        self,
        probs: torch.Tensor,
        logits: torch.Tensor,
        scope: AuxLossScope,
        attach: bool,
        seq_length: int,
        batch_size: int,
    ) -> torch.Tensor:
        kind, coeff = self.config.moe_router_load_balancing_type, self.config.moe_aux_loss_coeff
        routing_map, scores = compute_routing_scores_for_aux_loss(
            logits, self.topk, self.config.moe_router_score_function
        )
        if not attach:
            return probs
        num_tokens = logits.shape[0]
        tp_cp = group_size(scope.tp_cp_group)
        if kind == "aux_loss":
            counts = reduced_tokens_per_expert(routing_map, scope.tp_cp_group)
            loss = switch_load_balancing_loss_func(
                scores, counts, num_tokens * tp_cp, self.topk, self.num_experts, coeff
            )
        elif kind == "seq_aux_loss":
            # The batch folded into the expert dimension: the loss of each sequence on its own, averaged.
            scores, routing_map = scores.reshape(seq_length, -1), routing_map.reshape(seq_length, -1)
            counts = reduced_tokens_per_expert(routing_map, scope.tp_cp_group)
            loss = switch_load_balancing_loss_func(
                scores, counts, seq_length * tp_cp, self.topk, self.num_experts, coeff
            )
            loss = loss / batch_size
        else:  # global_aux_loss: counts over TP x DP x CP, averaged over the step's microbatches so far
            assert self.global_tokens_per_expert is not None and self.ga_steps is not None
            counts = reduced_tokens_per_expert(routing_map, scope.tp_dp_cp_group)
            self.global_tokens_per_expert += counts
            self.ga_steps += 1
            total = num_tokens * group_size(scope.tp_dp_cp_group)
            average = self.global_tokens_per_expert / self.ga_steps
            loss = switch_load_balancing_loss_func(scores, average, total, self.topk, self.num_experts, coeff)
        _record(scope, METRIC_NAMES[kind], loss / coeff)
        return attach_aux_loss(probs, loss, aux_loss_multiplier(scope, num_tokens))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "TopKRouter":
        # module.to(bf16) (a "-true" precision) must not round the bias or the counts: a 1e-3 bias step
        # is lost on bf16 biases of order 1 (Megatron restores them to fp32 for the same reason).
        super()._apply(fn, recurse)
        for name, buffer in list(self.named_buffers(recurse=False)):
            if buffer.is_floating_point() and buffer.dtype != torch.float32:
                setattr(self, name, buffer.float())
        return self


def _record(scope: AuxLossScope, name: str, value: torch.Tensor) -> None:
    if scope.record is not None:
        scope.record(name, value.detach())
