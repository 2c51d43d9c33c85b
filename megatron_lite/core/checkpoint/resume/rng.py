"""RNG states in distributed checkpoints, one set per rank, restored only where they mean the same thing.

Every rank draws from its own streams (the model-parallel dropout stream differs per TP rank, the
data-parallel one per pipeline stage), so each rank saves its states under keys of its own rank; DCP
writes each from the rank that holds it. Beside them each rank saves the layout it drew them in (sizes
and its own coordinates, :func:`layout_fingerprint`).

A state is only meaningful at the same place of the same layout: after a change of TP, PP, virtual PP,
DP, CP or EP size (or of sequence parallelism, which moves dropout into the model-parallel stream)
rank ``r``'s saved streams belong to another position in the model, even when the number of ranks is
the same. Then the states are not restored but re-derived from the seeds (:func:`rederive_rng_state`),
mixed with the step so a resumed run does not replay the dropout masks of step 0 (Megatron ignores the
RNG state after a (TP, PP) change and keeps its seeded one; we do the same for every dimension).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_lite.core.checkpoint.format.safe_reader import read_dcp_metadata
from megatron_lite.core.object_store import join, location
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.random import model_rng_state, restore_model_rng_state, rng_trackers

_PREFIX = "rng_rank"
_LAYOUT = "layout"
# The fingerprint's entries, in order: the sizes that decide which stream a rank draws from, then the
# rank's coordinates in them. A new entry goes at the end (older checkpoints then simply differ).
FINGERPRINT_FIELDS = (
    "world_size",
    "tp",
    "pp",
    "vpp",
    "dp",
    "cp",
    "ep",
    "sequence_parallel",
    "tp_rank",
    "pp_rank",
    "dp_rank",
    "cp_rank",
    "ep_rank",
)


def layout_fingerprint(layout: ParallelLayout) -> torch.Tensor:
    """The layout as an int64 tensor (see ``FINGERPRINT_FIELDS``): equal fingerprints mean this rank's
    streams stand for the same thing."""
    config = layout.config
    values = {
        "world_size": layout.world_size,
        "tp": layout.tp_size,
        "pp": layout.pp_size,
        "vpp": config.virtual_pipeline_model_parallel_size,
        "dp": layout.dp_size,
        "cp": layout.cp_size,
        "ep": layout.ep_size,
        "sequence_parallel": int(layout.sequence_parallel),
        "tp_rank": layout.tp_rank,
        "pp_rank": layout.pp_rank,
        "dp_rank": layout.dp_rank,
        "cp_rank": layout.cp_rank,
        "ep_rank": layout.ep_rank,
    }
    return torch.tensor([values[f] for f in FINGERPRINT_FIELDS], dtype=torch.int64)


def rng_state(module: nn.Module, rank: int, layout: Optional[ParallelLayout] = None) -> dict[str, torch.Tensor]:
    """This rank's RNG states (global CPU/CUDA generators and the module's dropout streams) as flat DCP
    entries, with the fingerprint of ``layout`` (the one they were drawn in; one process if None)."""
    key = f"{_PREFIX}{rank}"
    state = {f"{key}.{name}": value for name, value in model_rng_state(module).items()}
    state[f"{key}.{_LAYOUT}"] = layout_fingerprint(layout if layout is not None else ParallelLayout.single())
    return state


def rng_placeholders(path: str | Path, rank: int) -> dict[str, torch.Tensor]:
    """Empty tensors for every RNG entry this rank saved in the checkpoint at ``path`` (to load into)."""
    metadata = read_dcp_metadata(join(location(path), ".metadata")).state_dict_metadata
    prefix = f"{_PREFIX}{rank}."
    return {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }


def layout_mismatch(loaded: dict[str, torch.Tensor], layout: ParallelLayout, rank: int) -> Optional[str]:
    """Why this rank's loaded RNG states (from :func:`rng_placeholders`) do not fit ``layout``, or None
    when they were saved at the same position of the same layout."""
    saved = loaded.get(f"{_PREFIX}{rank}.{_LAYOUT}")
    if saved is None:
        if f"{_PREFIX}{rank}.torch" not in loaded:
            return f"the checkpoint holds no RNG state of rank {rank} (it was written by fewer ranks)"
        return "the checkpoint does not record the layout its RNG states were drawn in"
    current = layout_fingerprint(layout)
    if saved.shape != current.shape:
        return "the checkpoint records its layout in another form"
    if torch.equal(saved, current):
        return None
    diffs = [f"{name} {int(a)} -> {int(b)}" for name, a, b in zip(FINGERPRINT_FIELDS, saved, current) if a != b]
    return "the parallel layout changed (" + ", ".join(diffs) + ")"


def saved_cpu_generator_state(loaded: dict[str, torch.Tensor], rank: int) -> Optional[torch.Tensor]:
    """The global CPU generator's state among the loaded entries (None if it was not saved)."""
    return loaded.get(f"{_PREFIX}{rank}.torch")


def restore_rng_state(
    module: nn.Module, loaded: dict[str, torch.Tensor], rank: int, cpu_generator: bool = True
) -> None:
    """Put states loaded into :func:`rng_placeholders` back into the generators and streams (the caller
    checked :func:`layout_mismatch` first). ``cpu_generator=False`` leaves the global CPU generator to the
    caller (see :func:`saved_cpu_generator_state`)."""
    prefix = f"{_PREFIX}{rank}."
    restore_model_rng_state(
        module, {name[len(prefix) :]: value for name, value in loaded.items() if name.startswith(prefix)}, cpu_generator
    )


def derived_seed(seed: int, step: int) -> int:
    """A seed for ``step`` of a run seeded ``seed``: a hash of both (a sum would collide across streams
    whose seeds differ by small offsets, as Megatron's do), kept below 2**63."""
    digest = hashlib.sha256(f"megatron-lite-rng:{int(seed)}:{int(step)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def derived_cpu_generator_state(step: int) -> torch.Tensor:
    """The global CPU generator's state re-derived for ``step`` from the seed it was last seeded with
    (``torch.initial_seed()``: Lightning's ``seed_everything``)."""
    return torch.Generator().manual_seed(derived_seed(torch.initial_seed(), step)).get_state()


def rederive_rng_state(module: nn.Module, step: int, cpu_generator: bool = True) -> None:
    """Re-seed from the seeds of this layout, for ``step``: the global CPU (unless ``cpu_generator=False``:
    see :func:`derived_cpu_generator_state`) and CUDA generators from the seed they were last seeded with,
    every dropout stream of ``module`` from its own seed (which depends on the rank's TP and PP coordinates)."""
    if cpu_generator:
        torch.set_rng_state(derived_cpu_generator_state(step))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(derived_seed(torch.cuda.initial_seed(), step))
    for tracker in rng_trackers(module).values():
        devices = {d for (_, d) in tracker.states} | {"cpu"}
        tracker.states = {
            (name, device): torch.Generator(device=device).manual_seed(derived_seed(seed, step)).get_state()
            for name, seed in tracker.seeds.items()
            for device in devices
        }
