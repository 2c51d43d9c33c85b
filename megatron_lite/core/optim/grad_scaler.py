"""Loss scalers for fp16 training (Megatron's grad_scaler.py semantics).

The loss is multiplied by ``scale`` before the backward so that small fp16 gradients do not flush
to zero; the optimizer divides the gradients by it again. A dynamic scaler halves the scale when
a step produced inf/NaN gradients (that step is skipped) and doubles it after ``growth_interval``
clean steps. Megatron's ``hysteresis`` lets a few overflows pass before backing off: the tracker
starts at ``hysteresis``, each overflow decrements it and the scale backs off only once it reaches
zero; it is refilled only when the scale grows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScalerState:
    """What a checkpoint needs to resume the scaler exactly."""

    scale: float
    """Current loss scale."""
    growth_tracker: int
    """Clean steps since the last overflow or growth."""
    hysteresis_tracker: int
    """Overflows still tolerated before the next back-off."""


class ConstantLossScaler:
    """A fixed loss scale (Megatron's ``--loss-scale``): overflowing steps are still skipped."""

    def __init__(self, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"loss_scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """A constant scale never changes."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """Megatron's DynamicGradScaler (defaults: 2**32 initial, x2 growth every 1000 clean steps,
    x0.5 back-off, hysteresis 2, never below ``min_scale``)."""

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if not (initial_scale > 0 and min_scale > 0):
            raise ValueError(f"initial_loss_scale ({initial_scale}) and min_loss_scale ({min_scale}) must be positive")
        if min_scale > initial_scale:
            raise ValueError(f"min_loss_scale ({min_scale}) must not exceed initial_loss_scale ({initial_scale})")
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1)")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"loss_scale_window ({growth_interval}) and hysteresis ({hysteresis}) must be >= 1")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        """Back off after overflows (subject to hysteresis); grow after a window of clean steps."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return vars(LossScalerState(self.scale, self.growth_tracker, self.hysteresis_tracker)).copy()

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


LossScaler = ConstantLossScaler | DynamicLossScaler
