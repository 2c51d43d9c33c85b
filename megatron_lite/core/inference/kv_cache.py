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
from torch import nn

if TYPE_CHECKING:
    from megatron_lite.core.models.gpt import GPTModel


class KVCache:
    """Keys and values of every cached position, per layer: ``[b, groups_per_rank, max_len, head_dim]``.

    A multi-latent-attention model caches what its keys and values are expanded from instead: per token the
    normalized latent (``kv_lora_rank``, in the keys' buffer) and the rotated RoPE key (``qk_pos_emb_head_dim``, in
    the values' buffer), one "group" replicated over TP -- ``value_dim`` gives the second buffer its own width."""

    def __init__(
        self,
        layer_ids: Sequence[int],
        batch_size: int,
        max_len: int,
        groups: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        value_dim: Optional[int] = None,
    ):
        # torch.empty: a slot is always written before it is read (prefill writes every prompt slot, padding
        # included; a decode step writes its slot first), so zero-filling would be wasted work.
        n = len(layer_ids)
        if value_dim is None or value_dim == head_dim:
            storage = torch.empty(n, 2, batch_size, groups, max_len, head_dim, dtype=dtype, device=device)
            keys, values = storage[:, 0], storage[:, 1]
            self._storages: list[torch.Tensor] = [storage]
        else:
            keys = torch.empty(n, batch_size, groups, max_len, head_dim, dtype=dtype, device=device)
            values = torch.empty(n, batch_size, groups, max_len, value_dim, dtype=dtype, device=device)
            self._storages = [keys, values]
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            layer: (keys[i], values[i]) for i, layer in enumerate(layer_ids)
        }
        """Global layer index -> (keys, values) buffers."""
        self.max_len = max_len

    @classmethod
    def for_model(cls, model: GPTModel, batch_size: int, max_len: int) -> "KVCache":
        """A cache for the layers ``model`` (this rank's pipeline stages) holds."""
        return cls.for_layers(model, [int(i) for i in model.layers.keys()], batch_size, max_len)

    @classmethod
    def for_layers(
        cls, model: GPTModel, layers: Sequence[int], batch_size: int, max_len: int, like: Optional[nn.Module] = None
    ) -> "KVCache":
        """A cache for ``layers`` (ids) of ``model``'s attention kind: a draft's layer of the model's shape too (in
        the dtype and on the device of ``like``'s parameters, default the model's)."""
        param = next((like or model).parameters())
        config = model.config
        if config.multi_latent_attention:
            assert config.kv_lora_rank is not None and config.qk_pos_emb_head_dim is not None  # resolved with MLA
            return cls(
                layers, batch_size, max_len, 1, config.kv_lora_rank, param.dtype, param.device,
                value_dim=config.qk_pos_emb_head_dim,
            )  # fmt: skip
        # resolved by GPTConfig.__post_init__
        assert config.num_query_groups is not None and config.kv_channels is not None
        groups = config.num_query_groups // model.layout.tp_size  # this rank's key/value heads
        return cls(layers, batch_size, max_len, groups, config.kv_channels, param.dtype, param.device)

    @property
    def nbytes(self) -> int:
        """Bytes held (0 once freed)."""
        return sum(storage.numel() * storage.element_size() for storage in self._storages)

    def free(self) -> None:
        """Release the buffers (the cache cannot be used afterwards)."""
        self._storages = []
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
