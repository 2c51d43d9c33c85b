"""The experts of an MoE layer: each of this rank's experts runs its MLP over the tokens routed to it.

This rank holds ``num_moe_experts / EP`` experts (:class:`ExpertShard`), each split over the expert tensor-parallel
group like the dense MLP over TP: fc1 column-parallel (for SwiGLU it holds [gate; up], each ETP rank its slice of
both), fc2 row-parallel. The output is this ETP rank's partial sum; the dispatcher sums it over ETP while it
combines the tokens, so the experts issue no collective.

With ``moe_grouped_gemm`` each layer of all local experts is one ``torch.nn.functional.grouped_mm`` call (on CUDA
with bf16 on SM90+ one CUTLASS kernel; elsewhere torch loops over the experts in C++), else one ``F.linear`` per
expert. torch's grouped GEMM needs 16-byte aligned row strides (every width a multiple of 8 bf16 or 4 fp32
elements) and float32/bfloat16/float16 operands; where it refuses the operands it is probed with once, the experts
fall back to the loop and say so in a warning.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.models.moe_config import check_moe_parallelism
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import ExpertShard, TPShard, mark_parameter

if TYPE_CHECKING:  # config.py checks its MoE fields with this package: no import back at run time
    from megatron_lite.core.models.config import GPTConfig


class GroupedLinear(nn.Module):
    """One linear layer of every local expert: ``weight`` [experts, out, in], ``bias`` [experts, out] or None.

    ``add_bias=False`` keeps the bias as a parameter without adding it (fc2's bias on ETP ranks other than 0).
    ``adapter``: a module whose output is added to the layer's (LoRA on the experts, ``megatron_lite.core.peft``),
    called with the layer's tokens, ``tokens_per_expert`` and ``offsets``; None when the layer has none."""

    adapter: Optional[nn.Module]

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], add_bias: bool = True):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.add_bias = add_bias
        self.register_module("adapter", None)

    def forward(
        self, tokens: torch.Tensor, tokens_per_expert: list[int], offsets: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``tokens`` [N, in] sorted by expert -> [N, out]; ``offsets`` (int32 cumulative token counts on the tokens'
        device) selects the grouped GEMM, None the loop."""
        out = self.linear(tokens, self.weight, tokens_per_expert, offsets)
        adapter = self.adapter
        if adapter is not None and getattr(adapter, "enabled", True):
            out = out + adapter(tokens, tokens_per_expert, offsets)
        if self.bias is None or not self.add_bias:
            return out
        counts = torch.tensor(tokens_per_expert, device=tokens.device)
        return out + self.bias.repeat_interleave(counts, dim=0, output_size=tokens.shape[0])

    def linear(
        self,
        tokens: torch.Tensor,
        weight: torch.Tensor,
        tokens_per_expert: list[int],
        offsets: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The rank-local GEMM of every expert (no bias): where quantization wraps the layer, as
        ``_LocalGemm.linear`` of the dense layers."""
        return grouped_linear(tokens, weight, tokens_per_expert, offsets)


def grouped_linear(
    tokens: torch.Tensor, weight: torch.Tensor, tokens_per_expert: list[int], offsets: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``tokens`` [N, in] sorted by expert times each expert's ``weight`` [experts, out, in] -> [N, out]: one
    ``grouped_mm`` when ``offsets`` (int32 cumulative token counts on the tokens' device) is given, else one
    ``F.linear`` per expert over its ``tokens_per_expert`` rows."""
    if offsets is None:
        pieces = tokens.split(tokens_per_expert)
        return torch.cat([F.linear(piece, w) for w, piece in zip(weight.unbind(0), pieces)])
    # grouped_mm has no autocast rule: cast as F.linear would under autocast, or it mixes dtypes and fails
    dtype = compute_dtype(tokens)
    out = F.grouped_mm(
        _aligned(tokens.to(dtype)), weight.to(dtype).transpose(-2, -1), offs=offsets
    )  # weight [E, out, in] seen as [E, in, out]: 16-byte aligned when ``in`` is
    if out.requires_grad:  # its backward takes the gradient only as it takes operands (an expanded one is not)
        out.register_hook(_aligned)
    return out


class GroupedExperts(nn.Module):
    """This rank's experts of an MoE layer (SwiGLU or GeLU MLPs of width ``moe_ffn_hidden_size``), split over ETP.

    Parameters (their names are the checkpoints' and the Hugging Face mapping's), local [experts of this rank, ...]
    of the global [num_moe_experts, ...]:

    - ``linear_fc1.weight`` [E_local, fc1 / ETP, H] (fc1 = 2F for SwiGLU: [gate; up], each ETP rank its slice of
      both), ``linear_fc1.bias`` [E_local, fc1 / ETP] with ``add_bias_linear``;
    - ``linear_fc2.weight`` [E_local, H, F / ETP], ``linear_fc2.bias`` [E_local, H] with ``add_bias_linear``: whole on
      every ETP rank and added by ETP rank 0 only, so the caller's sum over ETP adds it once. Its gradient is
      therefore whole on ETP rank 0 and zero on the others: summing it over ETP keeps the copies equal.
    """

    def __init__(self, config: GPTConfig, layout: ParallelLayout, output_init_std: float):
        super().__init__()
        assert config.num_moe_experts is not None and config.moe_ffn_hidden_size is not None  # an MoE config
        check_moe_parallelism(config, layout.config, sequence_parallel=True)  # sizes only: SP is the model's concern
        self.swiglu = config.activation == "swiglu"
        self.grouped_gemm = config.moe_grouped_gemm
        hidden, ffn, etp = config.hidden_size, config.moe_ffn_hidden_size, layout.etp_size
        fc1 = ffn * (2 if self.swiglu else 1)
        experts = ExpertShard(config.num_moe_experts, layout.ep_rank, layout.ep_size)
        local = experts.num_local_experts
        self.num_local_experts = local
        stride = 2 if self.swiglu else 1

        def expert_param(shape: tuple, init: tuple, shard: Optional[TPShard], partial: bool = False) -> nn.Parameter:
            return mark_parameter(
                nn.Parameter(torch.empty(shape)), init, shard, tp_partial_grad=partial, expert_shard=experts
            )

        def etp_shard(dim: int, split_stride: int, global_shape: tuple) -> TPShard:
            return TPShard(dim, split_stride, global_shape, layout.etp_rank, etp, group="etp")

        bias = config.add_bias_linear
        self.linear_fc1 = GroupedLinear(
            expert_param(
                (local, fc1 // etp, hidden),
                ("normal", config.init_method_std),
                etp_shard(1, stride, (local, fc1, hidden)),
            ),
            expert_param((local, fc1 // etp), ("zeros",), etp_shard(1, stride, (local, fc1))) if bias else None,
        )
        self.linear_fc2 = GroupedLinear(
            expert_param(
                (local, hidden, ffn // etp), ("normal", output_init_std), etp_shard(2, 1, (local, hidden, ffn))
            ),
            # whole on every ETP rank but added on rank 0 only (the caller sums the partial outputs): its gradient
            # is rank 0's, summed over the ETP group by the reduction (``partial_grad_group``)
            expert_param((local, hidden), ("zeros",), None, partial=etp > 1) if bias else None,
            add_bias=layout.etp_rank == 0,
        )
        # Whether torch's grouped GEMM runs here, per (device type, compute dtype): probed once each
        self._grouped_gemm_runs: dict[tuple[str, torch.dtype], bool] = {}

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """``tokens`` [N, H] sorted by local expert (``tokens_per_expert[i]`` rows for local expert i, summing to N)
        -> [N, H]: this ETP rank's partial output, which the caller sums over the ETP group. No collective."""
        if len(tokens_per_expert) != self.num_local_experts or sum(tokens_per_expert) != tokens.shape[0]:
            raise ValueError(
                f"tokens_per_expert must give one count per local expert ({self.num_local_experts}) summing to the "
                f"{tokens.shape[0]} tokens, got {list(tokens_per_expert)}"
            )
        offsets = None
        if self.grouped_gemm and self._grouped_gemm_available(tokens):
            offsets = torch.tensor(tokens_per_expert, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            offsets = offsets.to(tokens.device)
        hidden = self.linear_fc1(tokens, tokens_per_expert, offsets)
        if self.swiglu:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden)
        return self.linear_fc2(hidden, tokens_per_expert, offsets)

    def _grouped_gemm_available(self, tokens: torch.Tensor) -> bool:
        key = (tokens.device.type, compute_dtype(tokens))
        if key not in self._grouped_gemm_runs:
            shapes = [tuple(self.linear_fc1.weight.shape[1:]), tuple(self.linear_fc2.weight.shape[1:])]
            refusal = grouped_mm_refusal(tokens.device, key[1], shapes)
            if refusal is not None:
                # The same text for every layer of a model: Python shows it once.
                warnings.warn(
                    f"megatron-lite: moe_grouped_gemm=True, but torch's grouped GEMM does not run the experts' "
                    f"{key[1]} GEMMs of shapes {shapes} on {key[0]} ({refusal}); the experts run one GEMM each instead",
                    stacklevel=2,
                )
            self._grouped_gemm_runs[key] = refusal is None
        return self._grouped_gemm_runs[key]


def grouped_mm_refusal(device: torch.device, dtype: torch.dtype, weight_shapes: list[tuple]) -> Optional[str]:
    """Why ``torch.nn.functional.grouped_mm`` cannot run the GEMMs of experts whose weights are shaped
    ``[out, in]`` (each of ``weight_shapes``) in ``dtype`` on ``device``, or None when it can: each is run once,
    forward and backward, on two tokens of one expert."""
    try:
        # Identity saved-tensor hooks: the probe's own backward must not unpack through an enclosing activation
        # checkpoint's hooks (the probe may first run inside a recomputed layer).
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            for out_features, in_features in weight_shapes:
                tokens = torch.zeros(2, in_features, device=device, dtype=dtype, requires_grad=True)
                weight = torch.zeros(1, out_features, in_features, device=device, dtype=dtype, requires_grad=True)
                offsets = torch.tensor([2], dtype=torch.int32, device=device)
                out = F.grouped_mm(tokens, weight.transpose(-2, -1), offs=offsets)
                out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError) as error:
        return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return None


def compute_dtype(tokens: torch.Tensor) -> torch.dtype:
    """The dtype the experts' GEMMs of ``tokens`` run in: autocast's where it is on, else the tokens'."""
    device = tokens.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tokens.dtype


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as torch's grouped GEMM takes it: dense rows starting on a 16-byte boundary (a copy if not)."""
    if tensor.is_contiguous() and tensor.data_ptr() % 16 == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
