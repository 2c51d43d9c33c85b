"""Pipeline schedules: the order of every microbatch's forward (F) and backward (B) on each stage,
and one executor that runs any such order with point-to-point transfers between stages.

Why our own straight-line schedules rather than ``torch.distributed.pipelining``'s: every stage here
needs per-microbatch inputs besides the activations (positions, packed-sequence masks, loss masks;
pipelining passes extra inputs to the first stage only), gradients accumulate through our hooks
into fp32 ``main_grad`` buffers and ZeRO-1 buckets whose reductions must be enabled for the last
backward of each model chunk only (pipelining's ``no_sync`` handling knows DDP and FSDP), and the
loss is the per-token mean over the global batch, whose token count is only known on the last stage
after every microbatch (pipelining scales by the number of microbatches). The orders are Megatron's.

The executor posts sends asynchronously, posts the next action's receive before computing the current
one (so the transfer overlaps the compute, as Megatron's batched send/receive pairs do) and blocks on
a receive only when the data is needed; in a valid order (each of these is) every receive's send is
eventually posted, so it cannot deadlock.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Protocol, Sequence

import torch

from megatron_lite.core.parallel.loss_report import ReportSums, device_scalar, split_loss
from megatron_lite.core.parallel.pipeline.deallocate import deallocate_output
from megatron_lite.core.parallel.pipeline.p2p import PipelineP2P, PostedRecv
from megatron_lite.core.parallel.pipeline.zero_bubble import (
    dual_pipe_v_order,
    zero_bubble_h1_order,
    zero_bubble_v_order,
)
from megatron_lite.core.parallel.weight_grad import WeightGradStore

Action = tuple[str, int, int]
"""(kind, model chunk index on this rank, microbatch index). Kind "F": forward; "B": backward (the whole
backward, or under a zero-bubble schedule the input-gradient pass only); "W": the weight-gradient pass of a
backward that a "B" split (zero-bubble schedules)."""


def splits_backward(order: Sequence[Action]) -> bool:
    """Whether ``order`` runs weight-gradient passes apart from its backwards (a zero-bubble schedule)."""
    return any(kind == "W" for kind, _, _ in order)


def gpipe_order(num_microbatches: int) -> list[Action]:
    """All forwards, then all backwards (in the same order)."""
    return [("F", 0, m) for m in range(num_microbatches)] + [("B", 0, m) for m in range(num_microbatches)]


def one_f_one_b_order(num_microbatches: int, pp_size: int, pp_rank: int) -> list[Action]:
    """Megatron's 1F1B: ``P - rank - 1`` warm-up forwards, then alternate one forward and one backward,
    then the remaining backwards; at most ``P - rank`` microbatches' activations are alive."""
    warmup = min(pp_size - pp_rank - 1, num_microbatches)
    order: list[Action] = [("F", 0, m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
    order += [("B", 0, m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def interleaved_order(num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int) -> list[Action]:
    """Megatron's interleaved 1F1B over ``num_chunks`` virtual stages per rank.

    Microbatches go through the chunks in groups of ``pp_size``: virtual microbatch ``k`` is chunk
    ``(k // P) % V`` (backward: ``V - 1 -`` that) of microbatch ``(k // (P·V))·P + k % P``.
    """
    P, V, M = pp_size, num_chunks, num_microbatches
    if M % P:
        raise ValueError(
            f"the interleaved schedule needs the number of microbatches ({M}) to be a multiple of "
            f"pipeline_model_parallel_size ({P})"
        )
    total = M * V
    if M == P:
        warmup = total  # Megatron: with one group all forwards run first
    else:
        warmup = min((P - pp_rank - 1) * 2 + (V - 1) * P, total)

    def action(kind: str, k: int) -> Action:
        chunk = (k // P) % V
        if kind == "B":
            chunk = V - 1 - chunk
        return (kind, chunk, (k // (P * V)) * P + k % P)

    order = [action("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action("F", warmup + i), action("B", i)]
    order += [action("B", k) for k in range(total - warmup, total)]
    return order


def schedule_order(
    schedule: str, num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int, forward_only: bool = False
) -> list[Action]:
    """The action order of ``schedule`` on pipeline rank ``pp_rank``. Forward-only (evaluation,
    prediction) runs every microbatch through this rank's chunks in turn, for any microbatch count."""
    if forward_only:
        return [("F", chunk, m) for m in range(num_microbatches) for chunk in range(num_chunks)]
    if schedule == "gpipe":
        order = gpipe_order(num_microbatches)
    elif schedule == "1f1b":
        order = one_f_one_b_order(num_microbatches, pp_size, pp_rank)
    elif schedule == "zb1p":
        order = zero_bubble_h1_order(num_microbatches, pp_size, pp_rank)
    elif schedule == "zbv":
        order = zero_bubble_v_order(num_microbatches, pp_size, pp_rank)
    elif schedule == "dualpipev":
        order = dual_pipe_v_order(num_microbatches, pp_size, pp_rank)
    elif schedule == "interleaved_1f1b":
        order = interleaved_order(num_microbatches, pp_size, pp_rank, num_chunks)
    else:
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    return order


class VirtualStage(Protocol):
    """Where a model chunk sits in the pipeline (a :class:`~megatron_lite.core.parallel.pipeline_stages.StageChunk`)."""

    @property
    def virtual_stage(self) -> int: ...


class StagePart(Protocol):
    """A model chunk as the executor sees it."""

    @property
    def pre_process(self) -> bool: ...

    @property
    def post_process(self) -> bool: ...

    @property
    def stage(self) -> VirtualStage: ...


ForwardStep = Callable[[StagePart, dict, Optional[torch.Tensor]], torch.Tensor]
LossStep = Callable[[torch.Tensor, dict], tuple]
"""(output, microbatch) -> (summed loss, count) or (summed loss, count, report)."""


@dataclass
class PipelineEvent:
    """One forward or backward of one microbatch on this rank (wall-clock seconds, ``time.time()``:
    comparable across the ranks of one machine). ``start`` is taken once the input (activations or
    gradient) has arrived: time spent blocked on a neighbour is bubble, not work."""

    kind: str
    chunk: int
    virtual_stage: int
    microbatch: int
    start: float
    end: float


@dataclass
class PipelineResult:
    """What the last stage summed over its microbatches (zeros on other stages)."""

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    report: Optional[ReportSums] = None
    """The loss's report entries summed over the microbatches (last stage only)."""
    outputs: list = field(default_factory=list)
    """Last-stage outputs per microbatch with ``keep_outputs`` (forward-only runs)."""
    events: list = field(default_factory=list)


def run_pipeline(
    order: Sequence[Action],
    parts: Sequence[StagePart],
    microbatches: Sequence[dict],
    forward_step: ForwardStep,
    loss_step: Optional[LossStep],
    p2p: PipelineP2P,
    device: torch.device,
    forward_only: bool = False,
    backward_scale: float = 1.0,
    no_sync: Optional[Callable[[], ContextManager]] = None,
    keep_outputs: bool = False,
    record_events: bool = False,
    weight_grads: Optional[WeightGradStore] = None,
) -> PipelineResult:
    """Run ``order`` on this rank.

    The last stage turns each microbatch's output into (summed loss, token count[, report]) with
    ``loss_step`` and back-propagates ``summed loss x backward_scale``; other stages back-propagate the gradient
    received from the next stage. ``no_sync`` wraps every backward but the last one of each chunk,
    so that reductions hooked into the backward run once per chunk and step; an order with weight passes ("W":
    a zero-bubble schedule) defers the linear layers' weight gradients of each "B" to ``weight_grads`` (the store
    the model's layers hold, :func:`~megatron_lite.core.parallel.tensor_parallel.defer_weight_grads`), and its
    "W" computes them; both the last "B" and the last "W" of a chunk run outside ``no_sync``.
    """
    split = splits_backward(order)
    if split and weight_grads is None:
        raise ValueError("this schedule splits the backward: run_pipeline needs the model's weight_grads store")
    if weight_grads is not None:
        weight_grads.clear()  # a step that raised between a B and its W (caught in a notebook) left them behind
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    num_tokens = torch.zeros((), dtype=torch.float64, device=device)
    result = PipelineResult(loss_sum, num_tokens, ReportSums(device) if parts[-1].post_process else None)
    last_of_kind = {}  # (kind, chunk) -> the microbatch of the chunk's last backward / weight pass
    for kind, chunk, mb in order:
        last_of_kind[(kind, chunk)] = mb

    def synced(kind: str, chunk: int, mb: int) -> ContextManager:
        last = last_of_kind[(kind, chunk)] == mb
        return no_sync() if no_sync is not None and not last else contextlib.nullcontext()

    saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
    grad_mode = torch.no_grad() if forward_only else contextlib.nullcontext()
    # Receives posted ahead: the next forward's and the next backward's input, each posted as soon as it
    # can be (its shape known, and for a backward its forward done), so the transfer overlaps compute.
    # Per direction they are posted in the order they are consumed, which keeps the matching in order.
    posted: dict[int, PostedRecv] = {}
    next_of_kind = {"F": [len(order)] * (len(order) + 1), "B": [len(order)] * (len(order) + 1)}
    for i in range(len(order) - 1, -1, -1):
        for k in "FB":
            next_of_kind[k][i] = i if order[i][0] == k else next_of_kind[k][i + 1]

    def post_ahead(after: int) -> None:
        for k in "FB":
            index = next_of_kind[k][after]
            if index >= len(order) or index in posted:
                continue
            _, chunk, mb = order[index]
            part = parts[chunk]
            stage = part.stage.virtual_stage
            if k == "F" and not part.pre_process and p2p.forward_shape_known(stage):
                posted[index] = p2p.post_forward(stage)
            elif k == "B" and not part.post_process and (chunk, mb) in saved and p2p.backward_by_transfer(stage):
                posted[index] = p2p.post_backward(stage, saved[(chunk, mb)][1])

    for index, (kind, chunk, mb) in enumerate(order):
        part = parts[chunk]
        stage = part.stage.virtual_stage
        mine = posted.pop(index, None)
        if kind == "F":
            x = None if part.pre_process else p2p.recv_forward(stage, mine)
            post_ahead(index + 1)
            start = time.time() if record_events else 0.0
            if x is not None and not forward_only:
                x.requires_grad_(True)
            with grad_mode:
                out = forward_step(part, microbatches[mb], x)
                if part.post_process:
                    if loss_step is not None:
                        mb_loss, mb_tokens, mb_report = split_loss(loss_step(out, microbatches[mb]))
                        loss_sum += mb_loss.detach().to(torch.float64)
                        num_tokens += device_scalar(mb_tokens, device)
                        assert result.report is not None  # made for the last chunk (parts[-1]), this one
                        result.report.add(mb_report)
                        if keep_outputs:
                            result.outputs.append(out.detach())
                        out = mb_loss * backward_scale if backward_scale != 1.0 else mb_loss
                    elif keep_outputs:
                        result.outputs.append(out.detach())
            if not part.post_process:
                p2p.send_forward(out, stage + 1)
                deallocate_output(out)  # the send holds the bytes until it completes; the backward needs none
            if not forward_only:
                saved[(chunk, mb)] = (x, out)
                post_ahead(index + 1)  # the next backward may be this microbatch's
        elif kind == "W":
            assert weight_grads is not None
            start = time.time() if record_events else 0.0
            with synced(kind, chunk, mb):
                weight_grads.apply((chunk, mb))
        else:
            x, out = saved.pop((chunk, mb))
            grad = None if part.post_process else p2p.recv_backward(stage, out, mine)
            post_ahead(index + 1)
            start = time.time() if record_events else 0.0
            deferring = weight_grads.capture((chunk, mb)) if split and weight_grads else contextlib.nullcontext()
            with synced(kind, chunk, mb), deferring:
                torch.autograd.backward(out, grad_tensors=grad)
            if not part.pre_process:
                # received activations (requires_grad) that the backward just reached
                assert x is not None and x.grad is not None
                p2p.send_backward(x.grad, stage - 1)
        if record_events:
            result.events.append(PipelineEvent(kind, chunk, stage, mb, start, time.time()))
    p2p.wait()
    return result
