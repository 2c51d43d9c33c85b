"""One of our checkpoints read whole into this process: its saved configs and its model's global tensors.

For a one-process model (``GPTModule.from_pretrained``) and the converter, with no process group: DCP reads
every tensor under the model's prefix at its saved (global, layout-independent) shape, whatever layout
wrote it. The two functions here are the only places that know how a checkpoint stores them, so a change of
the checkpoint format is one edit.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_lite.core.checkpoint.format.integrity import verify_checkpoint
from megatron_lite.core.checkpoint.format.safe_reader import SafeLoadPlanner, read_dcp_metadata, safe_reader
from megatron_lite.core.checkpoint.format.sharded import dcp_error, read_checkpoint_meta, resolve_checkpoint
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.object_store import Location, is_file, join, location
from megatron_lite.core.optim.config import OptimizerConfig

# The Lightning module's state dict lives under "model" in the DCP state; GPTModule's own model is "model." in it.
MODEL_PREFIX = "model."
HYPER_PARAMETERS = "hyper_parameters"


def is_checkpoint_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is one of our (DCP) checkpoints."""
    return is_file(join(location(path), ".metadata"))


def _require(path: Location) -> None:
    if not is_checkpoint_directory(path):
        raise FileNotFoundError(
            f"{path} is not a megatron-lite checkpoint directory (no DCP .metadata inside); pass "
            f"the directory that trainer.save_checkpoint(), ModelCheckpoint or "
            f"`megatron-lite convert --from hf` wrote"
        )


def read_checkpoint_hparams(
    path: str | os.PathLike, allowed: Sequence[type] = (GPTConfig, OptimizerConfig)
) -> dict[str, Any]:
    """The module's saved hyperparameters (GPTModule: ``config``, ``optimizer``, ``seed``)."""
    path = resolve_checkpoint(path)
    _require(path)
    hparams = read_checkpoint_meta(path, list(allowed)).get(HYPER_PARAMETERS)
    if not isinstance(hparams, dict) or not isinstance(hparams.get("config"), GPTConfig):
        raise ValueError(
            f"{path} holds no GPTConfig among its hyperparameters; it was not written by a GPTModule "
            f"(build the module yourself and load the checkpoint with ckpt_path=...)"
        )
    return hparams


def read_model_tensors(path: str | os.PathLike, prefix: str = MODEL_PREFIX) -> dict[str, torch.Tensor]:
    """{name under ``prefix``: tensor at its saved shape} for the LightningModule's tensors whose names start with
    ``prefix`` (GPTModule's model: ``embedding.weight``, ...), read on the CPU without a process group. Fused
    blocks keep their blocked shape (``[2, ffn, h]`` for gate/up), the vocabulary its saved padding."""
    path = resolve_checkpoint(path)
    _require(path)
    verify_checkpoint(path)  # every file against its checksum before anything is read
    metadata = read_dcp_metadata(join(path, ".metadata")).state_dict_metadata
    key_prefix = "model." + prefix  # the DCP state's "model" entry, then the parameter names
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.items()
        if key.startswith(key_prefix) and isinstance(entry, TensorStorageMetadata)
    }
    if not state:
        raise ValueError(f"{path} holds no model tensors (no '{key_prefix}*' entries)")
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=safe_reader(path), planner=SafeLoadPlanner(), no_dist=True)
        except CheckpointException as error:
            raise dcp_error(error, f"reading {path}") from None
    return {key[len(key_prefix) :]: tensor for key, tensor in state.items()}
