"""LoRA on an MoE layer's experts: one ``A_e``, ``B_e`` per expert, sharded over expert tensor parallelism (ETP) as
the experts' own layers are.

Every ETP rank of an expert computes on the same tokens (the dispatcher gives each of them every row routed to the
expert) and returns a partial output that the dispatcher sums over ETP. The adapters follow that contract with no
collective of their own:

- on ``linear_fc1`` (column-parallel over ETP: each rank holds a slice of [gate; up]) ``A`` ``[E, dim, H]`` is
  replicated and ``B`` ``[E, fc1 / ETP, dim]`` split on its rows exactly as the weight (stride 2 for SwiGLU). ``A x``
  is the same on every ETP rank, but its gradient there holds only this rank's slice of ``B``: ``A``'s gradient is
  partial over ETP, and so is the input gradient, which the dispatcher already sums over ETP for the base.
- on ``linear_fc2`` (row-parallel over ETP) ``A`` ``[E, dim, F / ETP]`` is split on its input as the weight and
  ``B`` ``[E, H, dim]`` replicated: ``B (A_r x_r)`` is this rank's part of ``B A x``, which the dispatcher's sum over
  ETP completes, while ``B``'s gradient (``g (A_r x_r)^T``) is partial over ETP.

The two partial gradients are marked ``tp_partial_grad`` on expert parameters, which the gradient reduction sums
over 'etp' (:func:`~megatron_lite.core.parallel.data_parallel.partial_grad_group`) -- where Megatron-Bridge's
adapters go wrong at ETP > 1. Every adapter parameter is marked ``expert_shard`` like the experts' weights: its
gradient is reduced over expert-data-parallel ranks and checkpoints hold all experts' adapters. Each expert's GEMMs
run over its own tokens (``tokens_per_expert``, by ``grouped_mm`` where the experts use it and it takes the
adapter's shapes, else one GEMM per expert).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_lite.core.models.moe.experts import GroupedLinear, compute_dtype, grouped_linear, grouped_mm_refusal
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.random import DATA_PARALLEL_RNG, RNGStatesTracker
from megatron_lite.core.parallel.tensor_parallel import ExpertShard, TPShard, mark_parameter
from megatron_lite.core.peft.config import LoRAConfig
from megatron_lite.core.peft.parts import AdapterWeight, a_init_std, adapter_dropout

EXPERT_RNG = "expert-lora-rng"
"""The dropout stream of expert adapters where the activation is the same on every ETP rank (fc1's input, fc2's
partial output): seeded alike on an expert's ETP ranks, apart per EP rank."""
EXPERT_SPLIT_RNG = "expert-lora-split-rng"
"""The dropout stream of expert adapters where each ETP rank holds its own slice (fc2's input, fc1's output)."""


def add_expert_rng_streams(tracker: RNGStatesTracker, layout: ParallelLayout) -> None:
    """Give a model's dropout tracker the expert adapters' streams (once). Seeded from its data-parallel stream (the
    model's seed and pipeline stage), as Megatron seeds its expert stream: ``+ 1024 + 100 x EP rank``."""
    if EXPERT_RNG in tracker.seeds:
        return
    seed = tracker.seeds[DATA_PARALLEL_RNG] + 1024 + 100 * layout.ep_rank
    tracker.add(EXPERT_RNG, seed)
    tracker.add(EXPERT_SPLIT_RNG, seed + 7919 * (1 + layout.etp_rank))


