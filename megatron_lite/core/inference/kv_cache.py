"""A static key/value cache for generation, and what one prefill or decode step tells the model.

The cache is one allocation for every layer this rank holds, sized for the whole generation
(prompt + new tokens) up front, so a decode step writes its keys and values in place and attends to
a view: nothing grows, nothing is copied. It is GQA-aware and tensor-parallel: it holds only the
key/value heads (query groups) of this rank, ``num_query_groups / tp`` of them, not one per query
head. :meth:`KVCache.free` drops the storage (RL alternates generation and training, and the cache
of a long batch can be as large as the activations of a training step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:
    from megatron_lite.core.models.gpt import GPTModel


class KVCache:
    """Keys and values of every cached position, per layer: ``[b, groups_per_rank, max_len, head_dim]``."""

    def __init__(
        self,
        layer_ids: Sequence[int],
        batch_size: int,
        max_len: int,
        groups: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        # torch.empty: a slot is always written before it is read (prefill writes every prompt slot, padding
        # included; a decode step writes its slot first), so zero-filling would be wasted work.
        self._storage: Optional[torch.Tensor] = torch.empty(
            len(layer_ids), 2, batch_size, groups, max_len, head_dim, dtype=dtype, device=device
        )
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            layer: (self._storage[n, 0], self._storage[n, 1]) for n, layer in enumerate(layer_ids)
        }
        """Global layer index -> (keys, values) buffers."""
        self.max_len = max_len

    @classmethod
    def for_model(cls, model: GPTModel, batch_size: int, max_len: int) -> "KVCache":
        """A cache for the layers ``model`` (this rank's pipeline stages) holds."""
        param = next(model.parameters())
        config = model.config
        # resolved by GPTConfig.__post_init__
        assert config.num_query_groups is not None and config.kv_channels is not None
        groups = config.num_query_groups // model.layout.tp_size  # this rank's key/value heads
        return cls(
            [int(i) for i in model.layers.keys()],
            batch_size,
            max_len,
            groups,
            config.kv_channels,
            param.dtype,
            param.device,
        )

    @property
    def nbytes(self) -> int:
        """Bytes held (0 once freed)."""
        return 0 if self._storage is None else self._storage.numel() * self._storage.element_size()

    def free(self) -> None:
        """Release the buffers (the cache cannot be used afterwards)."""
        self._storage = None
        self.layers = {}


@dataclass
class InferenceStep:
    """What the model needs for one prefill or decode forward (built once per step, not per layer)."""

    start: int
    """Cache slot of the first of this step's tokens (0 for the prefill)."""
    positions: torch.Tensor
    """[b, s] position ids of this step's tokens."""
    mask: Optional[torch.Tensor]
    """bool [b, 1, s, start + s], True where a query may attend a key; None: plain causal attention."""
    cache: Optional[KVCache]
    """Where keys and values are written and read; None recomputes attention over this step's tokens only."""

    def kv(self, layer: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The (keys, values) buffers of global layer ``layer``, or None without a cache."""
        return None if self.cache is None else self.cache.layers[layer]
