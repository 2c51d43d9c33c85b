"""The start-up report of a run: Megatron's per-rank memory table and FLOPs per step, logged when ``fit`` starts.

MegatronStrategy logs it in every rank before the model is built (``trainer.strategy.memory_estimate`` keeps the
estimate); :class:`~megatron_lite.callbacks.MegatronMetrics` counts its TFLOP/s and MFU with the same
:func:`flops_per_step`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from megatron_lite.core.estimator.flops import training_flops_per_step
from megatron_lite.core.estimator.memory import MemoryEstimate
from megatron_lite.core.estimator.objective_cost import objective_cost
from megatron_lite.core.estimator.report import format_table, memory_warning
from megatron_lite.core.estimator.run import estimate_objective, trained_lora
from megatron_lite.core.parallel.geometry import DataGeometry
from megatron_lite.core.parallel.run_spec import RunSpec


def flops_per_step(module: Any, datamodule: Any, geometry: DataGeometry, tensor_model_parallel_size: int) -> float:
    """Model FLOPs of one optimizer step of ``module`` (a GPTConfig ``config``) on a global batch of ``geometry``,
    with what one sample costs its objective (``objective_cost``); an MoE's active experts only (the top-k); a LoRA
    fine-tune's frozen base without its weight gradients (:func:`trained_lora`)."""
    return training_flops_per_step(
        module.config,
        geometry.global_batch_size,
        geometry.seq_length,
        tensor_model_parallel_size=tensor_model_parallel_size,
        cost=objective_cost(module, datamodule),
        lora=trained_lora(module),
    )


def report_memory_estimate(
    module: Any, datamodule: Any, run: RunSpec, device: torch.device
) -> Optional[MemoryEstimate]:
    """Log the per-rank memory estimate and FLOPs per step of ``run`` (on rank 0), with a warning when it exceeds
    the CUDA ``device``'s memory; return the estimate (None if the module and data do not say enough). Never stops
    a run: an estimate it cannot make is a warning."""
    try:
        estimate = estimate_objective(module, run, datamodule, device.type)
        if estimate is None or run.data is None:  # (an estimate is made only for data with a geometry)
            return None
        flops = flops_per_step(module, datamodule, run.data, run.parallel.tensor_model_parallel_size)
    except (ValueError, TypeError) as error:
        rank_zero_warn(f"megatron-lite: no memory estimate for this run ({error})")
        return None
    rank_zero_info("megatron-lite memory estimate (before the first step):\n" + format_table(estimate, flops))
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    warning = memory_warning(estimate, total)
    if warning:
        rank_zero_warn(warning)
    return estimate
