"""RNG streams for dropout under tensor parallelism (Megatron's RNG tracker).

Inside TP regions each TP rank must drop different elements of its shard, so dropout there runs
in a "model-parallel" stream seeded ``seed + 2718 + tp_rank``. Outside them the activations are
replicated over TP and must be dropped identically, so dropout runs in a "data-parallel" stream
seeded ``seed + 100 * pp_rank`` (Megatron's default seed), the same on every TP rank. Both streams
are owned by the model, so neither depends on the global RNG state nor disturbs it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"


class RNGStatesTracker:
    """Named generator streams that can be swapped in for a region of code.

    A stream is a seed; its state is kept per device type (CPU, CUDA) and created on first use
    on that device, so the model may be moved between devices after it was built.
    """

    def __init__(self) -> None:
        self.seeds: dict[str, int] = {}
        self.states: dict[tuple[str, str], torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Register a stream ``name`` seeded with ``seed``."""
        if name in self.seeds:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.seeds[name] = seed

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG, device: torch.device | str = "cpu"):
        """Run the block with stream ``name`` as ``device``'s default generator, then restore it."""
        if name not in self.seeds:
            raise KeyError(f"RNG stream {name!r} was not added; call add() first")
        device = torch.device(device)
        key = (name, str(device))
        saved = _get_state(device)
        if key not in self.states:
            self.states[key] = _seeded_state(self.seeds[name], device)
        _set_state(self.states[key], device)
        try:
            yield
        finally:
            self.states[key] = _get_state(device)
            _set_state(saved, device)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state, keyed ``name@device`` (for checkpoints)."""
        return {f"{n}@{d}": v.clone() for (n, d), v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states saved by :meth:`get_states`."""
        self.states = {_stream_key(k): v.clone() for k, v in states.items()}


def _stream_key(key: str) -> tuple[str, str]:
    """(stream name, device) of a :meth:`RNGStatesTracker.get_states` key ``name@device``."""
    name, _, device = key.partition("@")
    return name, device


# The device-specific parts: CUDA calls only for CUDA devices.
def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _seeded_state(seed: int, device: torch.device) -> torch.Tensor:
    # A fresh generator of the device's kind: seeding it leaves the global generators untouched.
    return torch.Generator(device=device).manual_seed(seed).get_state()


def model_parallel_rng_tracker(seed: int, tp_rank: int, pp_rank: int = 0) -> RNGStatesTracker:
    """A tracker with Megatron's streams: model-parallel (``seed + 2718 + tp_rank``) and
    data-parallel (``seed + 100 * pp_rank``)."""
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    tracker.add(DATA_PARALLEL_RNG, seed + 100 * pp_rank)
    return tracker


def rng_trackers(module: nn.Module) -> dict[str, RNGStatesTracker]:
    """The dropout streams of ``module`` and its sub-modules, keyed by the owner's name ("root": ``module``)."""
    return {
        name or "root": m.rng_tracker
        for name, m in module.named_modules()
        if isinstance(getattr(m, "rng_tracker", None), RNGStatesTracker)
    }


def model_rng_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every generator ``module``'s steps draw from, as it is now: the global CPU generator (``"torch"``), the
    CUDA one once initialised (``"cuda"``) and each dropout stream (``"owner|stream"``); see
    :func:`restore_model_rng_state`."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    for owner, tracker in rng_trackers(module).items():
        for stream, value in tracker.get_states().items():
            state[f"{owner}|{stream}"] = value
    return state


def restore_model_rng_state(module: nn.Module, state: dict[str, torch.Tensor], cpu_generator: bool = True) -> None:
    """Put a :func:`model_rng_state` back (other keys are ignored). ``cpu_generator=False`` leaves the global
    CPU generator as it is."""
    if cpu_generator and "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    trackers = rng_trackers(module)
    per_owner: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in state.items():
        if "|" in name:
            owner, stream = name.split("|", 1)
            per_owner.setdefault(owner, {})[stream] = value
    for owner, states in per_owner.items():
        if owner in trackers:
            trackers[owner].set_states(states)
