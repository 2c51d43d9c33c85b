"""What every kind of adapter is made of: its weights' holder, ``A``'s initial scale and dropout on a named stream."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.parallel.random import RNGStatesTracker
from megatron_lite.core.peft.config import LoRAConfig


class AdapterWeight(nn.Module):
    """A bias-free linear map holding only ``weight`` (so an adapter's names are ``linear_in.weight``, NeMo's)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


def a_init_std(config: LoRAConfig, in_features: int) -> float:
    """The std ``A`` [dim, in_features] (whole) is drawn with: Xavier's (Bridge's default) or 0.02."""
    if config.lora_A_init_method == "xavier":
        return math.sqrt(2.0 / (in_features + config.dim))
    return 0.02


def adapter_dropout(
    x: torch.Tensor, p: float, training: bool, rng: Optional[RNGStatesTracker], stream: str
) -> torch.Tensor:
    """Dropout on an adapter's path, drawn from the model's dropout ``stream`` (the global generator without one)."""
    if not training or p == 0.0:
        return x
    if rng is None:
        return F.dropout(x, p, training=True)
    with rng.fork(stream, x.device):
        return F.dropout(x, p, training=True)
