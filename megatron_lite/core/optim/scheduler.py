"""Megatron's learning-rate and weight-decay schedules (OptimizerParamScheduler) as a torch LRScheduler.

The schedule position ``n`` counts optimizer steps taken (``*_iters`` configs) or samples consumed
(``*_samples`` configs). The values used by the step at position ``n`` are ``lr_at(n)`` and
``weight_decay_at(n)``, so step 0 of a warmup runs at ``lr_warmup_init`` exactly as in Megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from megatron_lite.core.optim.config import OptimizerConfig


@dataclass(frozen=True)
class ScheduleLengths:
    """Lengths of one run's schedules, all in the config's unit (optimizer steps or samples)."""

    warmup: float
    """LR warmup length (a float when it comes from lr_warmup_fraction)."""
    decay: Optional[int]
    """Position at which the LR decay reaches min_lr; None only for a constant LR without a known run length."""
    wsd_decay: Optional[int]
    """WSD anneal length; None for other styles."""
    weight_decay_incr: Optional[int]
    """Length of the weight-decay schedule; None only for a constant weight decay without a known run length."""


def schedule_lengths(cfg: OptimizerConfig, max_steps: Optional[int]) -> ScheduleLengths:
    """Resolve and validate the schedule lengths for a run of ``max_steps`` optimizer steps (None or < 0: unknown).

    Iteration configs decay over ``lr_decay_iters`` (default ``max_steps``) and move weight decay over
    ``max_steps`` (default: the decay length), as Megatron with ``train_iters``. Sample configs use
    ``lr_decay_samples`` for both: Megatron's default for both is ``train_samples``, which a
    Lightning run does not have.
    """
    run_length = max_steps if max_steps is not None and max_steps >= 0 else None
    decay: Optional[int]
    incr: Optional[int]
    if cfg.sample_based:
        if cfg.lr_decay_samples is None:
            raise ValueError(
                "a sample-based schedule needs lr_decay_samples (the consumed samples at which the decay ends); set it."
            )
        decay = incr = cfg.lr_decay_samples
    else:
        decay = cfg.lr_decay_iters if cfg.lr_decay_iters is not None else run_length
        incr = run_length if run_length is not None else decay
    if decay is None and (cfg.lr_decay_style != "constant" or cfg.lr_warmup_fraction is not None):
        what = f"lr_decay_style={cfg.lr_decay_style!r}" if cfg.lr_decay_style != "constant" else "lr_warmup_fraction"
        raise ValueError(f"{what} needs a decay length: set optimizer.lr_decay_iters or Trainer(max_steps=...).")
    if incr is None and cfg.weight_decay_incr_style != "constant":
        raise ValueError(
            f"weight_decay_incr_style={cfg.weight_decay_incr_style!r} needs the run length: set "
            f"Trainer(max_steps=...) or optimizer.lr_decay_iters."
        )
    if decay is not None:
        cfg.check_decay(decay)
    wsd = cfg.lr_wsd_decay_length if cfg.lr_decay_style == "WSD" else None
    return ScheduleLengths(warmup=cfg.lr_warmup_length(decay), decay=decay, wsd_decay=wsd, weight_decay_incr=incr)


def lr_at(
    n: float,
    cfg: OptimizerConfig,
    decay_steps: Optional[int],
    warmup_steps: float,
    wsd_decay_steps: Optional[int] = None,
) -> float:
    """The learning rate at schedule position ``n`` (Megatron's get_lr; ../shared/DESIGN.md section 3)."""
    max_lr, min_lr = cfg.lr, cfg.min_lr
    if warmup_steps > 0 and n <= warmup_steps:
        return cfg.lr_warmup_init + (max_lr - cfg.lr_warmup_init) * n / warmup_steps
    if cfg.lr_decay_style == "constant":
        return max_lr
    if decay_steps is None:
        raise ValueError(f"lr_decay_style={cfg.lr_decay_style!r} needs decay_steps")
    if n > decay_steps:
        return min_lr
    if cfg.lr_decay_style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup_steps, 1)) / math.sqrt(max(n, 1)))
    ratio = (n - warmup_steps) / (decay_steps - warmup_steps)
    if cfg.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif cfg.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD: stable at max, then anneal over the last wsd_decay_steps
        if wsd_decay_steps is None:
            raise ValueError("lr_decay_style='WSD' needs wsd_decay_steps")
        anneal_start = decay_steps - wsd_decay_steps
        if n <= anneal_start:
            coeff = 1.0
        else:
            r = (n - anneal_start) / wsd_decay_steps
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


