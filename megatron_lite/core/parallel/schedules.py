"""Forward/backward over the microbatches of one optimizer step.

The loss of a step is the mean per-token loss over the *global* batch, whatever the layout
(Megatron's per-token loss): each microbatch's *summed* loss is back-propagated, the token counts
that the loss function returns are summed on the device and over DP ranks once per step, and the
gradients are divided by that total, so summing gradients over microbatches and DP ranks gives
exactly the gradient of the global mean, whatever mask a custom loss function applies. A loss may
also return a report of named metrics, reduced in the same collective (``loss_report``). A pipeline
schedule (``megatron_lite.core.engine``) produces the same :class:`StepLoss`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.loss_report import (
    REDUCTION_GROUPS,
    ReportNames,
    ReportSums,
    device_scalar,
    report_means,
    split_loss,
)

# (model, microbatch) -> (sum of per-token losses, number of loss tokens[, report of named [sum, count]])
LossFn = Callable[[nn.Module, dict], tuple]


@dataclass
class StepLoss:
    """Loss of one step, already averaged over the global batch (the same value on every rank)."""

    loss: torch.Tensor
    """Mean per-token loss over the global batch."""
    num_tokens: torch.Tensor
    """Loss tokens in the global batch."""
    grad_scale: torch.Tensor
    """Factor that turns the accumulated gradients into those of the global-batch mean loss (times
    the loss scale, if any); already applied unless the schedule ran with ``scale_grads=False``."""
    report: dict[str, torch.Tensor] = field(default_factory=dict)
    """The global ``[sum, count]`` (float64) of every metric the loss reported, the same on every rank."""

    def report_means(self) -> dict[str, torch.Tensor]:
        """Every reported metric's global mean (sum / count, float32)."""
        return report_means(self.report)


def split_microbatches(batch: dict, micro_batch_size: int) -> list[dict]:
    """Cut one step's batch (every tensor has the sample dim first) into microbatches."""
    size = next(iter(batch.values())).shape[0]
    if size % micro_batch_size != 0:
        raise ValueError(
            f"this rank's batch of {size} samples is not a whole number of microbatches of "
            f"micro_batch_size={micro_batch_size}; the dataloader's batch must be global_batch_size / dp"
        )
    return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, size, micro_batch_size)]


def gpt_forward_step(
    part, microbatch: dict, hidden_states: Optional[torch.Tensor] = None, with_mtp: bool = True
) -> torch.Tensor:
    """One stage's forward of a ``{"tokens": [b, s+1], ...}`` microbatch: the per-token loss [b, s] on
    the last stage, the activations for the next stage elsewhere. ``part`` is a GPTModel (one stage)
    or one of its ``chunks``; packed samples also carry ``position_ids`` [b, s] and ``cu_seqlens`` [b, k].
    A microbatch that carries ``labels`` is already split into inputs and labels (a context-parallel
    rank's share: ``tokens`` are then the inputs [b, s/C]). ``with_mtp=False``: a model's multi-token
    prediction loss is left out (it is part of next-token objectives only)."""
    tokens = microbatch["tokens"]
    if "labels" in microbatch:
        inputs, labels = tokens, microbatch["labels"]
    else:
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if not getattr(part, "post_process", True):
        labels = None
    kwargs = dict(position_ids=microbatch.get("position_ids"), cu_seqlens=microbatch.get("cu_seqlens"))
    if labels is not None and getattr(part, "mtp", None) is not None:
        if with_mtp:
            kwargs["loss_mask"] = microbatch.get("loss_mask")  # the MTP loss is masked like the main one
        else:
            kwargs["with_mtp"] = False
    if hidden_states is not None:
        kwargs["hidden_states"] = hidden_states
    return part(inputs, labels, **kwargs)


def masked_token_loss(per_token: torch.Tensor, microbatch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the per-token losses where ``loss_mask`` is set, number of such tokens)."""
    mask = microbatch.get("loss_mask")
    if mask is None:
        return per_token.sum(), torch.full((), float(per_token.numel()), device=per_token.device)
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum(), mask.sum()


def gpt_loss(model: nn.Module, microbatch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of a ``{"tokens": [b, s+1], "loss_mask"?: [b, s]}`` microbatch through the whole
    model; packed samples also carry ``position_ids`` [b, s] and ``cu_seqlens`` [b, k]."""
    return masked_token_loss(gpt_forward_step(model, microbatch), microbatch)


