"""Distributed checkpoints: every shard written as its global tensor through torch.distributed.checkpoint,
the rest as JSON, every file checksummed, committed atomically (see docs/checkpoint-format.md)."""
from megatron_lite.core.checkpoint.async_save import AsyncCheckpointError, AsyncCheckpointWriter
from megatron_lite.core.checkpoint.integrity import CorruptCheckpointError, verify_checkpoint
from megatron_lite.core.checkpoint.sharded import (
    ensure_optimizer_state,
    load_sharded,
    read_checkpoint_meta,
    resolve_checkpoint,
    save_sharded,
    sharded_model_state,
    sharded_optimizer_state,
)

__all__ = ["sharded_model_state", "sharded_optimizer_state", "ensure_optimizer_state", "save_sharded",
           "load_sharded", "read_checkpoint_meta", "resolve_checkpoint", "verify_checkpoint",
           "CorruptCheckpointError", "AsyncCheckpointWriter", "AsyncCheckpointError"]
