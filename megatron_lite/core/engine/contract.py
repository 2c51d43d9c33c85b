"""The contract between a LightningModule that trains through the engine and MegatronStrategy.

Written as a ``typing.Protocol`` so that the strategy checks it once (``isinstance``) and then reads
plain attributes, instead of probing a module with ``getattr`` look-ups. A LightningModule that does
not satisfy it still runs under the strategy (``examples/own_lightning_module.py``): it just gets no
model-aware validation, estimate or optimizer checkpointing. A module's own checks before launch are the
strategy's pre-launch protocol (``check_before_launch``), which any module may implement.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from megatron_lite.core.optim.optimizer import MegatronOptimizer
from megatron_lite.core.timers import Timers


@runtime_checkable
class EngineModule(Protocol):
    """What MegatronStrategy reads from a module (GPTModule, RewardModelModule, ...)."""

    config: Any
    """The model config: ``validate_parallelism(...)``, ``num_layers`` and the shape for estimates."""
    optimizer_config: Any
    """The :class:`OptimizerConfig` (re-validated before launch; ZeRO-1 and overlap checks)."""
    megatron_optimizer: Optional[MegatronOptimizer]
    """The core optimizer (fp32 masters, ZeRO-1, loss scaler) whose state checkpoints save in the place of the
    first optimizer's (:class:`~megatron_lite.core.checkpoint.Checkpointer`)."""

    def run_timers(self) -> Optional[Timers]:
        """The run's Megatron timers, if a callback keeps them."""
        ...
