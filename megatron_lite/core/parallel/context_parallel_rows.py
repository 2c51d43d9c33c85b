"""Whole rows of small per-token tensors under context parallelism, and this rank's share of them again.

A CP rank holds two of the ``2·C`` chunks of every row (:func:`~megatron_lite.core.parallel.context_parallel.
zigzag_positions`). Per-token work that looks along the row -- multi-token prediction's depth k needs the token,
label, mask and position at ``t + k``, which may sit in another rank's chunk -- gathers those small tensors (no
gradient flows through token ids and masks), works on the whole rows and cuts its share out again with the split
the data went through (:func:`~megatron_lite.core.parallel.context_parallel.rank_share`). Megatron's ``roll_tensor``
does the same under CP, per tensor and per shift.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.context_parallel import zigzag_positions
from megatron_lite.core.parallel.mappings import all_gather_into_tensor


@torch.no_grad()
def gather_whole_rows(shares: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
    """Each of this rank's ``[b, s/C]`` shares as the whole ``[b, s]`` rows, in row order (the inverse of
    ``rank_share`` over every rank), in one all-gather over the CP ``group`` (float64 carries token ids, positions
    and mask values exactly; each comes back in its dtype)."""
    cp_size = dist.get_world_size(group)
    stacked = torch.stack([share.to(torch.float64) for share in shares])  # [n, b, s/C]
    n, b, local = stacked.shape
    gathered = torch.empty((cp_size * n, b, local), dtype=stacked.dtype, device=stacked.device)
    all_gather_into_tensor(gathered, stacked.contiguous(), group=group)
    gathered = gathered.view(cp_size, n, b, local)
    whole = torch.empty((n, b, local * cp_size), dtype=stacked.dtype, device=stacked.device)
    for rank in range(cp_size):
        whole[:, :, zigzag_positions(local * cp_size, cp_size, rank, whole.device)] = gathered[rank]
    return [row.to(share.dtype) for row, share in zip(whole, shares)]
