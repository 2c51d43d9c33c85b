"""The MoE layer: router -> token dispatcher -> grouped experts -> combine, plus an optional shared expert
(Megatron's MoELayer). It replaces the MLP of the layers ``moe_layer_freq`` selects."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.mlp import MLP
from megatron_lite.core.models.moe.aux_loss import AuxLossScope
from megatron_lite.core.models.moe.experts import GroupedExperts
from megatron_lite.core.models.moe.router import TopKRouter
from megatron_lite.core.models.moe.step_state import MoEStepState, in_recomputation
from megatron_lite.core.models.moe.token_dispatcher import AllToAllDispatcher, TokenDispatcher, build_dispatcher
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_lite.core.parallel.tensor_parallel import mark_parameter


class SharedExpertMLP(MLP):
    """The expert every token goes through (Qwen2-MoE, DeepSeek), tensor-parallel like the dense MLP; with
    ``moe_shared_expert_gate`` its output is scaled per token by ``sigmoid(x . gate_weight)``."""

    def __init__(self, config: GPTConfig, layout: ParallelLayout, output_init_std: float):
        assert config.moe_shared_expert_intermediate_size is not None  # the MoE layer builds it only then
        width = config.moe_shared_expert_intermediate_size
        super().__init__(dataclasses.replace(config, ffn_hidden_size=width), layout, output_init_std)
        self.gate_weight: Optional[nn.Parameter] = None
        if config.moe_shared_expert_gate:
            self.gate_weight = mark_parameter(
                nn.Parameter(torch.empty(1, config.hidden_size)),
                ("normal", config.init_method_std),
                None,
                sequence_parallel_grad=layout.sequence_parallel,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(torch.nn.functional.linear(x, self.gate_weight))


class MoELayer(nn.Module):
    """``[s(/tp), b, h] -> [s(/tp), b, h]``: each token through its top-k experts, weighted by the router.

    Forwards without autograd (generation, a frozen reference model, validation) exchange tokens through the
    all-to-all dispatcher whatever ``moe_token_dispatcher_type`` says: the ranks of the ETP x EP group may then
    hold different numbers of tokens (the experts are folded over data-parallel replicas, and replicas that
    generate their own prompts have their own batch sizes), which the all-gather dispatcher's equal-sized
    gathers cannot take and the all-to-all's split sizes can. A rank with no tokens of its own still serves
    its experts to the others: :meth:`idle_exchange`."""

    def __init__(
        self,
        config: GPTConfig,
        layout: ParallelLayout,
        layer_number: int,
        output_init_std: float,
        step_state: MoEStepState,
    ):
        super().__init__()
        assert config.num_moe_experts is not None  # built for MoE layers only
        self.layer_number, self.step_state = layer_number, step_state
        self.router = TopKRouter(config, layout, layer_number)
        self.experts = GroupedExperts(config, layout, output_init_std)
        self.shared_experts: Optional[SharedExpertMLP] = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, layout, output_init_std)
        self.dispatcher = build_dispatcher(config.moe_token_dispatcher_type, config.num_moe_experts, layout)
        self.variable_size_dispatcher: TokenDispatcher = (
            self.dispatcher
            if isinstance(self.dispatcher, AllToAllDispatcher)
            else AllToAllDispatcher(config.num_moe_experts, layout)
        )
        """The exchange of forwards without autograd (any number of tokens per rank; see the class docstring)."""
        self.hidden_size = config.hidden_size
        self.topk = config.moe_router_topk
        self.tp_group = layout.group("tp")
        self.tp_size = layout.tp_size
        self.sequence_parallel = layout.sequence_parallel
        self.tp_cp_group, self.tp_dp_cp_group = layout.group("tp_cp"), layout.group("tp_dp_cp")
        self.cp_size = layout.cp_size
        self.recompute = config.recomputes("moe")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            # selective recompute of 'moe': keep only the layer's input; router, dispatch and experts (their
            # collectives too) run again in the backward pass, where the router attaches and records nothing
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        # Without sequence parallelism (generation) the TP ranks hold the same tokens: each takes its share, so the
        # experts see every token once, and the outputs are gathered again (padding a length TP does not divide).
        split = self.tp_size > 1 and not self.sequence_parallel
        tokens = x
        if split:
            pad = -x.shape[0] % self.tp_size
            if pad:
                tokens = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
            tokens = scatter_to_sequence_parallel_region(tokens, self.tp_group)
        seq, batch, hidden = tokens.shape
        flat = tokens.reshape(-1, hidden)
        recording = self.training and torch.is_grad_enabled() and not in_recomputation()
        scope = AuxLossScope(
            tp_cp_group=self.tp_cp_group,
            tp_dp_cp_group=self.tp_dp_cp_group,
            backward_scale=self.step_state.backward_scale,
            record=self._record if recording else None,
            recomputing=self.training and in_recomputation(),
        )
        probs, routing_map = self.router(flat, scope, seq, batch)
        dispatcher = self.dispatcher if torch.is_grad_enabled() else self.variable_size_dispatcher
        rows, tokens_per_expert = dispatcher.dispatch(flat, probs, routing_map)
        out = dispatcher.combine(self.experts(rows, tokens_per_expert)).reshape(tokens.shape)
        if split:
            out = gather_from_sequence_parallel_region(out, self.tp_group, grad_is_partial=False)[: x.shape[0]]
        if recording:
            self._record_load(routing_map)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    @torch.no_grad()
    def idle_exchange(self) -> None:
        """Take part in one forward's expert exchange holding no tokens: this rank's experts still compute the rows
        the other ranks of the ETP x EP group send them, and send the results back. For a rank whose own forwards
        are over (its generation finished) while other data-parallel replicas, whose tokens its experts serve, go
        on; each of their forwards is matched by one call here per MoE layer, in the layers' order."""
        weight = self.router.weight
        dtype = next(self.experts.parameters()).dtype
        tokens = torch.empty(0, self.hidden_size, dtype=dtype, device=weight.device)
        probs = torch.empty(0, self.router.num_experts, dtype=weight.dtype, device=weight.device)
        routing_map = torch.zeros(0, self.router.num_experts, dtype=torch.bool, device=weight.device)
        dispatcher = self.variable_size_dispatcher
        rows, tokens_per_expert = dispatcher.dispatch(tokens, probs, routing_map)
        dispatcher.combine(self.experts(rows, tokens_per_expert))

    # How a metric is reported: the engine sums report entries over DP x CP (and the pipeline), not over TP. So
    # each is recorded as one micro-batch sequence's value (the TP x CP group's), weighted 1/CP: summed over the
    # CP ranks it counts once per micro-batch, whatever the layout.
    @torch.no_grad()
    def _record(self, name: str, value: torch.Tensor) -> None:
        """The router's metrics: a load-balancing loss is split into shares over the TP x CP ranks (their sum is the
        loss), the z-loss is each rank's mean over its tokens (their mean is the loss)."""
        value = value.detach().to(torch.float32).reshape(1)
        if self.tp_size > 1 and self.sequence_parallel:
            dist.all_reduce(value, group=self.tp_group)
        if name == "z_loss":
            value = value / (self.tp_size if self.sequence_parallel else 1) / self.cp_size
        self.step_state.record(name, value[0], count=1.0 / self.cp_size)

    @torch.no_grad()
    def _record_load(self, routing_map: torch.Tensor) -> None:
        """Per layer, over the tokens of one micro-batch (this rank's TP x CP group): the busiest expert's load over
        the mean load and the loads' coefficient of variation; and the fraction of routed (token, expert) pairs
        dropped by the capacity."""
        load = routing_map.sum(0).to(torch.float32)
        counts = torch.cat([load, load.new_full((1,), float(routing_map.shape[0]))])
        if self.tp_cp_group is not None and dist.get_world_size(self.tp_cp_group) > 1:
            dist.all_reduce(counts, group=self.tp_cp_group)
        load, tokens = counts[:-1], counts[-1]
        mean = load.mean().clamp(min=1e-9)
        prefix, weight = f"moe/layer_{self.layer_number}", 1.0 / self.cp_size
        self.step_state.record(f"{prefix}/load_max_over_mean", load.max() / mean / self.cp_size, weight)
        self.step_state.record(f"{prefix}/load_cv", load.std(unbiased=False) / mean / self.cp_size, weight)
        wanted = tokens * self.topk
        dropped = (wanted - load.sum()) / self.cp_size
        self.step_state.record("moe/dropped_token_fraction", dropped, wanted / self.cp_size)
