"""Optimizer configuration, construction, LR schedules and gradient clipping."""
from megatron_lite.core.optim.clip_grads import clip_grad_norm, global_grad_norm
from megatron_lite.core.optim.config import OptimizerConfig
from megatron_lite.core.optim.scheduler import MegatronLRScheduler, lr_at_step
from megatron_lite.core.optim.build import build_optimizer

__all__ = ["OptimizerConfig", "MegatronLRScheduler", "lr_at_step", "build_optimizer", "clip_grad_norm",
           "global_grad_norm"]
