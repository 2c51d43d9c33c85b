"""FLOPs and memory of a training run, estimated from the config and measured on a real model.

Plain PyTorch (no Lightning): :mod:`flops` counts model FLOPs per step, :mod:`memory` estimates
per-rank bytes for a parallel layout (:mod:`parameters` and :mod:`activations` the parts, :mod:`run` for a run
as the strategy describes it), :mod:`kv_cache` a generation's key/value cache, :mod:`probe` measures activation
bytes of a real forward.
"""

from megatron_lite.core.estimator.activations import (
    ActivationBreakdown,
    activation_breakdown,
    korthikanti_activation_bytes_per_layer,
)
from megatron_lite.core.estimator.flops import (
    FlopsBreakdown,
    attention_flops_per_cp_rank,
    forward_flops_breakdown,
    forward_flops_per_token,
    megatron_formula_flops,
    training_flops_per_step,
)
from megatron_lite.core.estimator.kv_cache import kv_cache_bytes, kv_cache_values_per_token_and_layer
from megatron_lite.core.estimator.memory import EstimateLayout, MemoryEstimate, estimate_memory, estimate_stages
from megatron_lite.core.estimator.objective_cost import ObjectiveCost, objective_cost
from megatron_lite.core.estimator.parameters import ParamShape, parameter_shapes
from megatron_lite.core.estimator.precision_bytes import KERNEL_SAVES, PRECISION_BYTES, KernelSaves
from megatron_lite.core.estimator.probe import (
    SavedTensorsReport,
    ScheduleActivationProbe,
    StepActivationReport,
    measure_activation_bytes,
    measure_retained_tensors,
    measure_saved_tensors,
    measure_step_activations,
)
from megatron_lite.core.estimator.run import estimate_for_run, estimate_objective
from megatron_lite.core.estimator.schedule_memory import ChunkActivations, ScheduleMemory, schedule_memory
from megatron_lite.core.precision import normalize_precision

__all__ = [
    "kv_cache_bytes",
    "kv_cache_values_per_token_and_layer",
    "FlopsBreakdown",
    "attention_flops_per_cp_rank",
    "forward_flops_breakdown",
    "forward_flops_per_token",
    "megatron_formula_flops",
    "training_flops_per_step",
    "ObjectiveCost",
    "objective_cost",
    "KERNEL_SAVES",
    "PRECISION_BYTES",
    "ActivationBreakdown",
    "ChunkActivations",
    "EstimateLayout",
    "KernelSaves",
    "MemoryEstimate",
    "ParamShape",
    "ScheduleMemory",
    "activation_breakdown",
    "estimate_for_run",
    "estimate_objective",
    "estimate_memory",
    "estimate_stages",
    "korthikanti_activation_bytes_per_layer",
    "normalize_precision",
    "parameter_shapes",
    "schedule_memory",
    "SavedTensorsReport",
    "ScheduleActivationProbe",
    "measure_activation_bytes",
    "measure_retained_tensors",
    "measure_saved_tensors",
    "StepActivationReport",
    "measure_step_activations",
]
