"""The MoE router and its losses: equal to megatron-core's own functions (the library that defines the
semantics) on random inputs for every option, equal to the formulas of the papers / Megatron's MoE README
written out here, their gradients reaching the router through the attached losses with the engine's
multiplier, recomputation-safe, and equal to the single-process run when the tokens are split over ranks.
"""

import contextlib
import functools
import sys
import warnings
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
    switch_load_balancing_loss_func,
    update_expert_bias,
    z_loss_func,
)
from megatron_lite.core.models.moe.router import TopKRouter
from megatron_lite.core.models.moe.routing import (
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    get_capacity,
    sinkhorn,
    sinkhorn_routing,
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


def routing_options():
    """Every combination of the top-k options (group-limited: 4 groups of 2 experts, 2 chosen)."""
    for score_function, pre_softmax, biased in [
        ("softmax", False, False),
        ("softmax", True, False),
        ("sigmoid", False, False),
        ("sigmoid", False, True),
    ]:
        for topk in (1, 2, 4):
            for groups in (None, (4, 2)) if topk > 1 else (None,):
                for scaling in (None, 2.5):
                    yield dict(
                        score_function=score_function,
                        pre_softmax=pre_softmax,
                        biased=biased,
                        topk=topk,
                        groups=groups,
                        scaling=scaling,
                    )


@pytest.fixture(scope="module")
def megatron():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.transformer.moe import moe_utils
    except Exception as error:  # any failure to import the reference skips its comparisons, with the reason
        pytest.skip(f"megatron-core is not importable here ({type(error).__name__}: {error})")
    return moe_utils


# --- equal to megatron-core ------------------------------------------------------------------------------------
def test_topk_routing_equals_megatron_for_every_option(megatron):
    torch.manual_seed(0)
    bias = torch.randn(E) * 0.3
    for o in routing_options():
        logits = torch.randn(64, E, requires_grad=True)
        num_groups, group_topk = o["groups"] or (None, None)
        probs, routing_map = topk_routing_with_score_function(
            logits,
            o["topk"],
            score_function=o["score_function"],
            pre_softmax=o["pre_softmax"],
            num_groups=num_groups,
            group_topk=group_topk,
            scaling_factor=o["scaling"],
            expert_bias=bias if o["biased"] else None,
        )
        ref_logits = logits.detach().clone().requires_grad_()
        ref_probs, ref_map = megatron.topk_routing_with_score_function(
            ref_logits,
            o["topk"],
            use_pre_softmax=o["pre_softmax"],
            num_groups=num_groups,
            group_topk=group_topk,
            scaling_factor=o["scaling"],
            score_function=o["score_function"],
            expert_bias=bias if o["biased"] else None,
        )
        assert torch.equal(routing_map, ref_map), o
        assert torch.equal(probs, ref_probs), o
        weights = torch.randn(64, E)
        (probs * weights).sum().backward()
        (ref_probs * weights).sum().backward()
        assert torch.equal(logits.grad, ref_logits.grad), o


def test_aux_loss_scores_switch_loss_and_z_loss_equal_megatron(megatron):
    torch.manual_seed(1)
    logits = torch.randn(48, E)
    for score_function in ("softmax", "sigmoid"):
        for topk in (1, 3):
            ours = compute_routing_scores_for_aux_loss(logits, topk, score_function)
            ref = megatron.compute_routing_scores_for_aux_loss(logits, topk, score_function)
            assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    for topk, total in ((2, 48), (3, 96)):
        probs = torch.softmax(torch.randn(48, E), -1).requires_grad_()
        ref_probs = probs.detach().clone().requires_grad_()
        counts = torch.randint(0, 30, (E,))
        loss = switch_load_balancing_loss_func(probs, counts, total, topk, E, 0.01)
        ref = megatron.switch_load_balancing_loss_func(ref_probs, counts, total, topk, E, 0.01)
        assert torch.equal(loss, ref)
        loss.backward(), ref.backward()
        assert torch.equal(probs.grad, ref_probs.grad)
    logits.requires_grad_()
    ref_logits = logits.detach().clone().requires_grad_()
    z, ref_z = z_loss_func(logits, 1e-3), megatron.z_loss_func(ref_logits, 1e-3)
    assert torch.equal(z, ref_z)
    z.backward(), ref_z.backward()
    assert torch.equal(logits.grad, ref_logits.grad)


def test_sinkhorn_and_capacity_equal_megatron(megatron):
    torch.manual_seed(2)
    cost = torch.randn(40, E)
    assert torch.equal(sinkhorn(cost), megatron.sinkhorn(cost))
    for tokens in (1, 7, 64, 1000):
        for factor in (0.3, 1.0, 1.25, 4.0):
            assert get_capacity(tokens, E, factor) == megatron.get_capacity(tokens, E, factor)
            assert get_capacity(tokens, E, factor, 5) == megatron.get_capacity(tokens, E, factor, 5)
    probs, routing_map = topk_routing_with_score_function(torch.randn(64, E), 2)
    for policy in ("probs", "position"):
        for pad in (False, True):
            for factor in (0.5, 1.0, 9.0):
                ours = apply_router_token_dropping(probs, routing_map, 2, factor, policy, pad)
                ref = megatron.apply_router_token_dropping(probs, routing_map, 2, factor, policy, pad)
                # Every expert keeps as many tokens, with the same weights; which tokens are kept agrees where
                # Megatron's choice is determined (its torch.topk leaves ties unspecified: see our docstring).
                assert torch.equal(ours[1].sum(0), ref[1].sum(0))
                if policy == "probs":
                    assert torch.equal(ours[1] & routing_map, ref[1] & routing_map)
                    assert torch.equal(ours[0], ref[0])


# --- equal to the formulas ------------------------------------------------------------------------------------
def test_topk_routing_formulas():
    torch.manual_seed(3)
    logits, bias = torch.randn(32, E), torch.randn(E)
    top = logits.topk(2, dim=1)
    probs, routing_map = topk_routing_with_score_function(logits, 2)  # Mixtral: softmax over the chosen logits
    assert torch.allclose(probs.gather(1, top.indices), torch.softmax(top.values, -1))
    assert torch.equal(routing_map.sum(1), torch.full((32,), 2)) and torch.equal(probs > 0, routing_map)
    probs, _ = topk_routing_with_score_function(logits, 2, pre_softmax=True, scaling_factor=2.0)  # Qwen2-MoE
    assert torch.allclose(probs.gather(1, top.indices), 2.0 * torch.softmax(logits, -1).gather(1, top.indices))
    probs, routing_map = topk_routing_with_score_function(logits, 3, score_function="sigmoid", expert_bias=bias)
    chosen = (torch.sigmoid(logits) + bias).topk(3, dim=1).indices  # the bias steers the choice only
    weights = torch.sigmoid(logits).gather(1, chosen)
    assert torch.allclose(probs.gather(1, chosen), weights / weights.sum(1, keepdim=True))
    probs, routing_map = topk_routing_with_score_function(logits, 2, num_groups=4, group_topk=1)
    for t in range(32):  # one group of 2 experts: the group whose best expert (topk // group_topk = 2) scores most
        best_group = max(range(4), key=lambda g: logits[t, 2 * g : 2 * g + 2].sum().item())
        assert routing_map[t].nonzero().flatten().tolist() == [2 * best_group, 2 * best_group + 1]
    with pytest.raises(ValueError, match="must divide the number of experts"):
        topk_routing_with_score_function(logits, 2, num_groups=3, group_topk=1)
    with pytest.raises(ValueError, match="sigmoid scores only"):
        topk_routing_with_score_function(logits, 2, expert_bias=bias)
    with pytest.raises(ValueError, match="between 1 and the number of experts"):
        topk_routing_with_score_function(logits, E + 1)


def test_loss_formulas_sinkhorn_and_dropping():
    torch.manual_seed(4)
    probs, counts, T, k = torch.rand(20, E), torch.randint(0, 9, (E,)).float(), 20, 2
    f, P = counts / (T * k), probs.mean(0)  # Switch Transformer: coeff * E * sum_i f_i * P_i
    assert torch.allclose(switch_load_balancing_loss_func(probs, counts, T, k, E, 0.1), 0.1 * E * (f * P).sum())
    logits = torch.randn(20, E)
    assert torch.allclose(z_loss_func(logits, 0.2), 0.2 * (torch.logsumexp(logits, -1) ** 2).mean())
    balanced = sinkhorn(logits)  # a doubly stochastic matrix scaled by (1/T, 1/E): rows 1/T, columns 1/E
    assert torch.allclose(balanced.sum(1), torch.full((20,), 1 / 20), rtol=1e-3)
    assert torch.allclose(balanced.sum(0), torch.full((E,), 1 / E), rtol=1e-3)
    weights, routing_map = sinkhorn_routing(logits, 2, training=False)
    assert torch.equal(routing_map, weights > 0) and torch.allclose(
        weights.sum(1), torch.softmax(logits, -1).topk(2).values.sum(1)
    )

    probs, routing_map = topk_routing_with_score_function(torch.randn(40, E), 2)
    capacity = get_capacity(40 * 2, E, 0.5)  # 5 tokens per expert
    for policy in ("probs", "position"):
        kept_probs, kept = apply_router_token_dropping(probs, routing_map, 2, 0.5, policy)
        padded_probs, padded = apply_router_token_dropping(probs, routing_map, 2, 0.5, policy, pad_to_capacity=True)
        assert torch.equal(padded.sum(0), torch.full((E,), capacity)) and torch.equal(padded_probs, kept_probs)
        for e in range(E):
            routed = routing_map[:, e].nonzero().flatten()
            if policy == "probs":
                expected = routed[probs[routed, e].argsort(descending=True)[:capacity]].sort().values
            else:
                expected = routed[:capacity]  # the earliest tokens
            assert kept[:, e].nonzero().flatten().tolist() == expected.tolist()
    with pytest.raises(ValueError, match="must be positive"):
        get_capacity(10, E, 0.0)


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
    with pytest.raises(ValueError, match="single string|must be one of"):
        make_router(moe_router_load_balancing_type=["aux_loss"])


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
