"""RMSNorm and LayerNorm whose weights know they are replicated across TP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.parallel.tensor_parallel import mark_parameter


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dimension.

    Under sequence parallelism each TP rank sees a different slice of the sequence, so the weight
    gradients are partial and must be all-reduced over TP (``sequence_parallel_grad``). A norm shared
    by the attention heads (``shared_by_tp_heads``: qk_layernorm's) sees only this rank's heads, so its
    gradients are partial over TP with or without sequence parallelism (``tp_partial_grad``).
    """

    def __init__(
        self, kind: str, hidden_size: int, eps: float, sequence_parallel: bool, shared_by_tp_heads: bool = False
    ):
        super().__init__()
        self.kind, self.eps, self.hidden_size = kind, eps, hidden_size
        self.weight = mark_parameter(
            nn.Parameter(torch.ones(hidden_size)),
            ("ones",),
            sequence_parallel_grad=sequence_parallel,
            tp_partial_grad=shared_by_tp_heads,
        )
        if kind == "LayerNorm":
            self.bias = mark_parameter(
                nn.Parameter(torch.zeros(hidden_size)),
                ("zeros",),
                sequence_parallel_grad=sequence_parallel,
                tp_partial_grad=shared_by_tp_heads,
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "RMSNorm":
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
