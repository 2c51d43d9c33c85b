"""Which of a module's tensors a checkpoint holds: the strict-load check every load path shares.

A checkpoint's model entries are its DCP keys under ``model.``: the LightningModule's parameter and
persistent-buffer names, which do not depend on the layout (layers are keyed by their global index). A load
is strict by default: the module's entries and the checkpoint's must be the same set. Otherwise an entry the
checkpoint lacks would keep its initial value and one the module lacks would be dropped without a word (a
4-layer checkpoint loaded into 2 layers, a trained output layer into a model that ties it to the embedding).
A partial load is the caller's explicit choice (``strict=False``: the entries both have are loaded).

Before the ranks exist the launching process can compare the checkpoint's key list (DCP metadata, no tensor
read) with the module's model as built for one process on the meta device (:func:`certain_mismatch`); the
ranks compare the exact sets once objective extensions have added their sub-modules.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable, Optional

from torch import nn

from megatron_lite.core.checkpoint.format import meta_json
from megatron_lite.core.checkpoint.format.integrity import META
from megatron_lite.core.checkpoint.format.sharded import checkpoint_keys
from megatron_lite.core.object_store import join, location, read_bytes

MODEL_STATE = "model"
"""The DCP state's entry holding the LightningModule's tensors (its keys are ``model.<tensor name>``)."""

QUANTIZATION_RECIPE = "megatron_lite_quantization"
"""The uint8 buffer on a quantized model's root holding its quantization recipe as JSON bytes
(``megatron_lite.post_training.quantization`` writes and reads it; every load path recognises it by this name)."""

_SHOWN = 5  # names listed per kind in a message; the rest are counted


@dataclasses.dataclass(frozen=True)
class EntryMismatch:
    """How a module's tensor names and a checkpoint's differ."""

    missing: tuple[str, ...] = ()
    """The module's entries the checkpoint does not hold (they would keep their initial values)."""
    unexpected: tuple[str, ...] = ()
    """The checkpoint's entries the module does not have (they would be dropped)."""

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected)

    def describe(self) -> str:
        """``missing 1 entry (a), unexpected 18 entries (b, c, d, e, f and 13 more)``: a few names per kind."""
        parts = []
        for kind, names in (("missing", self.missing), ("unexpected", self.unexpected)):
            if names:
                shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
                parts.append(f"{kind} {len(names)} entr{'y' if len(names) == 1 else 'ies'} ({shown})")
        return ", ".join(parts)


def _natural(name: str) -> list:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def compare_entries(module_names: Iterable[str], checkpoint_names: Iterable[str]) -> EntryMismatch:
    """The names of one side missing from the other, in natural order."""
    ours, theirs = set(module_names), set(checkpoint_names)
    return EntryMismatch(tuple(sorted(ours - theirs, key=_natural)), tuple(sorted(theirs - ours, key=_natural)))


def persistent_buffers(module: nn.Module):
    """(name, buffer) of ``module``'s buffers that its state dict holds."""
    for name, buf in module.named_buffers():
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if buf is not None and name.rsplit(".", 1)[-1] not in owner._non_persistent_buffers_set:
            yield name, buf


def module_entries(module: nn.Module) -> set[str]:
    """The names a checkpoint of ``module`` holds: its parameters and persistent buffers."""
    return {name for name, _ in module.named_parameters()} | {name for name, _ in persistent_buffers(module)}


def checkpoint_model_entries(path: str | os.PathLike, keys: Optional[set[str]] = None) -> set[str]:
    """The model entries of the checkpoint at ``path`` (names without the ``model.`` prefix), from its DCP
    metadata alone (``keys``: its flattened keys, if read already)."""
    prefix = MODEL_STATE + "."
    keys = keys if keys is not None else checkpoint_keys(path)
    return {key[len(prefix) :] for key in keys if key.startswith(prefix)}


