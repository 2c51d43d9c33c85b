"""The MoE router: the gradients of its attached losses are those of the explicit losses times the engine's
multiplier, a recompute pass attaches, records and counts nothing (and torch's checkpoint gives the gradients
of the run without it), its state and options, and tokens split over two ranks give the single-process result;
the expert-bias update over a process group. The pure routing functions: test_moe_routing.py.
"""

import contextlib
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megatron_lite.core.models.moe.aux_loss import (
    AuxLossScope,
    attach_aux_loss,
    update_expert_bias,
)
from megatron_lite.core.models.moe.router import TopKRouter
from megatron_lite.core.models.moe.routing import (
    apply_router_token_dropping,
    sinkhorn,
    topk_routing_with_score_function,
)
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import initialize_parameters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from spawn_utils import run_ranks  # noqa: E402

E, H = 8, 16


@dataclass
class MoEConfig:
    """Stand-in for GPTConfig's MoE fields (Megatron's defaults)."""

    hidden_size: int = H
    init_method_std: float = 0.5
    num_moe_experts: Optional[int] = E
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_dtype: Optional[str] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: Optional[float] = None
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False


def make_router(**fields) -> TopKRouter:
    router = TopKRouter(MoEConfig(**fields), ParallelLayout.single(), layer_number=1)
    initialize_parameters(router, seed=3)
    return router