def lr_at_step(n: int, cfg: OptimizerConfig, decay_iters: int) -> float:
    """The learning rate after ``n`` optimizer steps of an iteration-based config decaying over ``decay_iters``."""
    return lr_at(n, cfg, decay_iters, cfg.lr_warmup_length(decay_iters), cfg.lr_wsd_decay_iters)


def weight_decay_at(n: float, cfg: OptimizerConfig, incr_steps: Optional[int]) -> float:
    """The weight decay at schedule position ``n`` (Megatron's get_wd)."""
    start, end = cfg.weight_decay_range()
    if cfg.weight_decay_incr_style == "constant":
        return end
    if incr_steps is None:
        raise ValueError(f"weight_decay_incr_style={cfg.weight_decay_incr_style!r} needs incr_steps")
    if n > incr_steps:
        return end
    ratio = n / incr_steps
    if cfg.weight_decay_incr_style == "linear":
        coeff = ratio
    else:  # cosine: slow at both ends, from start to end
        coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
    return start + coeff * (end - start)


class MegatronLRScheduler(LRScheduler):
    """Sets every param group's ``lr`` to ``lr_at(n) * group['lr_mult']`` and its ``weight_decay`` to
    ``weight_decay_at(n) * group['wd_mult']`` (both multipliers default to 1).

    Iteration configs: ``step()`` advances one optimizer step. Sample configs: ``step(increment=k)``
    advances by the ``k`` samples the step consumed (the global batch size, which may ramp up).
    """

    def __init__(self, optimizer: Optimizer, config: OptimizerConfig, max_steps: Optional[int] = None):
        self.config = config
        self.lengths = schedule_lengths(config, max_steps)
        self.num_steps = 0  # schedule position: optimizer steps taken, or samples consumed (sample configs)
        # torch's constructor takes one initial step() with no increment: it must apply position 0.
        self._applying_initial_values = True
        super().__init__(optimizer)
        self._applying_initial_values = False

    @property
    def current_lr(self) -> float:
        """The learning rate at the current position, before any group's lr_mult."""
        lengths = self.lengths
        return lr_at(self.num_steps, self.config, lengths.decay, lengths.warmup, lengths.wsd_decay)

    @property
    def current_weight_decay(self) -> float:
        """The weight decay at the current position, before any group's wd_mult."""
        return weight_decay_at(self.num_steps, self.config, self.lengths.weight_decay_incr)

    def get_lr(self) -> list[float | torch.Tensor]:  # LRScheduler's type; ours are always floats
        lr = self.current_lr
        return [lr * group.get("lr_mult", 1.0) for group in self.optimizer.param_groups]

    def step(self, increment: Optional[int] = None) -> None:
        """Advance the schedule (after ``optimizer.step()``) and set every group's lr and weight decay."""
        if self._applying_initial_values:
            increment = 0
        elif self.config.sample_based:
            if increment is None:
                raise ValueError(
                    "this schedule is counted in samples (lr_*_samples): call "
                    "scheduler.step(increment=<samples consumed by this step>)"
                )
            if isinstance(increment, bool) or not isinstance(increment, int) or increment < 0:
                raise ValueError(f"increment must be a non-negative number of samples, got {increment!r}")
        else:
            if increment is not None:
                raise ValueError(
                    f"this schedule is counted in optimizer steps (lr_*_iters), so step() advances one "
                    f"step; drop increment={increment!r}, or use lr_*_samples fields to count samples."
                )
            increment = 1
        self.num_steps += increment
        self._step_count += 1
        self.last_epoch += 1
        self._apply()

    def _apply(self) -> None:
        weight_decay = self.current_weight_decay
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        self._last_lr = lrs

    def state_dict(self) -> dict:
        # Counters only: the config and lengths are rebuilt from the module's hyperparameters.
        return {
            "num_steps": self.num_steps,
            "unit": self.config.schedule_unit,
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        unit = state_dict.get("unit", "iters")  # checkpoints from before sample-based schedules counted steps
        if unit != self.config.schedule_unit:
            raise ValueError(
                f"the checkpoint's schedule is counted in {unit} but this config counts in "
                f"{self.config.schedule_unit}; resume with lr_*_{unit} fields."
            )
        self.num_steps = state_dict.get("num_steps", state_dict["last_epoch"])
        self.last_epoch = state_dict["last_epoch"]
        self._step_count = state_dict["_step_count"]
        self._apply()
