"""Pipeline activation memory (issue 25): a non-last stage's output is freed once sent, the backward from it
stays right, and a send lets go of its tensor as soon as the transfer completes, not at the step's end.

Two forked gloo ranks run ``run_pipeline`` (1F1B, 4 microbatches) over a two-stage toy model; the gradients are
compared with the same model run in one process. (The measured drop in held bytes across a real training step is
tests/unit/test_estimator.py::test_per_stage_activations_match_a_measured_pipeline_fit.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from spawn_utils import run_ranks
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.pipeline.p2p import PipelineP2P
from megatron_lite.core.parallel.pipeline.schedules import run_pipeline, schedule_order

M, ROWS, H = 4, 6, 8


@dataclass
class _Stage:
    virtual_stage: int


@dataclass
class _Part:
    pre_process: bool
    post_process: bool
    stage: _Stage


def _weights():
    torch.manual_seed(0)
    return torch.randn(H, H, requires_grad=True), torch.randn(H, H, requires_grad=True)


def _microbatches():
    torch.manual_seed(1)
    return [{"x": torch.randn(ROWS, H)} for _ in range(M)]


def _first_stage(kind: str, w0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = x @ w0
    if kind == "saves_output":
        return torch.tanh(h)  # tanh keeps its output for the backward: freeing the output must not touch that
    if kind == "view":
        return h.view(ROWS, H // 2, 2).view(ROWS, H)  # a view: its bytes are its base's, not freed
    return h + 1


def _last_stage(w1: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (y @ w1).pow(2).sum()


def _pipeline_rank(rank: int, world: int, kind: str, dtype: torch.dtype) -> dict:
    layout = ParallelLayout.build(ParallelConfig(pipeline_model_parallel_size=2))
    w0, w1 = (w.detach().to(dtype).requires_grad_() for w in _weights())
    part = _Part(pre_process=rank == 0, post_process=rank == 1, stage=_Stage(rank))
    outputs = []

    def forward_step(part, microbatch, x):
        if part.pre_process:
            out = _first_stage(kind, w0, microbatch["x"].to(dtype))
            outputs.append((out, StorageWeakRef(out.untyped_storage()), out.untyped_storage().nbytes()))
            return out
        return _last_stage(w1, x)

    def loss_step(out, microbatch):
        return out, torch.tensor(1.0)

    p2p = PipelineP2P(layout, torch.device("cpu"))
    order = schedule_order("1f1b", M, 2, rank, 1)
    result = run_pipeline(order, [part], _microbatches(), forward_step, loss_step, p2p, torch.device("cpu"))
    forward_only = run_pipeline(
        schedule_order("1f1b", M, 2, rank, 1, forward_only=True),
        [part],
        _microbatches(),
        forward_step,
        loss_step,
        p2p,
        torch.device("cpu"),
        forward_only=True,
    )
    grad = (w0 if rank == 0 else w1).grad
    return dict(
        grad=grad,
        loss=float(result.loss_sum),
        forward_only_loss=float(forward_only.loss_sum),
        # (bytes of the output's storage now, before, whether its original storage is freed) per forward
        outputs=[(o.untyped_storage().nbytes(), before, ref.expired(), tuple(o.shape)) for o, ref, before in outputs],
    )


@pytest.mark.parametrize(
    "kind, dtype",
    [("plain", torch.float32), ("saves_output", torch.float32), ("view", torch.float32), ("plain", torch.bfloat16)],
)
def test_sent_outputs_are_freed_and_the_backward_is_unchanged(kind, dtype):
    first, last = run_ranks(_pipeline_rank, 2, kind, dtype)
    w0, w1 = (w.detach().to(dtype).requires_grad_() for w in _weights())
    loss = 0.0
    for mb in _microbatches():  # one backward per microbatch, accumulated in the pipeline's order
        mb_loss = _last_stage(w1, _first_stage(kind, w0, mb["x"].to(dtype)))
        mb_loss.backward()
        loss += float(mb_loss.detach())
    torch.testing.assert_close(first["grad"], w0.grad)
    torch.testing.assert_close(last["grad"], w1.grad)
    assert last["loss"] == pytest.approx(loss, rel=1e-5)
    assert last["forward_only_loss"] == pytest.approx(loss, rel=1e-5)
    trained, evaluated = first["outputs"][:M], first["outputs"][M:]
    element = torch.tensor([], dtype=dtype).element_size()
    for now, before, freed, shape in trained:
        assert shape == (ROWS, H) and before == ROWS * H * element
        if kind == "view":
            assert now == before  # a view's storage is its base's: left alone
        else:
            assert now == element and freed  # one element left; the original bytes gone once the send completed
    for now, before, _, _ in evaluated:  # forward-only: no graph to keep, nothing to deallocate
        assert now == before


def _send_release_rank(rank: int, world: int) -> dict:
    layout = ParallelLayout.build(ParallelConfig(pipeline_model_parallel_size=2))
    p2p = PipelineP2P(layout, torch.device("cpu"))
    if rank == 0:
        sent = torch.randn(64, 64)
        ref = StorageWeakRef(sent.untyped_storage())
        p2p.send_forward(sent, 1)
        del sent
        held_after_posting = not ref.expired()
        p2p.recv_backward(0, torch.empty(64, 64))  # rank 1 answers once it has received: the transfer is done
        deadline = time.monotonic() + 60
        while not ref.expired() and time.monotonic() < deadline:  # its completion is seen by a waiter thread
            p2p.release_completed()
            time.sleep(0.01)
        released_before_step_end = ref.expired()
        p2p.wait()
        return dict(held_after_posting=held_after_posting, released_before_step_end=released_before_step_end)
    p2p.send_backward(p2p.recv_forward(1) * 2, 0)
    p2p.wait()
    return {}


def test_a_send_lets_its_tensor_go_once_the_transfer_completes():
    """Before issue 25 every sent tensor was held until ``wait()`` at the step's end."""
    first, _ = run_ranks(_send_release_rank, 2)
    assert first == dict(held_after_posting=True, released_before_step_end=True)
