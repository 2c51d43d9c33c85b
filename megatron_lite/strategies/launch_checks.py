"""Checks of the checkpoint given to ``trainer.fit/validate/test/predict`` (``ckpt_path``), run in the launching
process before any rank starts (the module's, the data's and the callbacks' checks are ``pre_launch``'s).
A bad ``ckpt_path`` used to surface inside every rank, after the process groups existed, as DCP's error."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from megatron_lite.core.checkpoint.adapter_only import check_base, recorded_base, source_of, without_base
from megatron_lite.core.checkpoint.format import object_commit
from megatron_lite.core.checkpoint.format.sharded import checkpoint_keys
from megatron_lite.core.checkpoint.full.reader import MODEL_PREFIX
from megatron_lite.core.checkpoint.resume.entries import (
    MODEL_STATE,
    EntryMismatch,
    certain_mismatch,
    checkpoint_model_entries,
    compare_entries,
    config_difference,
    holds_training_state,
    module_entries,
    read_meta_plain,
)
from megatron_lite.core.estimator.run import trained_lora
from megatron_lite.core.object_store import Location, check_bucket, is_remote, location
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.peft.lora import LORA_RECIPE
from megatron_lite.strategies._lightning_private import checkpoint_callback_dir
from megatron_lite.utils.local_path import require_local_or_object_path

# ckpt_path values that Lightning resolves itself (a checkpoint callback's file, the HPC path, a model registry)
_SYMBOLIC = ("last", "best", "hpc")


def ckpt_path_of(arguments: Iterable[Any]) -> Optional[str]:
    """The checkpoint path among the positional arguments of Lightning's ``_fit_impl`` / ``_validate_impl`` /
    ``_test_impl`` / ``_predict_impl`` (the only str or path among them)."""
    return next((str(a) for a in arguments if isinstance(a, (str, os.PathLike))), None)


def check_ckpt_path(value: Optional[str]) -> None:
    """A path that Lightning does not resolve itself must be a megatron-lite checkpoint directory."""
    if _resolved_by_lightning(value):
        return
    require_local_or_object_path(value, "ckpt_path")
    if is_remote(value):  # the bucket reachable, the checkpoint committed (object_commit.resolve explains what is not)
        check_bucket(value)
        object_commit.resolve(str(location(value)))
        return
    path = Path(value)
    fix = (
        "pass the directory that trainer.save_checkpoint() or ModelCheckpoint wrote, or ckpt_path='last' to "
        "resume the newest checkpoint in the checkpoint callback's directory"
    )
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={value!r} does not exist; {fix}")
    if not path.is_dir():
        raise ValueError(
            f"ckpt_path={value!r} is a file, not a megatron-lite checkpoint directory (DCP shards and "
            f"meta.pt; a single-file checkpoint comes from another strategy); {fix}"
        )
    if not (path / ".metadata").is_file():
        raise ValueError(
            f"ckpt_path={value!r} is not a megatron-lite checkpoint directory (no DCP .metadata inside); {fix}"
        )


def check_checkpoint_dirs(trainer: Any) -> None:
    """The directories the Trainer's checkpoint callbacks save into are local or in a supported object store whose
    bucket exists and may be listed with the credentials found (another URL would be written as a local folder named
    after its scheme)."""
    for callback in getattr(trainer, "callbacks", None) or []:
        directory = checkpoint_callback_dir(callback, trainer)
        require_local_or_object_path(directory, f"{type(callback).__name__}'s directory")
        if directory is not None and is_remote(directory):
            check_bucket(directory)


def _resolved_by_lightning(value: Optional[str]) -> bool:
    return value is None or value in _SYMBOLIC or value.startswith("registry")


def lora_resume_message(path: Path) -> str:
    """The refusal of ``fit(ckpt_path=<a LoRA run's checkpoint>)`` for a module that will have no adapters."""
    return (
        f"ckpt_path={str(path)!r} is a LoRA run's checkpoint, but the module's model has no adapters: add "
        f"megatron_lite.callbacks.LoRA with the run's settings to the Trainer to resume it"
    )


def check_checkpoint_fits(value: Optional[str], module: Any, fitting: bool, callbacks: Sequence[Any] = ()) -> None:
    """What the checkpoint's metadata tells without reading a tensor: ``fit`` cannot resume a checkpoint of weights
    alone, and (unless ``module.strict_loading`` is False) the checkpoint's model entries must be the module's, as
    its model is built for one process -- on the meta device when it is not built yet -- where no objective
    extension can explain the difference (an adapter-only LoRA checkpoint lacks the base, which the module must hold:
    the one its metadata names) (see :func:`~megatron_lite.core.checkpoint.resume.entries.certain_mismatch`;
    the ranks check the rest). ``fit`` of a LoRA run's checkpoint needs the adapters: the module's model carries them,
    or a LoRA callback among ``callbacks`` (the Trainer's) will add them. Call after :func:`check_ckpt_path`."""
    if _resolved_by_lightning(value):
        return
    path: Location = object_commit.resolve(str(location(value))) if is_remote(value) else Path(value)
    meta = read_meta_plain(path)
    if fitting and not holds_training_state(meta):
        raise ValueError(weights_only_message(path))
    if fitting and module is not None and trained_lora(module, callbacks) is None:
        if f"{MODEL_STATE}.{MODEL_PREFIX}{LORA_RECIPE}" in checkpoint_keys(path):
            raise ValueError(lora_resume_message(path))
    base = recorded_base(meta)  # an adapter-only LoRA checkpoint: the module must hold the base it names
    if base is not None and module is not None:
        check_base(base, source_of(module), path)
    if module is None or not getattr(module, "strict_loading", True):
        return
    with _with_model(module) as built:
        if built is None:
            return
        mismatch = certain_mismatch(built, compare_entries(module_entries(built), checkpoint_model_entries(path)))
        if base is not None:
            mismatch = without_base(mismatch, built)
    if mismatch:
        raise ValueError(mismatch_message(path, module, mismatch, meta))


@contextlib.contextmanager
def _with_model(module: nn.Module) -> Iterator[Optional[nn.Module]]:
    """``module`` with a model to read names from: its own, or (a GPTModule before ``configure_model``) one built
    for one process on the meta device for the duration (no memory, no initialisation). None when the names
    cannot be known before the ranks build the model."""
    build = getattr(module, "build_model", None)
    if getattr(module, "model", False) is not None or not callable(build):
        yield module if any(True for _ in module.parameters()) else None
        return
    try:
        with torch.device("meta"):
            model = build(ParallelLayout.single())
    except Exception:  # noqa: BLE001 - the ranks build it for real and say what is wrong
        yield None
        return
    module.model = model
    try:
        yield module
    finally:
        module.model = None


def weights_only_message(path: Path) -> str:
    return (
        f"ckpt_path={str(path)!r} holds weights only (no optimizer, LR-scheduler or loop state: written by "
        f"`megatron-lite convert --from hf`, `megatron-lite prune` or with save_weights_only=True), so fit has "
        f"nothing to resume. To train from these weights, load them with GPTModule.from_pretrained({str(path)!r}) "
        f"and call fit without ckpt_path; validate/test/predict(ckpt_path=...) read such a checkpoint as it is."
    )


def mismatch_message(path: Path, module: Any, mismatch: EntryMismatch, meta: Optional[dict]) -> str:
    """The refusal of a strict load (the same before launch and in the ranks)."""
    differ = config_difference(meta, getattr(module, "config", None))
    return (
        f"ckpt_path={str(path)!r} does not fit {type(module).__name__}'s model: {mismatch.describe()}"
        f"{f'; it was saved from a model with {differ}' if differ else ''}. Pass a checkpoint of this model, or "
        f"load only the entries both have on purpose with module.strict_loading = False (Lightning's switch; "
        f"`--model.strict_loading false` on the command line): the others keep their current values."
    )
