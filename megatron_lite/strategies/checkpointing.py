"""What MegatronStrategy's checkpoint methods need from Lightning besides the Checkpointer
(``core/checkpoint/checkpointer.py``), which writes and reads the checkpoints: which saves run in the background,
the config classes a checkpoint's metadata may rebuild, and the refusals of what the strategy cannot do.

Lightning hands a strategy a checkpoint dict (``state_dict``, ``optimizer_states`` and the rest) to save and
expects one back from a load; the strategy passes the tensors' entries to :meth:`Checkpointer.save` as they are and
the rest as its ``meta``, and returns the loaded ``meta``."""
from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from megatron_lite.core.checkpoint.format.meta_json import dataclass_types
from megatron_lite.core.engine.contract import EngineModule

# Lightning hooks in which checkpoint callbacks save (ModelCheckpoint: every_n_train_steps, every epoch,
# after validation); a save made elsewhere (training_step, after fit) was asked for by the user.
CALLBACK_SAVE_HOOKS = frozenset({"on_train_batch_end", "on_train_epoch_end", "on_validation_end"})


def saves_asynchronously(async_save: bool, storage_options: Optional[Any], live: bool,
                         module: Optional[LightningModule], trainer: Any) -> bool:
    """Whether a save runs in the background: ``storage_options={"async_save": bool}`` decides; otherwise saves from
    callback hooks during a running fit (where ModelCheckpoint saves) when the strategy's ``async_save`` is set. Never
    without a live process group (``live``)."""
    if storage_options is not None:
        if not isinstance(storage_options, dict) or set(storage_options) != {"async_save"}:
            raise TypeError(f"MegatronStrategy.save_checkpoint takes only storage_options={{'async_save': True}} "
                            f"or {{'async_save': False}} (it writes with DCP), got {storage_options!r}")
        return bool(storage_options["async_save"]) and live
    return (async_save and live and trainer is not None and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
            and getattr(module, "_current_fx_name", None) in CALLBACK_SAVE_HOOKS)


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
            f"Trainer(plugins=...); for saves written in the background use MegatronStrategy(async_save=True).")


def refuse_without_weights(module: Optional[LightningModule]) -> None:
    """A module whose trained weights the forked ranks could not hand back holds stale ones: refuse to use them."""
    message = getattr(module, "_megatron_lite_weights_missing", None)
    if message:
        raise RuntimeError(message)
