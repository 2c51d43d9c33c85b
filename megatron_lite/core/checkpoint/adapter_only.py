"""Adapter-only checkpoints: a LoRA run saves its adapters, not the frozen base it can find again.

A LoRA run whose base came from ``GPTModule.from_pretrained(path)`` (the module records the base's
:class:`~megatron_lite.core.checkpoint.fingerprint.WeightsSource`) saves every entry but the base's frozen
parameters -- the adapters, the LoRA recipe, persistent buffers -- with the optimizer, loop and RNG state as any run,
and records the base's path and content hash in ``meta.json`` (:data:`BASE_RECORD`). A load of such a checkpoint
takes the base's entries from the module (which must hold that very base: :func:`check_base`) and everything else
from the checkpoint, strictly. A base without a recorded source (built randomly, or trained in this process) cannot
be found again: its LoRA checkpoints hold it too (full checkpoints, as before).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from megatron_lite.core.checkpoint.fingerprint import WeightsSource
from megatron_lite.core.checkpoint.resume.entries import EntryMismatch
from megatron_lite.core.peft.lora import is_adapter_parameter

BASE_RECORD = "megatron_lite_lora_base"
"""The ``meta.json`` entry of an adapter-only checkpoint: the :class:`WeightsSource` (as JSON) of the base it leaves
out."""


def base_entries(module: nn.Module) -> set[str]:
    """The entries of ``module`` an adapter-only checkpoint leaves out: its frozen parameters outside the adapters."""
    return {name for name, p in module.named_parameters() if not p.requires_grad and not is_adapter_parameter(name)}


def adapter_only_state(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """``state`` (``module``'s checkpoint entries) without the base's (:func:`base_entries`)."""
    base = base_entries(module)
    return {name: value for name, value in state.items() if name not in base}


def recorded_base(meta: Optional[dict]) -> Optional[WeightsSource]:
    """The base an adapter-only checkpoint's metadata records; None for any other checkpoint."""
    record = (meta or {}).get(BASE_RECORD)
    return WeightsSource.from_json(record) if record is not None else None


def source_of(module: Any) -> Optional[WeightsSource]:
    """The :class:`WeightsSource` of ``module``'s base (its ``pretrained_source``, hashed at the first call), or None:
    not loaded with ``from_pretrained``, trained since, or its files changed since they were loaded."""
    loaded = getattr(module, "pretrained_source", None)
    return loaded.source() if loaded is not None else None


def check_base(recorded: WeightsSource, source: Optional[WeightsSource], checkpoint: Any) -> None:
    """Refuse to load the adapter-only ``checkpoint`` (trained on ``recorded``) into a module whose base is ``source``
    (None: a base of unknown origin) unless the two hold the same weights (the same content hash, wherever they are)."""
    fix = f"build the module with GPTModule.from_pretrained({recorded.path!r}), the base the adapters were trained on"
    if source is None:
        raise ValueError(
            f"{checkpoint} holds LoRA adapters only, trained on the base {recorded.path} (sha256 "
            f"{recorded.sha256[:12]}), but the module's base has no recorded source (it was not loaded with "
            f"GPTModule.from_pretrained, or was trained since): {fix}"
        )
    if source.sha256 != recorded.sha256:
        raise ValueError(
            f"{checkpoint} holds LoRA adapters trained on the base {recorded.path} (sha256 {recorded.sha256[:12]}), "
            f"but the module's base is {source.path} (sha256 {source.sha256[:12]}): a different base. {fix}"
        )


def without_base(mismatch: EntryMismatch, module: nn.Module) -> EntryMismatch:
    """``mismatch`` (``module``'s entries vs an adapter-only checkpoint's) less the missing entries that are
    ``module``'s parameters outside the adapters: the base's, which the module holds."""
    params = {name for name, _ in module.named_parameters()}
    missing = tuple(name for name in mismatch.missing if name not in params or is_adapter_parameter(name))
    return EntryMismatch(missing, mismatch.unexpected)
