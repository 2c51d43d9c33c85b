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

MODEL_PARALLEL_RNG = "model-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"


class RNGStatesTracker:
    """Named generator states that can be swapped in for a region of code."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Register a stream ``name`` seeded with ``seed``."""
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        with self._default_state_preserved():
            self._manual_seed(seed)
            self.states[name] = self._get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with stream ``name`` as the default generator, then restore."""
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was not added; call add() first")
        saved = self._get_state()
        self._set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get_state()
            self._set_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints)."""
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states saved by :meth:`get_states`."""
        self.states = {k: v.clone() for k, v in states.items()}

    # The device-specific parts: the CUDA generator only when the model lives on CUDA.
    def _get_state(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_state(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _manual_seed(self, seed: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    @contextlib.contextmanager
    def _default_state_preserved(self):
        saved = self._get_state()
        try:
            yield
        finally:
            self._set_state(saved)


def model_parallel_rng_tracker(seed: int, tp_rank: int, pp_rank: int = 0,
                               device: torch.device | str = "cpu") -> RNGStatesTracker:
    """A tracker with Megatron's streams: model-parallel (``seed + 2718 + tp_rank``) and
    data-parallel (``seed + 100 * pp_rank``)."""
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
    tracker.add(DATA_PARALLEL_RNG, seed + 100 * pp_rank)
    return tracker
