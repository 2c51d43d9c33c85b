"""Optimizer configuration, parameter groups, LR / weight-decay schedules and gradient clipping."""

from megatron_lite.core.optim.build import ParamEntry, build_optimizer, model_param_entries, param_groups
from megatron_lite.core.optim.clip_grads import clip_grad_norm, global_grad_norm
from megatron_lite.core.optim.config import OptimizerConfig
from megatron_lite.core.optim.scheduler import (
    MegatronLRScheduler,
    ScheduleLengths,
    lr_at,
    lr_at_step,
    schedule_lengths,
    weight_decay_at,
)

__all__ = [
    "OptimizerConfig",
    "MegatronLRScheduler",
    "ScheduleLengths",
    "schedule_lengths",
    "lr_at",
    "lr_at_step",
    "weight_decay_at",
    "ParamEntry",
    "build_optimizer",
    "model_param_entries",
    "param_groups",
    "clip_grad_norm",
    "global_grad_norm",
]
