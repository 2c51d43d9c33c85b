"""MoE routing and its losses as pure functions: equal to megatron-core's own (the library that defines the
semantics) on random inputs for every option, and to the formulas of the papers / Megatron's MoE README written
out here. The router module built on them is tested in test_moe_router.py.
"""

import pytest
import torch

from megatron_lite.core.models.moe.aux_loss import (
    switch_load_balancing_loss_func,
    z_loss_func,
)
from megatron_lite.core.models.moe.routing import (
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    get_capacity,
    sinkhorn,
    sinkhorn_routing,
    topk_routing_with_score_function,
)

E = 8


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
def megatron(megatron_core):
    return megatron_core("megatron.core.transformer.moe.moe_utils")


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
