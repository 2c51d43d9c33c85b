"""OptimizerConfig with Megatron's argument names."""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import MISSING, dataclass, fields
from typing import Literal, Optional

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


@dataclass
class OptimizerConfig:
    """Optimizer, LR / weight-decay schedules, parameter groups, loss scaling and clipping (Megatron names).

    Schedule lengths are counted either in optimizer steps (the ``*_iters`` fields) or in consumed
    samples (the ``*_samples`` fields, for batch-size ramp-up); one config uses one unit only.
    """

    optimizer: Literal["adam", "sgd"] = "adam"
    """'adam' (AdamW: decoupled weight decay, as Megatron) or 'sgd'."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Optimizer steps of linear warmup from lr_warmup_init to lr."""
    lr_warmup_samples: int = 0
    """Sample-based schedules: samples of linear warmup from lr_warmup_init to lr."""
    lr_warmup_fraction: Optional[float] = None
    """Warmup length as a fraction of the decay length (instead of lr_warmup_iters/lr_warmup_samples)."""
    lr_warmup_init: float = 0.0
    """Learning rate at step 0 of the warmup."""
    lr_decay_iters: Optional[int] = None
    """Step at which the decay reaches min_lr; None means the Trainer's max_steps."""
    lr_decay_samples: Optional[int] = None
    """Sample-based schedules: consumed samples at which the decay reaches min_lr (required there)."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "cosine"
    """Shape of the decay after warmup."""
    lr_wsd_decay_iters: Optional[int] = None
    """WSD only: length of the final anneal phase in steps."""
    lr_wsd_decay_samples: Optional[int] = None
    """WSD with a sample-based schedule: length of the final anneal phase in samples."""
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"
    """WSD only: shape of the anneal."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to biases and 1-D weights such as norms)."""
    start_weight_decay: Optional[float] = None
    """Weight decay at step 0 of the weight-decay schedule; None means weight_decay."""
    end_weight_decay: Optional[float] = None
    """Weight decay at the end of the run (and after it); None means weight_decay."""
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay moves from start_weight_decay to end_weight_decay over the run."""
    lr_mult: float = 1.0
    """Learning-rate multiplier for the parameters matching scale_lr_params (Megatron's lr_mult)."""
    scale_lr_params: tuple[str, ...] = ()
    """fnmatch patterns over parameter names whose lr is multiplied by lr_mult, e.g. ('*output_layer*',)."""
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
    use_distributed_optimizer: bool = False
    """Shard fp32 master weights and optimizer state over data-parallel ranks (ZeRO-1)."""
    loss_scale: Optional[float] = None
    """fp16 only: a static loss scale; None means dynamic loss scaling."""
    initial_loss_scale: float = 2.0**32
    """fp16 dynamic loss scaling: the starting scale."""
    min_loss_scale: float = 1.0
    """fp16 dynamic loss scaling: the scale never drops below this."""
    loss_scale_window: int = 1000
    """fp16 dynamic loss scaling: steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """fp16 dynamic loss scaling: overflowing steps tolerated before the scale halves."""
    check_for_nan_in_grad: bool = True
    """Stop with an error when the gradient norm is NaN/Inf and no fp16 loss scaler skips the step."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every check of the config; ``__post_init__`` runs it, and MegatronStrategy again before it
        launches (a field may have been changed after construction). Each failure is a ValueError whose
        message names the fix."""
        self._check_finite()
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
        if self.lr_warmup_init < 0:
            raise ValueError(f"lr_warmup_init must be >= 0, got {self.lr_warmup_init}")
        self._check_schedule_units()
        if self.lr_decay_length is not None:
            self.check_decay(self.lr_decay_length)
        self._check_weight_decay()
        self._check_lr_scaling()
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        self._check_loss_scaling()
        self._check_optimizer_constants()

    def _check_finite(self) -> None:
        # NaN passes every `<`/`>` comparison below (all are False), and NaN or inf would only surface
        # after launch, from torch or as a NaN gradient norm: refuse them first, for every numeric field.
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isfinite(value):
                default = "" if f.default is MISSING else f" (the default is {f.default!r})"
                raise ValueError(
                    f"OptimizerConfig({f.name}={value}): {f.name} must be a finite number; "
                    f"pass a finite {f.name}{default}."
                )

    def _check_optimizer_constants(self) -> None:
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(
                    f"{name} must be in [0, 1), got {getattr(self, name)}; e.g. adam_beta1=0.9, "
                    f"adam_beta2=0.95 or 0.999."
                )
        if self.adam_eps <= 0:
            # Parameters whose gradient is always 0 (padded vocabulary rows) would become 0/0 = NaN.
            raise ValueError(f"adam_eps must be positive, got {self.adam_eps}; e.g. adam_eps=1e-8.")
        if self.sgd_momentum < 0:
            raise ValueError(f"sgd_momentum must be >= 0 (0 disables momentum), got {self.sgd_momentum}")

    # --- schedule units ---------------------------------------------------------------------
    @property
    def sample_based(self) -> bool:
        """True when the schedule is counted in consumed samples (any ``*_samples`` field is set)."""
        return bool(self._sample_fields_set())

    @property
    def schedule_unit(self) -> str:
        """'samples' or 'iters': the suffix of the schedule fields in use (and of their error messages)."""
        return "samples" if self.sample_based else "iters"

    @property
    def lr_decay_length(self) -> Optional[int]:
        """lr_decay_samples or lr_decay_iters, whichever unit the schedule uses (None: not set)."""
        return self.lr_decay_samples if self.sample_based else self.lr_decay_iters

    @property
    def lr_wsd_decay_length(self) -> Optional[int]:
        """lr_wsd_decay_samples or lr_wsd_decay_iters, whichever unit the schedule uses."""
        return self.lr_wsd_decay_samples if self.sample_based else self.lr_wsd_decay_iters

    def lr_warmup_length(self, decay_length: Optional[int]) -> float:
        """Warmup length in the schedule's unit; with lr_warmup_fraction it is a fraction of ``decay_length``."""
        if self.lr_warmup_fraction is None:
            return self.lr_warmup_samples if self.sample_based else self.lr_warmup_iters
        if decay_length is None:
            raise ValueError(
                f"lr_warmup_fraction needs a decay length: set lr_decay_{self.schedule_unit}"
                f"{' or Trainer(max_steps=...)' if not self.sample_based else ''}."
            )
        return self.lr_warmup_fraction * decay_length

    def weight_decay_range(self) -> tuple[float, float]:
        """(start, end) of the weight-decay schedule; unset ends default to weight_decay (as Megatron)."""
        start = self.weight_decay if self.start_weight_decay is None else self.start_weight_decay
        end = self.weight_decay if self.end_weight_decay is None else self.end_weight_decay
        return start, end

    def _iteration_fields_set(self) -> list[str]:
        return [
            name
            for name, is_set in (
                ("lr_warmup_iters", self.lr_warmup_iters != 0),
                ("lr_decay_iters", self.lr_decay_iters is not None),
                ("lr_wsd_decay_iters", self.lr_wsd_decay_iters is not None),
            )
            if is_set
        ]

    def _sample_fields_set(self) -> list[str]:
        return [
            name
            for name, is_set in (
                ("lr_warmup_samples", self.lr_warmup_samples != 0),
                ("lr_decay_samples", self.lr_decay_samples is not None),
                ("lr_wsd_decay_samples", self.lr_wsd_decay_samples is not None),
            )
            if is_set
        ]

    def _check_schedule_units(self) -> None:
        iteration_fields, sample_fields = self._iteration_fields_set(), self._sample_fields_set()
        if iteration_fields and sample_fields:
            raise ValueError(
                f"OptimizerConfig mixes iteration-based fields ({', '.join(iteration_fields)}) and sample-based "
                f"fields ({', '.join(sample_fields)}); remove {', '.join(iteration_fields)} for a schedule counted "
                f"in samples, or {', '.join(sample_fields)} for one counted in optimizer steps."
            )
        for name in ("lr_warmup_iters", "lr_warmup_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters", "lr_wsd_decay_samples"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}; or leave it unset.")
        if self.lr_warmup_fraction is not None:
            if not 0.0 <= self.lr_warmup_fraction < 1.0:
                raise ValueError(f"lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction}")
            explicit = [name for name in ("lr_warmup_iters", "lr_warmup_samples") if getattr(self, name) != 0]
            if explicit:
                raise ValueError(
                    f"lr_warmup_fraction and {explicit[0]} both set the warmup; remove one of them "
                    f"({explicit[0]}=0 or lr_warmup_fraction=None)."
                )
        if self.sample_based and self.lr_decay_samples is None:
            raise ValueError(
                f"a sample-based schedule ({', '.join(sample_fields)}) needs lr_decay_samples (the consumed "
                f"samples at which the decay ends); set it."
            )

    def check_decay(self, decay_length: int) -> None:
        """Validate the LR schedule against the decay length it will run with (in the schedule's unit)."""
        if self.lr_decay_style == "constant":
            return
        unit = self.schedule_unit
        if decay_length <= 0:
            hint = "set it" if self.sample_based else "set it or Trainer(max_steps=...)"
            raise ValueError(f"lr_decay_{unit} must be positive, got {decay_length}; {hint}")
        warmup = self.lr_warmup_length(decay_length)
        if warmup >= decay_length and self.lr_decay_style != "inverse-square-root":
            raise ValueError(
                f"lr_warmup_{unit} ({warmup}) must be smaller than lr_decay_{unit} ({decay_length}); "
                f"shorten the warmup or lengthen the decay."
            )
        if self.lr_decay_style == "WSD":
            wsd = self.lr_wsd_decay_length
            if wsd is None:
                raise ValueError(f"lr_decay_style='WSD' needs lr_wsd_decay_{unit} (the anneal length in {unit})")
            if wsd > decay_length - warmup:
                raise ValueError(
                    f"lr_wsd_decay_{unit} ({wsd}) is longer than the decay phase "
                    f"({decay_length - warmup} {unit} after the warmup); shorten it."
                )
        if self.lr_decay_style == "inverse-square-root" and warmup == 0:
            warnings.warn("inverse-square-root decay without warmup starts at lr and decays from step 1", stacklevel=2)

    # --- weight decay and parameter groups --------------------------------------------------
    def _check_weight_decay(self) -> None:
        if self.weight_decay_incr_style not in WD_INCR_STYLES:
            raise ValueError(
                f"weight_decay_incr_style must be one of {WD_INCR_STYLES}, got {self.weight_decay_incr_style!r}"
            )
        for name in ("weight_decay", "start_weight_decay", "end_weight_decay"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        start, end = self.weight_decay_range()
        if self.weight_decay_incr_style == "constant" and start != end:
            raise ValueError(
                f"weight_decay_incr_style='constant' needs start_weight_decay == end_weight_decay (got {start} and "
                f"{end}); set weight_decay_incr_style='linear' or 'cosine' to move between them, or set weight_decay "
                f"alone."
            )

    def _check_lr_scaling(self) -> None:
        if isinstance(self.scale_lr_params, str):
            raise TypeError(
                f"scale_lr_params must be a list of patterns, got the string {self.scale_lr_params!r}; "
                f"write [{self.scale_lr_params!r}]."
            )
        # A tuple: configs are copied with dataclasses.replace, which must not share a mutable list.
        self.scale_lr_params = tuple(self.scale_lr_params)
        if not all(isinstance(p, str) and p for p in self.scale_lr_params):
            raise ValueError(f"scale_lr_params must be non-empty fnmatch patterns, got {self.scale_lr_params!r}")
        if self.lr_mult <= 0:
            raise ValueError(
                f"lr_mult must be positive, got {self.lr_mult}; freeze parameters with requires_grad=False instead."
            )
        if self.lr_mult != 1.0 and not self.scale_lr_params:
            raise ValueError(
                f"lr_mult={self.lr_mult} applies only to parameters matching scale_lr_params, which is "
                f"empty; set scale_lr_params (e.g. ['*output_layer*']) or change lr instead."
            )

    # --- fp16 loss scaling ------------------------------------------------------------------
    def _check_loss_scaling(self) -> None:
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"loss_scale must be positive (or None for dynamic scaling), got {self.loss_scale}")
        for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"min_loss_scale ({self.min_loss_scale}) must be <= initial_loss_scale "
                f"({self.initial_loss_scale}); lower min_loss_scale."
            )
