"""Activation recomputation (Megatron's ``recompute_granularity`` / ``recompute_method`` / ``recompute_num_layers``).

A checkpointed region keeps only its inputs in the forward pass and runs again in the backward
pass to rebuild what its backward needs. ``torch.utils.checkpoint`` restores the global CPU/CUDA
generators for that second run, but our dropout draws from the model's own streams
(:class:`RNGStatesTracker`), so :func:`checkpoint` also replays those: the recomputed region must
drop exactly the elements the original forward dropped, and the streams must continue afterwards
from where the backward pass found them (Megatron's ``CheckpointFunction`` does the same).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.parallel.random import RNGStatesTracker


def checkpoint(function: Callable[..., Any], *args: Any, rng_tracker: RNGStatesTracker, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with its activations recomputed in the backward pass.

    The dropout streams of ``rng_tracker`` are replayed from their state at this call, so the
    recomputation reproduces the forward bit for bit, under TP and sequence parallelism alike
    (collectives inside ``function`` simply run again).
    """

    def contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        # torch calls this right before running ``function`` for the first time.
        forward_states = rng_tracker.get_states()
        return contextlib.nullcontext(), _replaying(rng_tracker, forward_states)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


@contextlib.contextmanager
def _replaying(rng_tracker: RNGStatesTracker, forward_states: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run the recomputation with the streams as they were in the forward pass, then put back
    the backward pass's states (torch may also leave this block early, once it has what it needs)."""
    backward_states = rng_tracker.get_states()
    rng_tracker.set_states(forward_states)
    try:
        yield
    finally:
        rng_tracker.set_states(backward_states)


def recompute_active(module: torch.nn.Module) -> bool:
    """Recompute only where it saves memory: training with autograd recording (not eval, not no_grad)."""
    return module.training and torch.is_grad_enabled()


def full_recompute_groups(config: GPTConfig, num_layers: Optional[int] = None) -> list[tuple[range, bool]]:
    """Consecutive groups of layer positions and whether each group is checkpointed as one region.

    ``num_layers`` is how many layers this model holds (all of them, or one pipeline stage's).
    'uniform': groups of ``recompute_num_layers`` layers, each checkpointed (the last group may be
    shorter). 'block': the first ``recompute_num_layers`` layers checkpointed one by one, the rest
    run normally. Anything but 'full' granularity: one plain group.
    """
    n = config.num_layers if num_layers is None else num_layers
    if config.recompute_granularity != "full" or n == 0:
        return [(range(n), False)] if n else []
    k = config.recompute_num_layers
    assert k is not None  # GPTConfig refuses 'full' granularity without recompute_num_layers
    if config.recompute_method == "uniform":
        return [(range(start, min(start + k, n)), True) for start in range(0, n, k)]
    checkpointed = [(range(i, i + 1), True) for i in range(min(k, n))]
    return checkpointed + ([(range(k, n), False)] if k < n else [])