# --- the router: gradients through the attached losses ------------------------------------------------------
def explicit_losses(router: TopKRouter, x: torch.Tensor, s: int, b: int) -> torch.Tensor:
    """coeff * the configured load-balancing loss + the z-loss, from the formulas, single process."""
    c = router.config
    logits = x @ router.weight.t()
    scores = torch.softmax(logits, -1)
    routed = torch.zeros_like(scores).scatter(1, scores.topk(c.moe_router_topk, 1).indices, 1.0)
    T, k = logits.shape[0], c.moe_router_topk
    if c.moe_router_load_balancing_type == "seq_aux_loss":  # per sequence (columns of [s, b, E]), averaged
        per_seq = [
            E * ((routed.view(s, b, E)[:, i].sum(0) / (s * k)) * scores.view(s, b, E)[:, i].mean(0)).sum()
            for i in range(b)
        ]
        aux = sum(per_seq) / b
    else:
        aux = E * ((routed.sum(0) / (T * k)) * scores.mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return c.moe_aux_loss_coeff * aux + (c.moe_z_loss_coeff or 0.0) * z


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
def test_attached_losses_give_the_gradient_of_the_explicit_loss_times_the_multiplier(kind):
    s, b, scale = 6, 2, 3.0
    router = make_router(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    x, upstream = torch.randn(s * b, H), torch.randn(s * b, E)
    recorded = {}
    probs, routing_map = router(x, AuxLossScope(backward_scale=scale, record=recorded.__setitem__), s, b)
    (probs * upstream).sum().backward()
    attached = router.weight.grad.clone()

    router.weight.grad = None
    plain, _ = topk_routing_with_score_function(router.gating(x), 2)
    explicit = explicit_losses(router, x, s, b)
    ((plain * upstream).sum() + scale * (s * b) * explicit).backward()  # multiplier: scale * T * tp_cp_size
    assert torch.allclose(attached, router.weight.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(probs, plain.detach())
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}.get(kind)
    name = name or "global_load_balancing_loss"
    assert set(recorded) == {name, "z_loss"}
    assert torch.allclose(recorded[name] * 0.1 + recorded["z_loss"] * 0.01, explicit.detach(), rtol=1e-5)


def test_recompute_pass_attaches_records_and_counts_nothing_and_checkpoint_gives_the_same_gradients():
    fields = dict(
        moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=0.1,
        moe_z_loss_coeff=0.01,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    )
    router = make_router(**fields)
    x, upstream = torch.randn(8, H), torch.randn(8, E)
    calls = []
    probs, _ = router(x, AuxLossScope(record=lambda *a: calls.append(a), recomputing=True), 8, 1)
    (probs * upstream).sum().backward()
    plain, _ = topk_routing_with_score_function(
        router.gating(x), 2, score_function="sigmoid", expert_bias=router.expert_bias
    )
    expected = torch.autograd.grad((plain * upstream).sum(), router.weight)[0]
    assert torch.allclose(router.weight.grad, expected) and not calls
    assert not router.local_tokens_per_expert.any() and router.ga_steps == 0

    # Through torch's non-reentrant checkpoint with the flag set in the recompute pass (as the engine would), two
    # microbatches forward, then both backward (a pipeline's order): the global counts have grown by the time the
    # first one is recomputed, yet the gradients and counts are those of the run without checkpointing.
    def run(checkpointed: bool):
        router = make_router(**fields)
        outputs = []
        for microbatch in range(2):
            xs = torch.randn(8, H, generator=torch.Generator().manual_seed(microbatch))
            scope = AuxLossScope()
            if checkpointed:
                contexts = functools.partial(lambda scope: (contextlib.nullcontext(), recomputing(scope)), scope)
                probs, _ = checkpoint(router, xs, scope, 8, 1, use_reentrant=False, context_fn=contexts)
            else:
                probs, _ = router(xs, scope, 8, 1)
            outputs.append(probs)
        sum((probs * upstream).sum() for probs in outputs).backward()
        return router.weight.grad, router.local_tokens_per_expert.clone(), router.global_tokens_per_expert.clone()

    for ours, reference in zip(run(True), run(False)):
        assert torch.equal(ours, reference)


@contextlib.contextmanager
def recomputing(scope: AuxLossScope):
    scope.recomputing = True
    try:
        yield
    finally:
        scope.recomputing = False


def test_router_state_expert_bias_and_eval():
    router = make_router(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=0.1,
    )
    assert set(router.state_dict()) == {"weight", "expert_bias"}  # counts are not checkpointed
    router.to(torch.bfloat16)
    assert router.expert_bias.dtype == router.local_tokens_per_expert.dtype == torch.float32
    router.to(torch.float32)
    router.expert_bias.copy_(torch.arange(E) * 10.0)  # a bias this large decides the choice alone
    _, routing_map = router(torch.randn(12, H), AuxLossScope(), 12, 1)
    assert routing_map[:, -2:].all() and torch.equal(router.local_tokens_per_expert, routing_map.sum(0).float())
    assert router.ga_steps == 1
    router.reset_global_aux_counts()
    assert router.ga_steps == 0 and not router.global_tokens_per_expert.any()

    # eval: no losses, no records, no jitter
    jittery = make_router(moe_input_jitter_eps=0.5, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.1).eval()
    calls, x = [], torch.randn(12, H)
    probs, _ = jittery(x, AuxLossScope(record=lambda *a: calls.append(a)), 12, 1)
    assert torch.equal(probs, topk_routing_with_score_function(jittery.gating(x), 2)[0]) and not calls
    with pytest.raises(ValueError, match="seq_length \\* batch_size"):
        jittery(x, AuxLossScope(), 5, 2)
    with pytest.raises(ValueError, match="needs moe_router_score_function='sigmoid'"):
        make_router(moe_router_enable_expert_bias=True)
    with pytest.raises(ValueError, match="must be one of"):
        make_router(moe_router_load_balancing_type=["aux_loss"])


def test_global_aux_loss_averages_counts_over_the_steps_microbatches():
    router = make_router(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1)
    recorded, counts = [], []
    for _ in range(3):
        x = torch.randn(10, H)
        router(x, AuxLossScope(record=lambda name, value: recorded.append(value)), 10, 1)
        scores = torch.softmax(router.gating(x), -1).detach()
        counts.append(torch.zeros(10, E).scatter(1, scores.topk(2, 1).indices, 1.0).sum(0))
    average = torch.stack(counts).mean(0)  # the counts of all microbatches so far, the last one's scores
    assert torch.allclose(recorded[-1], E * ((average / (10 * 2)) * scores.mean(0)).sum(), rtol=1e-5)
    router.reset_global_aux_counts()
    router(x, AuxLossScope(record=lambda name, value: recorded.append(value)), 10, 1)
    assert torch.allclose(recorded[-1], E * ((counts[-1] / (10 * 2)) * scores.mean(0)).sum(), rtol=1e-5)


def test_router_pipeline_jitter_dtype_sinkhorn_and_capacity():
    x = torch.randn(12, H)
    router = make_router(moe_input_jitter_eps=0.1, moe_expert_capacity_factor=0.5, moe_token_drop_policy="position")
    torch.manual_seed(7)
    probs, routing_map = router(x, AuxLossScope(), 12, 1)
    torch.manual_seed(7)  # the jitter is drawn from the default generator, uniform in [1 - eps, 1 + eps]
    logits = router.gating(x * torch.empty_like(x).uniform_(0.9, 1.1))
    expected = apply_router_token_dropping(*topk_routing_with_score_function(logits, 2), 2, 0.5, "position")
    assert torch.equal(probs, expected[0]) and torch.equal(routing_map, expected[1])

    fp64 = make_router(moe_router_dtype="fp64")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert make_router().gating(x).dtype == torch.float32 and fp64.gating(x).dtype == torch.float64
        assert fp64(x, AuxLossScope(), 12, 1)[0].dtype == torch.float64

    sinkhorn_router = make_router(moe_router_load_balancing_type="sinkhorn")
    _, routing_map = sinkhorn_router(x, AuxLossScope(), 12, 1)
    chosen = sinkhorn(sinkhorn_router.gating(x).detach()).topk(2, dim=1).indices  # training: balanced choice
    assert torch.equal(routing_map, torch.zeros(12, E, dtype=torch.bool).scatter(1, chosen, True))


def test_attach_aux_loss_multiplier():
    activation, loss_input = torch.randn(3, requires_grad=True), torch.randn(4, requires_grad=True)
    out = attach_aux_loss(activation, (loss_input**2).sum(), 2.5)
    out.sum().backward()
    assert torch.equal(activation.grad, torch.ones(3)) and torch.allclose(loss_input.grad, 2.5 * 2 * loss_input)


# --- split over ranks: equal to the single process --------------------------------------------------------------
KINDS = ("aux_loss", "seq_aux_loss", "global_aux_loss")
S, B = 8, 2


def _split_tokens(rank: int, world_size: int, x: torch.Tensor) -> torch.Tensor:
    """This rank's part of the sequence (sequence/context parallelism) of seq-major ``[S * B, H]``."""
    rows = S // world_size * B
    return x[rank * rows : (rank + 1) * rows]


def _losses_and_grads(router: TopKRouter, x, upstream, scope: AuxLossScope, seq_length: int):
    recorded = {}
    scope.record = lambda name, value: recorded.__setitem__(name, value)
    probs, _ = router(x, scope, seq_length, B)
    (probs * upstream).sum().backward()
    return router.weight.grad.clone(), recorded


def _ranks_body(rank, world_size, x, upstream, counts):
    world = dist.group.WORLD
    results = {}
    for kind in KINDS:
        router = make_router(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
        scope = AuxLossScope(tp_cp_group=world, tp_dp_cp_group=world, backward_scale=2.0)
        split = _split_tokens(rank, world_size, x), _split_tokens(rank, world_size, upstream)
        results[kind] = _losses_and_grads(router, *split, scope, S // world_size)
    routers = [make_router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True) for _ in range(2)]
    for router, count in zip(routers, counts[rank]):
        router.local_tokens_per_expert.copy_(count)
    routers[1].eval()  # a frozen teacher keeps its bias
    update_expert_bias(routers, world)
    return results, [(r.expert_bias.clone(), r.local_tokens_per_expert.clone()) for r in routers]


def test_split_over_two_ranks_equals_one_process_and_expert_bias_update():
    torch.manual_seed(5)
    x, upstream = torch.randn(S * B, H), torch.randn(S * B, E)
    counts = torch.randint(0, 20, (2, 2, E)).float()  # [rank, router, expert]
    ranks = run_ranks(_ranks_body, 2, x, upstream, counts)
    for kind in KINDS:
        router = make_router(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
        grad, recorded = _losses_and_grads(router, x, upstream, AuxLossScope(backward_scale=2.0), S)
        # The router's gradient is summed over the ranks (sequence parallelism); the load-balancing values are
        # partial sums over the ranks that counted the tokens, the z-loss a per-rank mean.
        assert torch.allclose(ranks[0][0][kind][0] + ranks[1][0][kind][0], grad, rtol=1e-5, atol=1e-6), kind
        for name, value in recorded.items():
            per_rank = [r[0][kind][1][name] for r in ranks]
            combined = sum(per_rank) if name != "z_loss" else sum(per_rank) / 2
            assert torch.allclose(combined, value, rtol=1e-5), (kind, name)
    total = counts.sum(0)
    expected_bias = 1e-3 * torch.sign(total.mean(-1, keepdim=True) - total)
    for biases in (ranks[0][1], ranks[1][1]):
        assert torch.allclose(biases[0][0], expected_bias[0]) and not biases[1][0].any()
        assert not biases[0][1].any() and not biases[1][1].any()  # counts restart from zero
