"""Distributed checkpoints: every shard written as its global tensor through torch.distributed.checkpoint."""
from megatron_lite.core.checkpoint.sharded import (
    ensure_optimizer_state,
    load_sharded,
    save_sharded,
    sharded_model_state,
    sharded_optimizer_state,
)

__all__ = ["sharded_model_state", "sharded_optimizer_state", "ensure_optimizer_state", "save_sharded",
           "load_sharded"]
