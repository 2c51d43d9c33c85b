"""GRPO's formulas (DESIGN §3 "GRPO") against hand computation: group-normalized advantages (population std,
Dr.GRPO), the clipped surrogate with asymmetric clipping and its clip indicators, k3 KL, the entropy term,
token-level and per-sequence normalization, the truncated IS correction; a zero-variance group gets no gradient.
Also the rollout packing: a teacher-forced forward of a packed row reproduces the sampler's log-probs."""

import math

import pytest
import torch

from megatron_lite.core.inference import SamplingParams, generate
from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.rl import GRPOConfig
from megatron_lite.rl.grpo_loss import (
    group_advantages,
    grpo_token_loss,
    k3_kl,
    nonzero_variance_groups,
    reduce_token_loss,
    truncated_is_weights,
    vocab_parallel_entropy,
)
from megatron_lite.rl.rollout import group_rows, pack_rows


def test_advantages_follow_the_formula():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 3.0])
    adv = group_advantages(rewards, 4)
    for g, group in enumerate(rewards.view(3, 4).tolist()):
        mean = sum(group) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 4)  # population std
        expected = [0.0 if std == 0 else (r - mean) / (std + 1e-4) for r in group]
        assert adv[4 * g : 4 * g + 4].tolist() == pytest.approx(expected, rel=1e-6)
    assert adv[4:8].tolist() == [0.0] * 4  # zero-variance group: exactly zero
    dr = group_advantages(rewards, 4, scale=False)  # Dr.GRPO: r - mean, no std
    assert dr[8:].tolist() == pytest.approx([-0.75, -0.75, -0.75, 2.25])
    assert nonzero_variance_groups(rewards, 4).tolist() == [True, False, True]
    # A group of equal non-round floats: its mean may differ from them by rounding, the advantage may not.
    assert group_advantages(torch.full((3,), 0.1), 3).tolist() == [0.0, 0.0, 0.0]


def test_group_size_below_two_is_a_clear_error():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        group_advantages(torch.zeros(3), 1)
    with pytest.raises(ValueError, match="temperature"):
        GRPOConfig(temperature=0.0)


def test_clipped_surrogate_kl_and_entropy_per_token():
    torch.manual_seed(0)
    lp = torch.randn(3, 5) * 0.3 - 1.0
    old = lp + torch.randn(3, 5) * 0.4
    ref = lp + torch.randn(3, 5) * 0.2
    ent = torch.rand(3, 5)
    adv = torch.tensor([1.5, -0.7, 0.0])
    w = torch.rand(3, 5) + 0.5
    lo, hi, beta, c = 0.2, 0.28, 0.05, 0.01
    out = grpo_token_loss(
        lp,
        old,
        adv,
        clip_eps_low=lo,
        clip_eps_high=hi,
        ref_log_probs=ref,
        beta=beta,
        entropy=ent,
        entropy_coef=c,
        is_weights=w,
    )
    for i in range(3):
        for j in range(5):
            rho = math.exp(lp[i, j] - old[i, j])
            a = float(adv[i])
            surrogate = min(rho * a, min(max(rho, 1 - lo), 1 + hi) * a)
            delta = float(ref[i, j] - lp[i, j])
            k3 = math.exp(delta) - delta - 1
            expected = -float(w[i, j]) * surrogate + beta * k3 - c * float(ent[i, j])
            assert float(out.loss[i, j]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
            assert float(out.kl[i, j]) == pytest.approx(k3, rel=1e-5, abs=1e-7)
            assert float(out.clipped_low[i, j]) == float(a < 0 and rho < 1 - lo)
            assert float(out.clipped_high[i, j]) == float(a > 0 and rho > 1 + hi)
    assert out.clipped_low.sum() > 0 and out.clipped_high.sum() > 0  # both bounds were exercised
    assert (k3_kl(lp, ref) >= 0).all()


def test_clipped_tokens_get_no_policy_gradient():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()  # ratios 1.5, 0.5, 1.1 against old = 0
    out = grpo_token_loss(lp, torch.zeros(1, 3), torch.tensor([1.0]), clip_eps_low=0.2, clip_eps_high=0.2)
    out.loss.sum().backward()
    # A > 0: rho = 1.5 is clipped (no gradient), rho = 0.5 and 1.1 are not (d(-rho·A)/d lp = -rho).
    assert lp.grad[0].tolist() == pytest.approx([0.0, -0.5, -1.1], rel=1e-6)


def test_zero_variance_group_gives_no_gradient():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])  # group 0 solved twice: no signal; group 1 mixed
    adv = group_advantages(rewards, 2)
    lp = (torch.randn(4, 3) - 1.0).requires_grad_()
    out = grpo_token_loss(lp, lp.detach(), adv, clip_eps_low=0.2, clip_eps_high=0.2)
    total, count = reduce_token_loss(out.loss, torch.ones(4, 3))
    total.backward()
    assert lp.grad[:2].abs().max() == 0.0 and lp.grad[2:].abs().max() > 0.0


