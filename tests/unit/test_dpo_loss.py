"""The DPO loss, IPO variant, implicit rewards, margin and accuracy against DESIGN §3's formula on
hand-computed log-probs (scalars worked out with ``math``), including the gradient."""

import math

import pytest
import torch

from megatron_lite.rl.dpo_loss import dpo_terms

# Two pairs: (policy chosen, policy rejected, reference chosen, reference rejected), summed log-probs.
POLICY_C, POLICY_R = [-3.0, -6.0], [-5.0, -2.0]
REF_C, REF_R = [-4.0, -5.0], [-4.5, -4.0]
BETA = 0.5
# pair 0: chosen gains 1.0, rejected loses 0.5 -> h/β = 1.5 ; pair 1: chosen -1.0, rejected +2.0 -> h/β = -3.0
LOGITS = [1.5, -3.0]


def _terms(**kwargs):
    policy_c = torch.tensor(POLICY_C, requires_grad=True)
    terms = dpo_terms(policy_c, torch.tensor(POLICY_R), torch.tensor(REF_C), torch.tensor(REF_R), beta=BETA, **kwargs)
    return policy_c, terms


def _softplus(x):
    return math.log1p(math.exp(x))  # -log sigmoid(-x)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_sigmoid_loss_with_label_smoothing(eps):
    policy_c, terms = _terms(label_smoothing=eps)
    expected = [(1 - eps) * _softplus(-BETA * z) + eps * _softplus(BETA * z) for z in LOGITS]
    torch.testing.assert_close(terms.loss, torch.tensor(expected), rtol=1e-6, atol=0)
    terms.loss.sum().backward()
    # d/d log π(c) of -(1-ε) log σ(h) - ε log σ(-h) = β·(-(1-ε)·σ(-h) + ε·σ(h))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    grad = [BETA * (-(1 - eps) * sig(-BETA * z) + eps * sig(BETA * z)) for z in LOGITS]
    torch.testing.assert_close(policy_c.grad, torch.tensor(grad), rtol=1e-6, atol=0)


def test_ipo_loss():
    policy_c, terms = _terms(loss_type="ipo")
    expected = [(z - 1 / (2 * BETA)) ** 2 for z in LOGITS]  # (1.5 - 1)^2 = 0.25, (-3 - 1)^2 = 16
    assert expected == [0.25, 16.0]
    torch.testing.assert_close(terms.loss, torch.tensor(expected), rtol=1e-6, atol=0)
    terms.loss.sum().backward()
    torch.testing.assert_close(policy_c.grad, torch.tensor([2 * (z - 1 / (2 * BETA)) for z in LOGITS]))


def test_rewards_margin_accuracy():
    _, terms = _terms()
    torch.testing.assert_close(terms.rewards_chosen, torch.tensor([0.5, -0.5]))  # β·(log π − log π_ref)
    torch.testing.assert_close(terms.rewards_rejected, torch.tensor([-0.25, 1.0]))
    torch.testing.assert_close(terms.margin, torch.tensor([0.75, -1.5]))
    assert terms.correct.tolist() == [1.0, 0.0]
    assert not terms.rewards_chosen.requires_grad


def test_reference_gets_no_gradient_and_identity_policy_gives_log2():
    ref = torch.tensor([-1.0, -2.0], requires_grad=True)
    policy = ref.detach().clone().requires_grad_(True)
    terms = dpo_terms(policy, policy, ref, ref, beta=0.1)
    torch.testing.assert_close(terms.loss, torch.full((2,), math.log(2.0)))  # h = 0 at the start of training
    terms.loss.sum().backward()
    assert ref.grad is None and policy.grad is not None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"beta": 0.0}, "beta"),
        ({"label_smoothing": 0.5}, "label_smoothing"),
        ({"loss_type": "hinge"}, "loss_type"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "IPO"),
    ],
)
def test_bad_options_name_the_fix(kwargs, match):
    x = torch.zeros(1)
    with pytest.raises(ValueError, match=match):
        dpo_terms(x, x, x, x, **kwargs)
