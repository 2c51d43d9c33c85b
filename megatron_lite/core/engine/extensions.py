"""Objective extensions: change what a module optimises without writing a second training step.

Distillation adds a teacher's KL term to the loss, a speculative-decoding draft head trains on a frozen
model's hidden states, quantization-aware training swaps layers for quantized ones: each is an
:class:`ObjectiveExtension` added to a module (``GPTModule.add_objective_extension``, usually by a
callback). The engine then runs :class:`ExtendedObjective` — the module's own ``forward_step``/``loss``
wrapped by every extension, first added outermost — through the same schedules, gradient reduction and
optimizer step as pretraining. An extension reports metrics of its own by adding them to the wrapped loss's
report (:func:`~megatron_lite.core.parallel.loss_report.with_report`): the engine reduces them with the loss.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from megatron_lite.core.parallel.layout import ParallelLayout

ForwardStep = Callable[[Any, dict, Optional[torch.Tensor]], Any]
LossFn = Callable[[Any, dict], tuple]
"""(output, microbatch) -> (sum, count) or (sum, count, report)."""


class ObjectiveExtension:
    """A change to a module's objective. Every hook defaults to "no change"; override what you need."""

    attach_before_sharding: bool = False
    """Attach before FSDP2 shards the model (an extension adding parameters the model trains, e.g. LoRA's adapters:
    FSDP2 takes no parameter into a module it has sharded); others attach to the sharded model."""

    def attach(self, module: Any, model: nn.Module, layout: ParallelLayout) -> None:
        """Called once per built model, after the module built ``model`` for ``layout`` and before the
        optimizer is made: add trainable sub-modules to ``model``, freeze parameters, build a teacher..."""

    def forward_step(
        self, inner: ForwardStep, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]
    ) -> Any:
        """One model chunk's forward; ``inner`` is the wrapped objective's. Whatever a non-last stage
        returns is sent to the next stage (one tensor), so extra activations travel inside it."""
        return inner(part, microbatch, input_tensor)

    def loss(self, inner: LossFn, output: Any, microbatch: dict) -> tuple:
        """(sum over the microbatch's loss units, number of units[, report]), on the last stage. ``inner``
        may return a report; keep its entries (``with_report(inner(...), my_metric=report_entry(s, n))``)."""
        return inner(output, microbatch)

    def step_metrics(self) -> dict[str, torch.Tensor]:
        """Metrics of the training step just run that are not a reduction of the loss (a setting, a state),
        equal on every rank, logged by the module as they are named (e.g. ``{"train/scale": ...}``); read once
        per step. A per-token or per-sample metric belongs in the loss's report, which the engine reduces."""
        return {}


def add_extension(module: Any, extension: ObjectiveExtension, who: str) -> None:
    """Add ``extension`` to ``module`` (a GPTModule: ``add_objective_extension``), or refuse a module that takes none,
    naming ``who`` asked (a callback's name)."""
    add = getattr(module, "add_objective_extension", None)
    if add is None:
        raise TypeError(
            f"{who} needs a megatron_lite.GPTModule (one with add_objective_extension), got {type(module).__name__}"
        )
    add(extension)


class ExtendedObjective:
    """``base`` (an engine Objective) wrapped by ``extensions``, the first one outermost."""

    def __init__(self, base: Any, extensions: Sequence[ObjectiveExtension]) -> None:
        self.base = base
        self.extensions = list(extensions)

    def forward_step(self, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> Any:
        step: ForwardStep = self.base.forward_step
        for extension in reversed(self.extensions):
            step = _bind_forward(extension, step)
        return step(part, microbatch, input_tensor)

    def loss(self, output: Any, microbatch: dict) -> tuple:
        loss: LossFn = self.base.loss
        for extension in reversed(self.extensions):
            loss = _bind_loss(extension, loss)
        return loss(output, microbatch)


def _bind_forward(extension: ObjectiveExtension, inner: ForwardStep) -> ForwardStep:
    return lambda part, microbatch, input_tensor: extension.forward_step(inner, part, microbatch, input_tensor)


def _bind_loss(extension: ObjectiveExtension, inner: LossFn) -> LossFn:
    return lambda output, microbatch: extension.loss(inner, output, microbatch)
