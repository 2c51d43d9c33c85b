"""Megatron's learning-rate schedule (OptimizerParamScheduler) as a torch LRScheduler.

Step n counts optimizer steps taken; the lr used by step n is ``lr_at_step(n)``, so step 0 of a
warmup runs at ``lr_warmup_init`` exactly as in Megatron.
"""
from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from megatron_lite.core.optim.config import OptimizerConfig


def lr_at_step(n: int, cfg: OptimizerConfig, decay_iters: int) -> float:
    """The learning rate at optimizer step ``n`` (../shared/DESIGN.md section 3)."""
    max_lr, min_lr, warmup = cfg.lr, cfg.min_lr, cfg.lr_warmup_iters
    if warmup > 0 and n <= warmup:
        return cfg.lr_warmup_init + (max_lr - cfg.lr_warmup_init) * n / warmup
    if cfg.lr_decay_style == "constant":
        return max_lr
    if n > decay_iters:
        return min_lr
    if cfg.lr_decay_style == "inverse-square-root":
        warmup = max(warmup, 1)
        return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(max(n, 1)))
    ratio = (n - warmup) / (decay_iters - warmup)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif cfg.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD: stable at max, then anneal over the last lr_wsd_decay_iters steps
        anneal_start = decay_iters - cfg.lr_wsd_decay_iters
        if n <= anneal_start:
            coeff = 1.0
        else:
            r = (n - anneal_start) / cfg.lr_wsd_decay_iters
            style = cfg.lr_wsd_decay_style
            if style == "linear":
                coeff = 1.0 - r
            elif style == "cosine":
                coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
            elif style == "exponential":
                coeff = 2.0 * math.pow(0.5, r) - 1.0
            else:  # minus_sqrt
                coeff = 1.0 - math.sqrt(r)
    return min_lr + coeff * (max_lr - min_lr)


class MegatronLRScheduler(LRScheduler):
    """Sets every param group's lr to ``lr_at_step(n) * group['lr_mult']``."""

    def __init__(self, optimizer: Optimizer, config: OptimizerConfig, decay_iters: int, last_epoch: int = -1):
        config.check_decay(decay_iters)
        self.config, self.decay_iters = config, decay_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        lr = lr_at_step(self.last_epoch, self.config, self.decay_iters)
        return [lr * group.get("lr_mult", 1.0) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        # The config is rebuilt from the module's hyperparameters; save only the counters.
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count, "decay_iters": self.decay_iters,
                "_last_lr": self._last_lr}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = state_dict["last_epoch"]
        self._step_count = state_dict["_step_count"]
        self.decay_iters = state_dict.get("decay_iters", self.decay_iters)
        self._last_lr = state_dict.get("_last_lr", self._last_lr)
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