class ExpertLoRAAdapter(nn.Module):
    """``scale * B_e A_e x`` for each local expert ``e`` of one of an MoE layer's expert layers (see the module
    docstring for the sharding).

    Args:
        base: the experts' layer adapted (its weight's ``tp_shard`` over 'etp' and ``expert_shard`` are read).
        config: rank, scale, dropout and ``A``'s initialisation.
        layout: this rank's layout (ETP rank and size).
        rng: the model's dropout streams (with ``config.dropout > 0``; see :func:`add_expert_rng_streams`).
    """

    def __init__(
        self,
        base: GroupedLinear,
        config: LoRAConfig,
        layout: ParallelLayout,
        rng: Optional[RNGStatesTracker] = None,
    ) -> None:
        super().__init__()
        shard: Optional[TPShard] = getattr(base.weight, "tp_shard", None)
        experts: Optional[ExpertShard] = getattr(base.weight, "expert_shard", None)
        if shard is None or experts is None or shard.group != "etp" or shard.dim not in (1, 2):
            raise ValueError("LoRA adapts an MoE layer's experts through their weights' ETP and expert shards")
        # the weight is [local experts, out, in]: split on its rows (dim 1, fc1) or its columns (dim 2, fc2)
        self.column = shard.dim == 1
        etp, rank = shard.size, shard.rank
        local, out_features, in_features = shard.global_shape
        dim, partial = config.dim, etp > 1
        a_std = a_init_std(config, in_features)
        dtype, device = base.weight.dtype, base.weight.device

        def param(shape: tuple, init: tuple, split: Optional[TPShard], partial_grad: bool) -> nn.Parameter:
            tensor = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
            return mark_parameter(tensor, init, split, tp_partial_grad=partial_grad, expert_shard=experts)

        if self.column:
            a = param((local, dim, in_features), ("normal", a_std), None, partial)
            b = param(
                (local, out_features // etp, dim),
                ("zeros",),
                TPShard(1, shard.stride, (local, out_features, dim), rank, etp, group="etp"),
                False,
            )
        else:
            a = param(
                (local, dim, in_features // etp),
                ("normal", a_std),
                TPShard(2, 1, (local, dim, in_features), rank, etp, group="etp"),
                False,
            )
            b = param((local, out_features, dim), ("zeros",), None, partial)
        self.linear_in = AdapterWeight(a)
        self.linear_out = AdapterWeight(b)
        self.scale = config.scale
        self.dropout = config.dropout
        self.dropout_position = config.dropout_position
        self.rng = rng
        self.enabled = True
        """False: the layer runs as its base alone (a reference policy, the base's logits)."""
        # Whether torch's grouped GEMM takes the adapter's shapes, per (device type, dtype): probed once each
        self._grouped_gemm_runs: dict[tuple[str, torch.dtype], bool] = {}

    def forward(
        self, tokens: torch.Tensor, tokens_per_expert: list[int], offsets: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The adapters' output for the experts' ``tokens`` [N, in] sorted by expert, shaped and sharded as the
        layer's: this ETP rank's slice (fc1) or partial sum (fc2). ``offsets`` as the layer's (grouped GEMM)."""
        if offsets is not None and not self._grouped_gemm_available(tokens):
            offsets = None
        x = tokens
        if self.dropout_position == "pre":
            x = self._dropout(x, same_on_etp_ranks=self.column)
        h = grouped_linear(x, self.linear_in.weight, tokens_per_expert, offsets)
        out = grouped_linear(h, self.linear_out.weight, tokens_per_expert, offsets) * self.scale
        if self.dropout_position == "post":
            out = self._dropout(out, same_on_etp_ranks=not self.column)
        return out

    def _dropout(self, x: torch.Tensor, same_on_etp_ranks: bool) -> torch.Tensor:
        stream = EXPERT_RNG if same_on_etp_ranks else EXPERT_SPLIT_RNG
        return adapter_dropout(x, self.dropout, self.training, self.rng, stream)

    def _grouped_gemm_available(self, tokens: torch.Tensor) -> bool:
        key = (tokens.device.type, compute_dtype(tokens))
        if key not in self._grouped_gemm_runs:
            shapes = [tuple(self.linear_in.weight.shape[1:]), tuple(self.linear_out.weight.shape[1:])]
            # the loop is exact too: a rank the grouped GEMM refuses (dim not 16-byte aligned) only runs slower
            self._grouped_gemm_runs[key] = grouped_mm_refusal(tokens.device, key[1], shapes) is None
        return self._grouped_gemm_runs[key]

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scale * B_e A_e`` for every local expert: this rank's shard of the experts' weight (shaped as it)."""
        return torch.bmm(self.linear_out.weight.float(), self.linear_in.weight.float()) * self.scale
