"""The frozen reference model of an RL objective (DPO, GRPO), built for the module's current layout -- or, for a
policy with LoRA adapters, the policy's own base with its adapters switched off (no second model in memory)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from torch import nn

from megatron_lite.core.checkpoint.full.state import carry_over_state, same_layout
from megatron_lite.core.peft import adapters_disabled, has_adapters


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


def freeze_multi_token_prediction(model: Optional[nn.Module]) -> None:
    """Freeze a policy's multi-token prediction depths (DeepSeek-V3's MTP): DPO and GRPO score sequences with the
    main head, so the depths get no gradient and keep their weights (not even weight decay moves them)."""
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        mtp.requires_grad_(False)


def base_is_reference(model: Optional[nn.Module]) -> bool:
    """Whether the policy ``model`` is its own reference: it carries LoRA adapters, so its frozen base (the adapters
    switched off) is the policy before any step -- B starts at zero -- and stays it, as the base never trains."""
    return has_adapters(model)


@contextlib.contextmanager
def run_as_base(model: nn.Module) -> Iterator[None]:
    """Run the policy ``model`` as its frozen reference inside the block: adapters off and eval mode (as a built
    reference is: no dropout), both restored after. Gradients are the caller's to turn off."""
    was_training = model.training
    model.eval()
    try:
        with adapters_disabled(model):
            yield
    finally:
        model.train(was_training)
