"""GPTConfig's multi-token prediction fields checked (a sibling of config.py, like moe_config.py: the config reads it
and the MTP block, ``mtp.py``, reads the config)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.core.models.config import GPTConfig


def mtp_depth(config: "GPTConfig") -> int:
    """The number of MTP depths D (0: multi-token prediction is off)."""
    return config.mtp_num_layers or 0


def check_mtp_fields(config: "GPTConfig") -> None:
    """Raise a ValueError naming the fix for MTP fields that cannot work together with the rest of the model."""
    depth, factor = config.mtp_num_layers, config.mtp_loss_scaling_factor
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 0):
        raise ValueError(f"mtp_num_layers must be None or a non-negative integer (0: off), got {depth!r}")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 0:
        raise ValueError(
            f"mtp_loss_scaling_factor must be a non-negative number (Megatron's default 0.1), got {factor!r}"
        )
    if not depth:
        return
    if config.position_embedding_type != "rope":
        raise ValueError(
            "mtp_num_layers with position_embedding_type='learned_absolute': the MTP block embeds the shifted tokens "
            "alone, as DeepSeek-V3 does; use position_embedding_type='rope' or mtp_num_layers=None."
        )
