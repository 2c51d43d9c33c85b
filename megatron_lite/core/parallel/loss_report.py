"""Named metrics that an objective's loss reports beside its value (the shape of Megatron's ``loss_func``).

A loss returns ``(sum, count)`` or ``(sum, count, report)``. ``report`` maps a metric's name to its
``[sum, count]`` over the microbatch, e.g. ``{"accuracy": report_entry(correct.sum(), pairs)}``. The engine
sums each entry over the step's microbatches (float64, on the device, no host sync), over the pipeline
(only the last stage holds them) and over DP x CP, in the same all-reduce per group as the loss and its
count, and returns the global sums in ``StepLoss.report``. A metric's value is its global sum over its global
count (:func:`report_means`), the same on every rank; ``GPTModule`` logs it as ``train/<name>``, and in
evaluation as ``val/<name>`` (``test/<name>``) weighted over the epoch by its count.

Every rank of a step's reductions needs the same names, and pipeline stages that compute no loss never see
them: :class:`ReportNames` learns them at an engine's first step (training and forward-only steps apart) with
one object gather per group. Later steps may leave a learnt name out (it counts zero) but not add one.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

LossReport = dict[str, torch.Tensor]
"""Metric name -> ``[sum, count]`` (a 2-element tensor)."""

REDUCTION_GROUPS = ("pp", "dp_cp")
"""The groups a step's loss totals and report are summed over, in this order."""


def device_scalar(value: Any, device: torch.device) -> torch.Tensor:
    """``value`` (a number or a one-element tensor) as a detached 0-d float64 tensor on ``device``. A Python number
    is filled in on the device: made on the host and copied, it would cost a blocking copy (a GPU sync) per call."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)


def report_entry(total: Any, count: Any) -> torch.Tensor:
    """One report value: ``[total, count]`` as a detached float64 tensor (the metric is ``total / count``), on the
    device of whichever is a tensor (the host if neither is)."""
    device = next((v.device for v in (total, count) if isinstance(v, torch.Tensor)), torch.device("cpu"))
    return torch.stack([device_scalar(total, device), device_scalar(count, device)])


def split_loss(returned: Any) -> tuple[torch.Tensor, torch.Tensor, Mapping[str, Any]]:
    """A loss's ``(sum, count)`` or ``(sum, count, report)`` as ``(sum, count, report)`` (``{}`` without one)."""
    if not isinstance(returned, (tuple, list)) or len(returned) not in (2, 3):
        raise TypeError(
            f"a loss returns (sum, count) or (sum, count, report), got {type(returned).__name__}"
            + (f" of length {len(returned)}" if isinstance(returned, (tuple, list)) else "")
        )
    report = returned[2] if len(returned) == 3 and returned[2] is not None else {}
    if not isinstance(report, Mapping):
        raise TypeError(f"a loss's report is a dict of name -> [sum, count], got {type(report).__name__}")
    return returned[0], returned[1], report


def with_report(returned: Any, **entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, LossReport]:
    """``returned`` (a wrapped loss's result) with ``entries`` added to its report: how an objective
    extension reports metrics of its own beside those of the loss it wraps."""
    total, count, report = split_loss(returned)
    clash = sorted(set(report) & set(entries))
    if clash:
        raise ValueError(f"the report already holds {clash}: an extension must report its metrics under new names")
    return total, count, {**report, **entries}


def _as_entry(name: str, value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return report_entry(*value).to(device)
    if isinstance(value, torch.Tensor) and value.numel() == 2:
        return value.detach().reshape(2).to(device=device, dtype=torch.float64)
    raise TypeError(
        f"report entry {name!r} must be its [sum, count] (a 2-element tensor, e.g. "
        f"report_entry(sum, count)), got {value!r}"
    )


class ReportSums:
    """A step's report entries summed over its microbatches (float64 on ``device``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, report: Mapping[str, Any]) -> None:
        for name, value in report.items():
            entry = _as_entry(name, value, self.device)
            self.sums[name] = entry if name not in self.sums else self.sums[name] + entry

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.sums))

    def stacked(self, names: Sequence[str]) -> torch.Tensor:
        """``[sum, count]`` of every one of ``names``, flattened (zeros for a name not reported this step)."""
        zeros = torch.zeros(2, dtype=torch.float64, device=self.device)
        return torch.cat([self.sums.get(name, zeros) for name in names]) if names else zeros[:0]


def report_means(report: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each metric's ``sum / count`` (float32; 0 where nothing was counted)."""
    return {name: (value[0] / value[1].clamp(min=1.0)).to(torch.float32) for name, value in report.items()}


def add_reports(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> LossReport:
    """Two reports' sums and counts added name by name (e.g. over several optimizer steps)."""
    return {
        name: a[name] + b[name] if name in a and name in b else (a[name] if name in a else b[name])
        for name in sorted(set(a) | set(b))
    }


class ReportNames:
    """The report names that every rank of a step's reductions agrees on, learnt once per kind of step."""

    def __init__(self) -> None:
        self._known: dict[bool, tuple[str, ...]] = {}

    def agree(self, local: Optional[Sequence[str]], layout: Any, forward_only: bool) -> tuple[str, ...]:
        """The names to reduce. ``local``: the names this rank's loss reported (None on a stage without a loss).
        The first call per ``forward_only`` gathers every rank's names (collective); later ones are local."""
        known = self._known.get(forward_only)
        if known is None:
            names = set(local or ())
            for name in REDUCTION_GROUPS:
                group = layout.group(name)
                if group is not None and dist.get_world_size(group) > 1:
                    gathered: list = [None] * dist.get_world_size(group)
                    dist.all_gather_object(gathered, sorted(names), group=group)
                    names = set().union(*gathered)
            known = self._known[forward_only] = tuple(sorted(names))
        new = sorted(set(local or ()) - set(known))
        if new:
            raise ValueError(
                f"the loss reported {new}, which it did not report at the first "
                f"{'forward-only ' if forward_only else ''}step ({list(known)}): the pipeline stages "
                f"learn the report's names once, so report every name at every step (with a zero "
                f"count when there is nothing to count)"
            )
        return known
