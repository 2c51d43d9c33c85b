"""The bytes of a generation's key/value cache per rank, from the config (what ``KVCache.for_model`` allocates).

A GQA model caches, per layer and token, the keys and values of its ``num_query_groups`` key/value heads, split over
TP: ``2 · groups/tp · kv_channels`` values. A multi-latent-attention model caches what its keys and values are
expanded from instead, replicated over TP: the normalized latent and the rotated RoPE key,
``kv_lora_rank + qk_pos_emb_head_dim`` values (576 for DeepSeek-V3 against 2 · 128 · 128 = 32,768 for its 128 heads
cached as full keys and values).
"""

from __future__ import annotations

from typing import Optional

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.parallel.layout import ParallelConfig


def kv_cache_values_per_token_and_layer(config: GPTConfig, tensor_model_parallel_size: int = 1) -> int:
    """Cached values one rank keeps per token and layer."""
    if config.multi_latent_attention:
        assert config.kv_lora_rank is not None and config.qk_pos_emb_head_dim is not None  # resolved with MLA
        return config.kv_lora_rank + config.qk_pos_emb_head_dim
    assert config.num_query_groups is not None and config.kv_channels is not None  # resolved by __post_init__
    return 2 * (config.num_query_groups // tensor_model_parallel_size) * config.kv_channels


def kv_cache_bytes(
    config: GPTConfig,
    batch_size: int,
    max_len: int,
    bytes_per_value: int = 2,
    parallel: Optional[ParallelConfig] = None,
    pipeline_stage: int = 0,
) -> int:
    """Bytes of the cache one rank of pipeline rank ``pipeline_stage`` allocates for ``batch_size`` sequences of up to
    ``max_len`` tokens (prompt + new), its layers as ``parallel`` cuts them, ``bytes_per_value`` the parameters'
    dtype size (the cache takes their dtype); ``parallel`` None: one rank holds every layer."""
    parallel = parallel if parallel is not None else ParallelConfig()
    layers = sum(len(chunk.layers) for chunk in parallel.stage_chunks(config.num_layers, pipeline_stage))
    per_token = kv_cache_values_per_token_and_layer(config, parallel.tensor_model_parallel_size)
    return layers * batch_size * max_len * per_token * bytes_per_value
