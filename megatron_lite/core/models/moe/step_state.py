"""What the MoE layers of one model share during a training step: the engine's backward multiplier for their
auxiliary losses, and the metrics they record, handed to the engine's report (no global state: one per model)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from megatron_lite.core.parallel.loss_report import LossReport, report_entry


class MoEStepState:
    """Per-model scratch of the MoE layers (the engine sets ``backward_scale`` and takes the metrics)."""

    def __init__(self) -> None:
        self.backward_scale = 1.0
        """Multiplier the engine applies to each microbatch's summed loss before its backward (fp16 loss scale)."""
        self._sums: dict[str, torch.Tensor] = {}

    def record(self, name: str, value: torch.Tensor, count: Union[float, torch.Tensor] = 1.0) -> None:
        """Add ``value`` (detached, 0-d) to metric ``name`` with weight ``count`` (its mean is sum / count)."""
        entry = report_entry(value, count)
        previous: Optional[torch.Tensor] = self._sums.get(name)
        self._sums[name] = entry if previous is None else previous + entry.to(previous.device)

    def take(self) -> LossReport:
        """The metrics recorded since the last call, as report entries ``{name: [sum, count]}``; cleared."""
        sums, self._sums = self._sums, {}
        return sums


def in_recomputation() -> bool:
    """Whether this forward is an activation recomputation inside the backward pass (autograd's engine is running):
    its auxiliary losses were attached and its metrics recorded by the original forward already."""
    return torch._C._current_graph_task_id() != -1
