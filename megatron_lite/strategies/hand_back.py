"""What the ranks of a fork/spawn launch hand back to the process that launched them (a notebook, a test).

After ``fit`` every rank writes the whole trained model as full tensors (one file per distinct piece) into the
run's directory, with the fp32 masters of a half-precision model; after ``predict`` each data-parallel replica
writes its predictions with their sample indices. Once the ranks have exited, the launching process loads the
model into its module and merges the predictions (the launcher in ``_lightning_private`` calls
:func:`receive_results`).
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from megatron_lite.core.checkpoint.full.state import (
    gather_full_state,
    load_full_state,
    read_full_state,
    write_full_state,
)
from megatron_lite.strategies._lightning_private import predictions_with_indices
from megatron_lite.strategies.checkpointing import megatron_optimizer_of
from megatron_lite.strategies.predictions import merge_predictions, write_predictions


def hand_back(strategy: Any, trainer: Any, run_dir: str) -> None:
    """In every rank (collective): after fit, the whole model as full tensors; after predict, this replica's
    predictions with their sample indices."""
    layout, module = strategy.parallel_layout, strategy.lightning_module
    assert layout is not None and module is not None
    if trainer.state.fn == TrainerFn.FITTING:
        state = gather_full_state(module, layout, substitutes=master_weights(strategy))
        if state is not None:
            os.makedirs(os.path.join(run_dir, "model"), exist_ok=True)
            write_full_state(state, os.path.join(run_dir, "model"), strategy.global_rank)
    elif trainer.state.fn == TrainerFn.PREDICTING and trainer.predict_loop.return_predictions:
        if layout.tp_rank == 0 and layout.cp_rank == 0 and layout.is_last_pipeline_stage:
            os.makedirs(os.path.join(run_dir, "predictions"), exist_ok=True)
            write_predictions(
                predictions_with_indices(trainer),
                layout,
                os.path.join(run_dir, "predictions", f"rank{strategy.global_rank:05d}.safetensors"),
            )


def master_weights(strategy: Any) -> dict[str, Tensor]:
    """The optimizer's fp32 masters of a half-precision (``bf16-true``/``16-true``) model, by the module's
    parameter names: what training arrived at, of which the model holds a rounded copy. Collective under the
    distributed optimizer (gathered over DP)."""
    mopt = megatron_optimizer_of(strategy.lightning_module)
    if mopt is None:
        return {}
    names = {id(p): n for n, p in strategy.lightning_module.named_parameters()}
    params = dict(mopt.named_params)
    # a parameter the module no longer has (distillation projections taken off at the end) is not handed back
    return {names[id(params[n])]: master for n, master in mopt.master_weights().items() if id(params[n]) in names}


def receive_results(strategy: Any, trainer: Any, run_dir: str, rank_zero_result: Any) -> Any:
    """In the launching process after the ranks finished: load the handed-back model into the module (after fit)
    and return what ``trainer.<fn>`` should (the merged predictions after predict)."""
    if trainer.state.fn == TrainerFn.FITTING:
        receive_model(strategy.lightning_module, os.path.join(run_dir, "model"))
    if trainer.state.fn == TrainerFn.PREDICTING:  # files only where the ranks kept predictions
        return merge_predictions(os.path.join(run_dir, "predictions"), rank_zero_result)
    return rank_zero_result


def receive_model(module: LightningModule, directory: str) -> None:
    """Load the handed-back model into ``module``; where it cannot be, mark the module so that the next
    validate/test/predict/save refuses it (its weights would be stale) instead of running on them."""
    try:
        state = read_full_state(directory)
        loader = getattr(module, "load_full_state_dict", None)
        if callable(loader):
            loader(state)
        else:
            load_full_state(module, state)
    except (ValueError, FileNotFoundError) as error:
        message = (
            f"the trained weights of {type(module).__name__} could not be handed back from the forked ranks "
            f"({error}); validate/test/predict/save_checkpoint here would use stale weights, so they are "
            f"refused. Build the model in __init__, or give the module a load_full_state_dict(state) method "
            f"that builds it (GPTModule has one), or save checkpoints during fit (ModelCheckpoint) and pass "
            f"ckpt_path=..."
        )
        module._megatron_lite_weights_missing = message
        rank_zero_warn(message)
        return
    module._megatron_lite_weights_missing = None
