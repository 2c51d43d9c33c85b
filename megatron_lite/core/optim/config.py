"""OptimizerConfig with Megatron's argument names."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Optional

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule and clipping (Megatron names; steps are optimizer steps)."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """'adam' (AdamW: decoupled weight decay, as Megatron) or 'sgd'."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Steps of linear warmup from lr_warmup_init to lr."""
    lr_warmup_init: float = 0.0
    """Learning rate at step 0 of the warmup."""
    lr_decay_iters: Optional[int] = None
    """Step at which the decay reaches min_lr; None means the Trainer's max_steps."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "cosine"
    """Shape of the decay after warmup."""
    lr_wsd_decay_iters: Optional[int] = None
    """WSD only: length of the final anneal phase in steps."""
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"
    """WSD only: shape of the anneal."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and norm weights)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {LR_DECAY_STYLES}, got {self.lr_decay_style!r}")
        if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"lr_wsd_decay_style must be one of {WSD_DECAY_STYLES}, got {self.lr_wsd_decay_style!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be between 0 and lr ({self.lr}); lower min_lr.")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_decay_iters is not None:
            self.check_decay(self.lr_decay_iters)
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")

    def check_decay(self, decay_iters: int) -> None:
        """Validate the schedule against the number of decay steps it will run with."""
        if self.lr_decay_style in ("constant",):
            return
        if decay_iters <= 0:
            raise ValueError(f"lr_decay_iters must be positive, got {decay_iters}; set it or Trainer(max_steps=...)")
        if self.lr_warmup_iters >= decay_iters and self.lr_decay_style != "inverse-square-root":
            raise ValueError(
                f"lr_warmup_iters ({self.lr_warmup_iters}) must be smaller than lr_decay_iters ({decay_iters}); "
                f"shorten the warmup or lengthen the decay.")
        if self.lr_decay_style == "WSD":
            if self.lr_wsd_decay_iters is None:
                raise ValueError("lr_decay_style='WSD' needs lr_wsd_decay_iters (the anneal length in steps)")
            if self.lr_wsd_decay_iters > decay_iters - self.lr_warmup_iters:
                raise ValueError(
                    f"lr_wsd_decay_iters ({self.lr_wsd_decay_iters}) is longer than the decay phase "
                    f"({decay_iters - self.lr_warmup_iters} steps); shorten it.")
        if self.lr_decay_style == "inverse-square-root" and self.lr_warmup_iters == 0:
            warnings.warn("inverse-square-root decay without warmup starts at lr and decays from step 1")
