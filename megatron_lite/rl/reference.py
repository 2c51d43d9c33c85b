"""The frozen reference model of an RL objective (DPO, GRPO), built for the module's current layout."""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from megatron_lite.core.checkpoint.full.state import carry_over_state, same_layout


def frozen_reference(
    module: Any, previous: Optional[nn.Module], load: Optional[Callable[[], nn.Module]] = None
) -> nn.Module:
    """``module``'s reference for its layout, frozen and in eval mode: ``previous`` itself when it was built for
    this layout; else this rank's shards cut out of ``previous`` (the notebook's one-process copy after a forked
    fit), out of the one-process model ``load()`` returns (a reference checkpoint), or copied from the policy as it
    is now (its initial weights, before any step)."""
    layout = module.parallel_layout
    if previous is not None and same_layout(getattr(previous, "layout", None), layout):
        return previous
    reference = module.build_model(layout)
    source = previous if previous is not None else (load() if load is not None else None)
    if source is not None:
        carry_over_state(source, reference, vocab_size=module.config.vocab_size)
    else:
        reference.load_state_dict(module.model.state_dict())
    return reference.requires_grad_(False).eval()
