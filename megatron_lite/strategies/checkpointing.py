"""MegatronStrategy's checkpoint half: Lightning's checkpoint dicts to and from the run's
:class:`~megatron_lite.core.checkpoint.checkpointer.Checkpointer` (``core/checkpoint/checkpointer.py``), which writes
and reads the checkpoints, and what that needs from Lightning besides: which saves run in the background, the config
classes a checkpoint's metadata may rebuild, and the refusals of what the strategy cannot do.

Lightning hands a strategy a checkpoint dict (``state_dict``, ``optimizer_states`` and the rest) to save and
expects one back from a load; :class:`StrategyCheckpoints` passes the tensors' entries to :meth:`Checkpointer.save` as
they are and the rest as its ``meta``, and returns the loaded ``meta``. The strategy holds one and its checkpoint hooks
call it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from megatron_lite.core.checkpoint.adapter_only import (
    BASE_RECORD,
    adapter_only_state,
    base_entries,
    check_base,
    recorded_base,
    source_of,
)
from megatron_lite.core.checkpoint.checkpointer import Checkpointer
from megatron_lite.core.checkpoint.errors import EntryMismatchError
from megatron_lite.core.checkpoint.format.integrity import verify_checkpoint
from megatron_lite.core.checkpoint.format.meta_json import dataclass_types
from megatron_lite.core.checkpoint.format.sharded import checkpoint_keys, resolve_checkpoint
from megatron_lite.core.checkpoint.full.reader import MODEL_PREFIX, read_model_tensors
from megatron_lite.core.checkpoint.resume.entries import MODEL_STATE, holds_training_state, read_meta_plain
from megatron_lite.core.engine.contract import EngineModule
from megatron_lite.core.object_store import Location, location
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.peft.lora import LORA_RECIPE, has_adapters, lora_recipe, restore_lora
from megatron_lite.strategies._lightning_private import _distributed_is_initialized, attached_trainer
from megatron_lite.strategies.auto_resume import AutoResume, resume_checkpoint
from megatron_lite.strategies.launch_checks import lora_resume_message, mismatch_message, weights_only_message
from megatron_lite.utils.local_path import require_local_or_object_path

if TYPE_CHECKING:
    from megatron_lite.strategies.megatron import MegatronStrategy

# Lightning hooks in which checkpoint callbacks save (ModelCheckpoint: every_n_train_steps, every epoch,
# after validation); a save made elsewhere (training_step, after fit) was asked for by the user.
CALLBACK_SAVE_HOOKS = frozenset({"on_train_batch_end", "on_train_epoch_end", "on_validation_end"})


def saves_asynchronously(
    async_save: bool, storage_options: Optional[Any], live: bool, module: Optional[LightningModule], trainer: Any
) -> bool:
    """Whether a save runs in the background: ``storage_options={"async_save": bool}`` decides; otherwise saves from
    callback hooks during a running fit (where ModelCheckpoint saves) when the strategy's ``async_save`` is set. Never
    without a live process group (``live``)."""
    if storage_options is not None:
        if not isinstance(storage_options, dict) or set(storage_options) != {"async_save"}:
            raise TypeError(
                f"MegatronStrategy.save_checkpoint takes only storage_options={{'async_save': True}} "
                f"or {{'async_save': False}} (it writes with DCP), got {storage_options!r}"
            )
        return bool(storage_options["async_save"]) and live
    return (
        async_save
        and live
        and trainer is not None
        and trainer.state.fn == TrainerFn.FITTING
        and trainer.state.status == TrainerStatus.RUNNING
        and getattr(module, "_current_fx_name", None) in CALLBACK_SAVE_HOOKS
    )


def checkpoint_classes(module: Optional[LightningModule], trainer: Any) -> list[type]:
    """Classes a checkpoint's metadata may hold besides plain data: the config dataclasses of the live module and
    datamodule (their configs and saved hyperparameters). Taken from the objects the user built, never from names
    in a checkpoint."""
    values: list[Any] = []
    if isinstance(module, EngineModule):
        values += [module.config, module.optimizer_config]
    for owner in (module, getattr(trainer, "datamodule", None)):
        hparams = getattr(owner, "hparams", None)
        if isinstance(hparams, dict):
            values += list(hparams.values())
    return dataclass_types(values)


def refuse_checkpoint_io(checkpoint_io: Any) -> None:
    """MegatronStrategy writes every checkpoint itself -- DCP shards of every rank, ``meta.json``, checksums, an
    atomic commit -- which a ``CheckpointIO`` plugin (one rank's whole dict to one file) cannot do: refuse one."""
    if checkpoint_io is not None:
        raise ValueError(
            f"MegatronStrategy does not take a CheckpointIO plugin ({type(checkpoint_io).__name__}): it writes "
            f"distributed checkpoints itself (every rank's shards through torch.distributed.checkpoint, with "
            f"checksums and an atomic commit), which a CheckpointIO cannot. Remove it from checkpoint_io= / "
            f"Trainer(plugins=...); for saves written in the background use MegatronStrategy(async_save=True)."
        )


def refuse_without_weights(module: Optional[LightningModule]) -> None:
    """A module whose trained weights the forked ranks could not hand back holds stale ones: refuse to use them."""
    message = getattr(module, "_megatron_lite_weights_missing", None)
    if message:
        raise RuntimeError(message)


def megatron_optimizer_of(module: Optional[LightningModule]) -> Any:
    """The module's core optimizer wrapper (fp32 masters, ZeRO-1, loss scaler), if it has one."""
    return module.megatron_optimizer if isinstance(module, EngineModule) else None


class StrategyCheckpoints:
    """The checkpoints of one MegatronStrategy: one Checkpointer for as long as the module, optimizers and layout it
    was made over stay the same (a save in flight is waited for by the next), and the CPU generator's state a load
    leaves for the first step."""

    def __init__(self, strategy: "MegatronStrategy") -> None:
        self._strategy = strategy
        self.in_use: Optional[Checkpointer] = None
        """The run's Checkpointer (None before the first save or load, and after the run)."""
        self._sources: tuple = ()  # what `in_use` was made over (see checkpointer)
        # The global CPU generator's state to set before the first step after a load.
        self._pending_cpu_rng: Optional[Tensor] = None
        self._told_full_lora = False  # the note that a LoRA run saves its base too, once

    def live_layout(self) -> Optional[ParallelLayout]:
        """This rank's layout while its process groups exist (None in the launching process, or after the run)."""
        layout = self._strategy.parallel_layout
        live = layout is not None and not layout.destroyed and _distributed_is_initialized()
        return layout if live else None

    def checkpointer(self) -> Checkpointer:
        """The Checkpointer over this process's module, optimizers and layout as they are now: the same one for a
        whole run, a new one when they changed (a forked rank, the next ``trainer.fit``)."""
        strategy = self._strategy
        module = strategy.lightning_module
        assert module is not None
        layout = self.live_layout()
        sources = (
            module,
            layout,
            tuple(getattr(o, "_optimizer", o) for o in strategy.optimizers),
            megatron_optimizer_of(module),
            strategy.options.use_torch_fsdp2 and layout is not None,
            module.run_timers() if isinstance(module, EngineModule) else None,
            tuple(checkpoint_classes(module, attached_trainer(module))),
        )
        if self.in_use is None or sources != self._sources:
            if self.in_use is not None:
                self.in_use.close()
            module, layout, optimizers, mopt, fsdp, timers, allowed = sources
            self.in_use = Checkpointer(
                module, layout, optimizers, megatron_optimizer=mopt, allowed=allowed, fsdp=fsdp, timers=timers
            )
            self._sources = sources
        return self.in_use

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        """Write ``checkpoint`` (Lightning's dict): its tensors' entries as DCP shards, the rest as ``meta.json``. In
        the background for ModelCheckpoint's saves with ``async_save=True`` (or ``storage_options={"async_save":
        True}``)."""
        require_local_or_object_path(filepath, "the checkpoint path")
        strategy = self._strategy
        live = self.live_layout() is not None
        module = strategy.lightning_module
        asynchronous = saves_asynchronously(
            strategy.options.async_save, storage_options, live, module, attached_trainer(module)
        )
        refuse_without_weights(module)
        path = location(strategy.broadcast(str(filepath)))
        model_state, optimizer_states = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        model_state = self._adapters_only(module, model_state, checkpoint)
        if not live and not optimizer_states:
            # The launching process of a forked fit (a notebook): it holds the trained weights, the ranks
            # held the optimizer.
            rank_zero_warn(
                "megatron-lite: this checkpoint holds the model's weights but no optimizer state (the "
                "forked ranks kept it); resuming from it restarts the optimizer. For an exact resume "
                "save checkpoints during fit (ModelCheckpoint)."
            )
        self.checkpointer().save(
            path, checkpoint, model_state=model_state, optimizer_states=optimizer_states, asynchronous=asynchronous
        )

    def load(self, checkpoint_path: Any, auto_resume: Optional[AutoResume]) -> dict[str, Any]:
        """Load ``checkpoint_path`` into the module in place (and, in ``fit``, the optimizers and RNG states); return
        its ``meta``, Lightning's checkpoint dict without the tensors. ``auto_resume``: ``ckpt_path="last"`` as the
        launcher replaced it, if it did."""
        path = self._checkpoint_to_load(checkpoint_path, auto_resume)
        module = self._strategy.lightning_module
        trainer = attached_trainer(module)
        fitting = trainer is not None and trainer.state.fn == "fit"
        meta = read_meta_plain(path)
        if fitting and not holds_training_state(meta):  # every rank reads the same file: all raise together
            raise ValueError(weights_only_message(path))
        self._restore_adapters(module, path, fitting)
        base = recorded_base(meta)
        if base is not None:
            check_base(base, source_of(module), path)
        try:
            loaded = self.checkpointer().load(
                path,
                optimizers=fitting,
                rng=fitting,
                strict=module.strict_loading,
                verify=False,
                restore_cpu_rng=False,
                provided=base_entries(module) if base is not None else (),
            )
        except EntryMismatchError as error:
            raise ValueError(mismatch_message(path, module, error.mismatch, meta)) from None
        if loaded.mismatch:
            rank_zero_warn(
                f"megatron-lite: strict_loading=False: loaded the entries {path} shares with the module; "
                f"{loaded.mismatch.describe()} (the missing ones keep their current values)."
            )
        # The global CPU generator is set right before the first step (restore_cpu_rng): Lightning draws from it
        # after the load, once per DataLoader iterator it creates (its shared seed), which an uninterrupted run did
        # before the saved step.
        self._pending_cpu_rng = loaded.cpu_rng_state
        if auto_resume is not None and str(checkpoint_path) == auto_resume.requested:
            rank_zero_info(
                f"megatron-lite: ckpt_path='last' resumed {path} (global step {loaded.meta.get('global_step')})"
            )
        return loaded.meta

    def _adapters_only(self, module: Any, model_state: dict[str, Any], checkpoint: dict[str, Any]) -> dict[str, Any]:
        """A LoRA run's entries to save: without its frozen base when the module records where that came from (the
        base's path and hash go into ``checkpoint``'s metadata), else all of them (said once per run)."""
        model = getattr(module, "model", None)
        if not has_adapters(model):
            return model_state
        source = source_of(module)
        if source is None:
            if not self._told_full_lora:
                rank_zero_info(
                    "megatron-lite: this LoRA run's base has no recorded source (it was not loaded with "
                    "GPTModule.from_pretrained, was trained in this process, or its files changed since they were "
                    "loaded), so its checkpoints hold the base too (full checkpoints, resumable as any)."
                )
                self._told_full_lora = True
            return model_state
        checkpoint[BASE_RECORD] = source.to_json()
        return adapter_only_state(model_state, module)

    def _restore_adapters(self, module: Any, path: Location, fitting: bool) -> None:
        """A LoRA run's checkpoint loaded into a model without adapters: outside fit (validate/test/predict) the
        adapters are rebuilt from the checkpoint's recipe before their values load; fit is refused (its optimizer
        exists already, over the base)."""
        model = getattr(module, "model", None)
        if model is None or lora_recipe(model) is not None:
            return
        key = f"{MODEL_STATE}.{MODEL_PREFIX}{LORA_RECIPE}"
        if key not in checkpoint_keys(path):
            return
        if fitting:
            raise ValueError(lora_resume_message(path))
        recipe = read_model_tensors(path, prefix=MODEL_PREFIX + LORA_RECIPE)[""]
        restore_lora(model, {LORA_RECIPE: recipe}, self.live_layout() or ParallelLayout.single())

    def _checkpoint_to_load(self, checkpoint_path: Any, auto_resume: Optional[AutoResume]) -> Location:
        """Before anything reads it: the path resolved (an interrupted replace recovered) and every file checked
        against the checksums written with it, on all ranks together. For ``ckpt_path="last"``: the newest
        checkpoint of the run's directories that passes, the newer ones skipped with a warning."""
        if auto_resume is not None and str(checkpoint_path) == auto_resume.requested:
            return resume_checkpoint(auto_resume)
        path = resolve_checkpoint(self._strategy.broadcast(str(checkpoint_path)))
        verdict = verify_checkpoint(path)
        if verdict.status == "unverified":
            rank_zero_warn(
                f"megatron-lite: {path} has no manifest.json (written before checksums existed, or by "
                f"plain DCP); its files are loaded without an integrity check."
            )
        return path

    def restore_cpu_rng(self) -> None:
        """At the first step after a load: the global CPU generator as the checkpoint left it (see :meth:`load`)."""
        if self._pending_cpu_rng is not None:
            torch.set_rng_state(self._pending_cpu_rng)
            self._pending_cpu_rng = None

    def wait(self) -> None:
        """Block until a checkpoint being written in the background is committed; raise its error."""
        if self.in_use is not None:
            self.in_use.wait()

    def close(self, raise_error: bool) -> None:
        """At the end of the run, before its process groups go: a save in flight is committed if every rank wrote it
        and its error raised -- or, with ``raise_error=False`` (a failing run), logged rather than hiding the run's
        own."""
        checkpointer, self.in_use, self._sources = self.in_use, None, ()
        if checkpointer is not None:
            checkpointer.close(raise_error=raise_error)
