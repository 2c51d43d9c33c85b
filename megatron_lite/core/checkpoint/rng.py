"""RNG states in distributed checkpoints, one set per rank.

Every rank draws from its own streams (the model-parallel dropout stream differs per TP rank), so
each rank saves its states under keys of its own rank; DCP writes each from the rank that holds it.
They are restored only when the checkpoint was written by the same number of ranks: after a layout
change the streams cannot correspond, and training continues from the seeds instead.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from megatron_lite.core.checkpoint.safe_reader import read_dcp_metadata
from megatron_lite.core.parallel.random import RNGStatesTracker

_PREFIX = "rng_rank"


def _trackers(module: nn.Module) -> dict[str, RNGStatesTracker]:
    # Keyed by module name ("root" for the module itself); "|" separates owner and stream in the keys.
    return {name or "root": m.rng_tracker for name, m in module.named_modules()
            if isinstance(getattr(m, "rng_tracker", None), RNGStatesTracker)}


def rng_state(module: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """This rank's RNG states (global CPU/CUDA generators and the module's dropout streams) as flat DCP entries."""
    key = f"{_PREFIX}{rank}"
    state = {f"{key}.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"{key}.cuda"] = torch.cuda.get_rng_state()
    for owner, tracker in _trackers(module).items():
        for stream, value in tracker.get_states().items():
            state[f"{key}.{owner}|{stream}"] = value
    return state


def rng_placeholders(path: str | Path, rank: int) -> dict[str, torch.Tensor]:
    """Empty tensors for every RNG entry this rank saved in the checkpoint at ``path`` (to load into)."""
    metadata = read_dcp_metadata(Path(path) / ".metadata").state_dict_metadata
    prefix = f"{_PREFIX}{rank}."
    return {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in metadata.items() if k.startswith(prefix) and hasattr(m, "size")}


def restore_rng_state(module: nn.Module, loaded: dict[str, torch.Tensor], rank: int) -> None:
    """Put states loaded into :func:`rng_placeholders` back into the generators and streams."""
    key = f"{_PREFIX}{rank}"
    if f"{key}.torch" in loaded:
        torch.set_rng_state(loaded[f"{key}.torch"])
    if f"{key}.cuda" in loaded and torch.cuda.is_available():
        torch.cuda.set_rng_state(loaded[f"{key}.cuda"])
    trackers = _trackers(module)
    per_owner: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in loaded.items():
        if name.startswith(f"{key}.") and "|" in name:
            owner, stream = name[len(key) + 1:].split("|", 1)
            per_owner.setdefault(owner, {})[stream] = value
    for owner, states in per_owner.items():
        if owner in trackers:
            trackers[owner].set_states(states)
