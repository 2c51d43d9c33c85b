"""Token dispatchers against one process: every rank's tokens go to the ranks of their experts and come back as the
weighted sum of the experts' outputs, with the same gradients, for allgather and alltoall, over EP, ETP and both."""

import pytest
import torch
import torch.distributed as dist
from spawn_utils import run_ranks

from megatron_lite.core.models.moe.token_dispatcher import build_dispatcher
from megatron_lite.core.parallel.collective_bytes import CollectiveBytes
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout

E, H, T, TOPK = 8, 6, 5, 2


def _problem(world):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(world * T, H, generator=gen)
    logits = torch.randn(world * T, E, generator=gen)
    top = logits.topk(TOPK, dim=1).indices
    routing_map = torch.zeros(world * T, E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(logits, -1) * routing_map
    weights = torch.randn(E, H, H, generator=gen)  # expert e: x -> x @ weights[e]
    grad_out = torch.randn(world * T, H, generator=gen)
    return x, probs, routing_map, weights, grad_out


def _reference(world):
    x, probs, routing_map, weights, grad_out = _problem(world)
    x, probs, weights = (t.clone().requires_grad_() for t in (x, probs, weights))
    routed = probs * routing_map  # only the chosen experts' weights receive a gradient
    out = sum(routed[:, e : e + 1] * (x @ weights[e]) for e in range(E))
    (out * grad_out).sum().backward()
    return out.detach(), x.grad, probs.grad, weights.grad


def _on_ranks(rank, world, parallel, kind):
    layout = ParallelLayout.build(ParallelConfig(**parallel))
    x, probs, routing_map, weights, grad_out = _problem(world)
    rows = slice(rank * T, (rank + 1) * T)  # every rank of the stage holds distinct tokens
    x, probs = x[rows].clone().requires_grad_(), probs[rows].clone().requires_grad_()
    per_rank = E // layout.ep_size
    local = weights[layout.ep_rank * per_rank : (layout.ep_rank + 1) * per_rank]
    # each ETP rank holds a slice of the input dimension: its outputs are partial sums
    cut = H // layout.etp_size
    local = local[:, layout.etp_rank * cut : (layout.etp_rank + 1) * cut].clone().requires_grad_()
    dispatcher = build_dispatcher(kind, E, layout)
    with CollectiveBytes() as counted:  # what the collectives really took from this rank, forward only
        expert_rows, counts = dispatcher.dispatch(x, probs, routing_map[rows])
        pieces = expert_rows[:, layout.etp_rank * cut : (layout.etp_rank + 1) * cut].split(counts)
        out = dispatcher.combine(torch.cat([piece @ local[i] for i, piece in enumerate(pieces)]))
    (out * grad_out[rows]).sum().backward()
    grad_w = local.grad.clone()
    if layout.group("edp") is not None:
        dist.all_reduce(grad_w, group=layout.group("edp"))  # the expert-DP reduction the optimizer does
    result = dict(out=out.detach(), x_grad=x.grad, probs_grad=probs.grad, w_grad=grad_w, ep=layout.ep_rank)
    result.update(etp=layout.etp_rank, sent=dispatcher.sent_bytes, counted=counted.total(), unknown=counted.unknown)
    layout.destroy()
    return result


LAYOUTS = {
    "ep4": dict(expert_model_parallel_size=4),
    "ep2-edp2": dict(expert_model_parallel_size=2),
    "tp2-sp-ep2": dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2),
    "tp2-sp-etp1-ep2": dict(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_tensor_parallel_size=1,
        expert_model_parallel_size=2,
    ),
    "tp2-sp-etp2": dict(tensor_model_parallel_size=2, sequence_parallel=True),
}


@pytest.mark.parametrize("kind", ["allgather", "alltoall"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dispatch_and_combine_equal_one_process(name, kind):
    world = 4
    out, x_grad, probs_grad, w_grad = _reference(world)
    for rank, result in enumerate(run_ranks(_on_ranks, world, LAYOUTS[name], kind)):
        rows = slice(rank * T, (rank + 1) * T)
        torch.testing.assert_close(result["out"], out[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["x_grad"], x_grad[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["probs_grad"], probs_grad[rows], rtol=1e-5, atol=1e-5)
        ep = LAYOUTS[name].get("expert_model_parallel_size", 1)
        etp = LAYOUTS[name].get("expert_tensor_parallel_size", LAYOUTS[name].get("tensor_model_parallel_size", 1))
        per_rank, cut = E // ep, H // etp
        expected = w_grad[result["ep"] * per_rank : (result["ep"] + 1) * per_rank]
        expected = expected[:, result["etp"] * cut : (result["etp"] + 1) * cut]
        torch.testing.assert_close(result["w_grad"], expected, rtol=1e-5, atol=1e-5)
        # the traffic the dispatcher reports (the MoE benchmark's table) is what this rank really sent
        assert result["unknown"] == [] and result["counted"] > 0
        assert result["sent"] == result["counted"], (rank, result["sent"], result["counted"])