def forward_backward_no_pipelining(
    model: nn.Module,
    microbatches: Sequence[dict],
    layout: ParallelLayout,
    loss_fn: LossFn = gpt_loss,
    forward_only: bool = False,
    device: Optional[torch.device] = None,
    loss_scale: Optional[float] = None,
    scale_grads: bool = True,
    no_sync: Optional[Callable[[], ContextManager]] = None,
    report_names: Optional[ReportNames] = None,
) -> StepLoss:
    """Run every microbatch forward (and backward unless ``forward_only``), accumulating gradients.

    On return the gradients are this rank's share of the gradient of the global-batch mean loss
    (they expect to start from zero); :func:`finalize_model_grads` sums them over DP. With
    ``loss_scale`` (fp16) the backward runs on ``loss x loss_scale / tokens per microbatch`` so that
    half-precision gradients stay in range; with ``scale_grads=False`` the gradients are left
    unnormalised and ``StepLoss.grad_scale`` says what to multiply them by (an optimizer that
    reduces or copies gradients first applies it once, on fp32 main gradients). ``no_sync`` (Megatron's
    ``no_sync_func``) wraps the backward of every microbatch but the last, so gradient reductions
    hooked into the backward (FSDP, overlapped reduce-scatter) run once per step. ``report_names``
    agrees the report's names over the ranks (the engine's); without it they are this rank's.
    """
    device = device or next(model.parameters()).device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    num_tokens = torch.zeros((), dtype=torch.float64, device=device)
    report = ReportSums(device)
    backward_scale = backward_scale_for(loss_scale, microbatches)
    share_backward_scale(model, backward_scale)
    for index, microbatch in enumerate(microbatches):
        if forward_only:
            with torch.no_grad():
                mb_loss, mb_tokens, mb_report = split_loss(loss_fn(model, microbatch))
        else:
            last = index == len(microbatches) - 1
            with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
                mb_loss, mb_tokens, mb_report = split_loss(loss_fn(model, microbatch))
                (mb_loss * backward_scale if backward_scale != 1.0 else mb_loss).backward()
        loss_sum += mb_loss.detach().to(torch.float64)
        num_tokens += device_scalar(mb_tokens, device)
        report.add(mb_report)
    report.add(take_model_report(model))
    names = report_names.agree(report.names(), layout, forward_only) if report_names is not None else report.names()
    step = finish_step_loss(loss_sum, num_tokens, layout, loss_scale, backward_scale, report, names)
    if not forward_only and scale_grads:
        scale_model_grads(model, step.grad_scale)
    return step


def share_backward_scale(model: nn.Module, backward_scale: float) -> None:
    """Tell the model's layers the multiplier of this step's backward passes: an MoE layer back-propagates its
    auxiliary losses with it, as the loss is (fp16 loss scaling)."""
    state = getattr(model, "moe_state", None)
    if state is not None:
        state.backward_scale = backward_scale


def take_model_report(model: nn.Module) -> dict:
    """Metrics the model's layers recorded during the step's forwards (an MoE model's router losses and expert
    loads), as report entries; ``{}`` for a model that records none."""
    take = getattr(model, "take_step_report", None)
    return take() if take is not None else {}


def backward_scale_for(loss_scale: Optional[float], microbatches: Sequence[dict]) -> float:
    """The constant a microbatch's summed loss is multiplied by before its backward (fp16 only): the
    loss scale over the microbatch's size keeps the scaled loss near a per-token mean; any constant
    works, it is divided out again by the step's ``grad_scale``."""
    if loss_scale is None or not microbatches:
        return 1.0
    return loss_scale / max(1, next(iter(microbatches[0].values())).numel())


def finish_step_loss(
    loss_sum: torch.Tensor,
    num_tokens: torch.Tensor,
    layout: ParallelLayout,
    loss_scale: Optional[float],
    backward_scale: float,
    report: Optional[ReportSums] = None,
    report_names: Sequence[str] = (),
) -> StepLoss:
    """Sum this rank's loss and token totals and its report (``report_names``' ``[sum, count]``; zeros where
    ``report`` is None, a stage without a loss) over the pipeline, then over DP (and CP): one collective per
    group, no host sync. Then derive the factor that turns accumulated gradients into those of the
    global-batch mean. Off the last pipeline stage ``loss_sum`` and ``num_tokens`` are zeros."""
    names = tuple(report_names)
    parts = [loss_sum.reshape(1), num_tokens.reshape(1)]
    if names:
        parts.append((report if report is not None else ReportSums(loss_sum.device)).stacked(names))
    totals = torch.cat(parts)
    for name in REDUCTION_GROUPS:
        group = layout.group(name)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
    global_tokens = totals[1].clamp(min=1.0)  # an all-masked global batch contributes no gradient
    grad_scale = ((loss_scale or 1.0) / (global_tokens * backward_scale)).to(torch.float32)
    reduced = {name: totals[2 + 2 * i : 4 + 2 * i] for i, name in enumerate(names)}
    return StepLoss(
        loss=(totals[0] / global_tokens).to(torch.float32), num_tokens=totals[1], grad_scale=grad_scale, report=reduced
    )


def scale_model_grads(model: nn.Module, grad_scale: torch.Tensor) -> None:
    """Multiply the gradients left in ``param.grad`` by ``grad_scale`` (0-d tensor, no host sync)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, grad_scale.to(grads[0].dtype))
