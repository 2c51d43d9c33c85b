"""Checks of a run before any rank starts: the run description, and the one protocol the module, the datamodule and
the Trainer's callbacks implement to check it.

MegatronStrategy builds the run's :class:`~megatron_lite.core.parallel.run_spec.RunSpec` (:func:`build_run_spec`)
and runs :func:`check_run` in the launching process, before it starts any rank, and again in every rank before its
process groups exist (under torchrun or SLURM no launcher ran it). The order, each step raising one ValueError that
names the fix:

1. the run description itself: parallel sizes against the world size, where FSDP2 composes, every batch in whole
   microbatches on every data-parallel rank (ramp-up and the interleaved schedule included);
2. the module's optimizer settings against the run (re-validated: a field may have been set after construction;
   the distributed optimizer beside FSDP2);
3. the module's ``check_before_launch``;
4. the model against the run: heads and groups over TP, layers into the stages, sequence lengths under CP and SP;
5. the estimated memory against the machine (``check_memory``);
6. the datamodule's ``check_before_launch`` -- last of the module and data: it may read the data files;
7. each callback's ``check_before_launch``, in the Trainer's order.

In the launching process the strategy checks the ``ckpt_path`` of ``fit/validate/test/predict`` before step 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import torch

from megatron_lite.core.engine.contract import EngineModule
from megatron_lite.core.estimator.run import estimate_objective
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.run_checks import check_run_fits_model
from megatron_lite.core.parallel.geometry import declared_geometry
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.strategies.memory_check import check_memory_fits

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from megatron_lite.strategies.megatron import MegatronStrategy


@runtime_checkable
class PreLaunchCheck(Protocol):
    """Something that can refuse a run before any rank starts: the LightningModule, the datamodule or a callback
    that defines ``check_before_launch`` (no base class needed). MegatronStrategy calls it in the launching
    process and again in every rank, in the order of :mod:`megatron_lite.strategies.pre_launch`."""

    def check_before_launch(
        self,
        run: RunSpec,
        trainer: "pl.Trainer",
        module: "pl.LightningModule",
        datamodule: Optional["pl.LightningDataModule"],
    ) -> None:
        """Raise a ValueError naming the fix if this run cannot work: ``run`` is the run's description, ``trainer``
        the Trainer (its state says fit/validate/test/predict), ``module`` and ``datamodule`` what it was given."""
        ...


def build_run_spec(strategy: "MegatronStrategy", datamodule: Any, world_size: int) -> RunSpec:
    """The run description of ``strategy`` over ``world_size`` ranks with ``datamodule``'s
    declared batch geometry."""
    options = strategy.options
    return RunSpec(
        parallel=options.parallel,
        world_size=world_size,
        data=declared_geometry(datamodule),
        precision=strategy.precision_plugin.precision,
        use_torch_fsdp2=options.use_torch_fsdp2,
        ddp_bucket_size=options.ddp_bucket_size,
        overlap_grad_reduce=options.overlap_grad_reduce,
    )


def check_run(
    strategy: "MegatronStrategy",
    module: Any,
    datamodule: Any,
    trainer: Any,
    world_size: int,
    device: Optional[torch.device] = None,
) -> RunSpec:
    """Build the run description and check the run in the documented order (see the module docstring); return
    the description. Given a rank's CUDA ``device``, its free memory is checked too."""
    run = build_run_spec(strategy, datamodule, world_size)
    if isinstance(module, EngineModule):
        optimizer_config = module.optimizer_config
        if callable(getattr(optimizer_config, "validate", None)):
            optimizer_config.validate()  # again: a field may have been set after construction (lr=nan)
        run.check_optimizer(optimizer_config)
    _call_check(module, run, trainer, module, datamodule)
    config = module.config if isinstance(module, EngineModule) else None
    check_run_fits_model(run, config if isinstance(config, GPTConfig) else None)
    if strategy.options.check_memory:
        _check_memory(strategy, run, module, datamodule, trainer, device)
    _call_check(datamodule, run, trainer, module, datamodule)
    for callback in list(getattr(trainer, "callbacks", None) or []):
        _call_check(callback, run, trainer, module, datamodule)
    return run


def _call_check(checker: Any, run: RunSpec, trainer: Any, module: Any, datamodule: Any) -> None:
    if isinstance(checker, PreLaunchCheck):
        checker.check_before_launch(run, trainer, module, datamodule)


def _check_memory(
    strategy: "MegatronStrategy",
    run: RunSpec,
    module: Any,
    datamodule: Any,
    trainer: Any,
    device: Optional[torch.device],
) -> None:
    """Refuse the run before anything is allocated when its estimate exceeds the machine (see memory_check)."""
    device_type = (
        device.type
        if device is not None
        else (strategy.parallel_devices[0].type if strategy.parallel_devices else "cpu")
    )
    try:
        # The Trainer's callbacks: a LoRA callback's adapters are not added to the module before its setup.
        estimate = estimate_objective(module, run, datamodule, device_type, getattr(trainer, "callbacks", None) or ())
    except (ValueError, TypeError):
        return  # no estimate: nothing to compare (the start-up report says why)
    if estimate is not None:
        fitting = trainer is None or trainer.state.fn in (None, "fit")
        check_memory_fits(
            estimate,
            fitting=fitting,
            device_type=device_type,
            ranks_on_host=max(strategy.num_processes, 1),
            world_size=run.world_size,
            device=device,
        )
