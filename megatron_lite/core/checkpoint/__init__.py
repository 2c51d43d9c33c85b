"""Distributed checkpoints: every shard written as its global tensor through torch.distributed.checkpoint,
the rest as JSON, every file checksummed, committed atomically (see docs/checkpoint-format.md).

:class:`Checkpointer` saves and loads a run's state (model, optimizers, RNG states) as one; the subpackages hold
the pieces: ``format`` (the on-disk format and its safety), ``resume`` (auto-resume, RNG states, strict-load
entries), ``full`` (whole models in one process: the notebook hand-back, ``from_pretrained``), ``hf`` (Hugging Face
interop); ``errors`` names every error they raise."""

from megatron_lite.core.checkpoint.checkpointer import Checkpointer, Loaded
from megatron_lite.core.checkpoint.errors import AsyncCheckpointError, CorruptCheckpointError
from megatron_lite.core.checkpoint.format.async_save import AsyncCheckpointWriter
from megatron_lite.core.checkpoint.format.integrity import verify_checkpoint
from megatron_lite.core.checkpoint.format.sharded import (
    load_sharded,
    read_checkpoint_meta,
    resolve_checkpoint,
    save_sharded,
)
from megatron_lite.core.checkpoint.state import ensure_optimizer_state, sharded_model_state, sharded_optimizer_state

__all__ = [
    "Checkpointer",
    "Loaded",
    "sharded_model_state",
    "sharded_optimizer_state",
    "ensure_optimizer_state",
    "save_sharded",
    "load_sharded",
    "read_checkpoint_meta",
    "resolve_checkpoint",
    "verify_checkpoint",
    "CorruptCheckpointError",
    "AsyncCheckpointWriter",
    "AsyncCheckpointError",
]
