"""The MLP block: column-parallel fc1 (gate and up fused for SwiGLU), row-parallel fc2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """``fc2(act(fc1(x)))``; for SwiGLU fc1 holds [gate; up] and each TP rank keeps its slice of both."""

    def __init__(self, config: GPTConfig, layout: ParallelLayout, output_init_std: float):
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        assert config.ffn_hidden_size is not None  # resolved by GPTConfig.__post_init__
        fc1_out = config.ffn_hidden_size * (2 if self.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fc1_out,
            layout,
            bias=config.add_bias_linear,
            init_std=config.init_method_std,
            stride=2 if self.swiglu else 1,
        )
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, layout, bias=config.add_bias_linear, init_std=output_init_std
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return self.linear_fc2(h)