def test_token_and_sequence_normalization():
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    total, count = reduce_token_loss(loss, mask)
    assert (float(total), float(count)) == (15.0, 5.0)
    total, count = reduce_token_loss(loss, mask, per_sequence=True)
    assert (float(total), float(count)) == (2.0 + 4.5, 2.0)  # the empty row counts for nothing
    # Token level across ranks: summing (sum, count) over shards, then dividing, is the global per-token mean.
    shards = [reduce_token_loss(loss[i : i + 1], mask[i : i + 1]) for i in range(3)]
    assert sum(float(s) for s, _ in shards) / sum(float(c) for _, c in shards) == pytest.approx(15.0 / 5.0)


def test_truncated_importance_sampling_weights():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    sampler = torch.tensor([[-1.0, -1.0, -2.0]])
    w = truncated_is_weights(old, sampler, cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, math.exp(-1.0), 2.0])  # exp(1.5) > 2 is truncated at the cap
    assert truncated_is_weights(old, sampler, cap=None).tolist() == [[1.0, 1.0, 1.0]]


def test_vocab_entropy_matches_torch_and_ignores_padding():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 7, requires_grad=True)
    padded = torch.cat([logits, torch.full((2, 3, 2), float("-inf"))], dim=-1)
    ent = vocab_parallel_entropy(padded, None)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(ent, expected, rtol=1e-5, atol=1e-6)
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_packed_rows_reproduce_the_sampler_log_probs():
    config = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=20,
        seq_length=12,
        make_vocab_size_divisible_by=8,
    )
    model = GPTModel(config, seed=3)
    prompts = [[1, 2, 3], [4, 5]]
    rows, row_ids = group_rows(prompts, [7, 2], 2)
    assert row_ids == [14, 15, 4, 5] and rows == [[1, 2, 3]] * 2 + [[4, 5]] * 2
    result = generate(
        model, rows, 6, SamplingParams(temperature=1.0, seed=5), stop_ids=[19], return_log_probs=True, row_ids=row_ids
    )
    packed = pack_rows(rows, result.tokens, config.seq_length, 19, result.log_probs)
    with torch.no_grad():
        model.eval()
        teacher = -model(packed["tokens"][:, :-1], packed["tokens"][:, 1:])
    mask = packed["loss_mask"].bool()
    assert mask.sum(dim=1).tolist() == [len(t) for t in result.tokens]
    torch.testing.assert_close(teacher[mask], packed["sampler_log_probs"][mask], rtol=1e-4, atol=1e-5)
    labels = packed["tokens"][:, 1:][mask]
    assert labels.tolist() == [t for row in result.tokens for t in row]
    with pytest.raises(ValueError, match="seq_length"):
        pack_rows([[1] * 10], [[2] * 5], 12, 0)