def certain_mismatch(module: nn.Module, mismatch: EntryMismatch) -> EntryMismatch:
    """The part of ``mismatch`` (``module``'s entries as built before any objective extension attached vs a
    checkpoint's) that no extension can explain: every missing entry (extensions only add sub-modules), and the
    unexpected entries that belong to sub-modules ``module`` has -- a tensor of one of its layers (a trained
    ``output_layer.weight`` where the output layer is tied) or another element of one of its stacks
    (``layers.3`` beside ``layers.0-1``). Entries of sub-modules it lacks altogether (a draft head, distillation
    projections, quantizers) and records on the model's root (a quantization recipe) are left to the ranks,
    which compare once the extensions attached."""
    modules = dict(module.named_modules())
    certain = []
    for name in mismatch.unexpected:
        parts = name.split(".")
        owner, depth = "", 0
        while depth < len(parts) - 1:
            child = f"{owner}.{parts[depth]}" if owner else parts[depth]
            if child not in modules:
                break
            owner, depth = child, depth + 1
        in_stack = isinstance(modules[owner], (nn.ModuleList, nn.ModuleDict))
        tensor_of_layer = depth == len(parts) - 1 and owner.count(".") >= 1
        if in_stack or tensor_of_layer:
            certain.append(name)
    return EntryMismatch(mismatch.missing, tuple(certain))


def read_meta_plain(path: str | os.PathLike) -> Optional[dict]:
    """A checkpoint's ``meta.json`` with every config as a plain dict (nothing built), or None without one."""
    file = join(location(path), META)
    try:
        raw = read_bytes(file)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    meta = meta_json.loads(raw, allowed=None, unknown_classes="dict", source=str(file))
    return meta if isinstance(meta, dict) else None


def holds_training_state(meta: Optional[dict]) -> bool:
    """Whether a checkpoint's metadata (:func:`read_meta_plain`) holds what ``fit`` resumes (the LR schedulers,
    the loops): not one written with weights only (``megatron-lite convert --from hf``, ``save_weights_only``).
    True when unknown (no ``meta.json``)."""
    return meta is None or "lr_schedulers" in meta


def config_difference(meta: Optional[dict], config: Any, limit: int = 4) -> str:
    """``num_layers=4 (this module's: 2), ...``: the scalar fields in which the checkpoint's saved model config
    (``hyper_parameters.config``) differs from ``config``; "" when unknown or equal."""
    saved = ((meta or {}).get("hyper_parameters") or {}).get("config")
    if not isinstance(saved, dict) or not dataclasses.is_dataclass(config):
        return ""
    differ = []
    for field in dataclasses.fields(config):
        ours, theirs = getattr(config, field.name), saved.get(field.name)
        if field.name in saved and isinstance(ours, (bool, int, float, str)) and ours != theirs:
            differ.append(f"{field.name}={theirs!r} (this module's: {ours!r})")
    return ", ".join(differ[:limit]) + (" ..." if len(differ) > limit else "")


def refuse_quantized_into_plain(module: nn.Module, path: str | os.PathLike, keys: Optional[set[str]] = None) -> None:
    """A quantized model's checkpoint loaded into an unquantized model would drop its quantizers without a word
    (only the tensors the model has are read): refuse it, naming the two ways that keep them. ``module`` holds
    the model as ``module.model`` (a GPTModule); ``keys``: the checkpoint's flattened keys, if read already."""
    model = getattr(module, "model", None)
    if model is None or hasattr(model, QUANTIZATION_RECIPE):
        return
    keys = keys if keys is not None else checkpoint_keys(path)
    if f"{MODEL_STATE}.model.{QUANTIZATION_RECIPE}" in keys:
        raise ValueError(
            f"the checkpoint {path} holds a quantized model, but the module's model is not quantized: its quantizers "
            f"would be dropped. Add megatron_lite.callbacks.Quantize(<its config>, when='fit_start') to the Trainer "
            f"(the quantizers are rebuilt before the checkpoint loads), or load it with GPTModule.from_pretrained."
        )
