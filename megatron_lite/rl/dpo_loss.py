"""The DPO objective on per-sequence log-probs (plain PyTorch), DESIGN §3 "DPO".

With ``h = β·[(log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r))]`` (sums of response-token
log-probs of the chosen c and rejected r responses):

- ``sigmoid`` (Rafailov et al. 2023, with conservative label smoothing ε): ``−(1−ε)·log σ(h) − ε·log σ(−h)``
- ``ipo`` (Azar et al. 2023): ``(h/β − 1/(2β))²``

and the implicit rewards ``β·(log π − log π_ref)`` of each response, their margin and whether it is
positive (accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class DPOTerms:
    """Per-pair DPO quantities, each ``[n]`` float32."""

    loss: torch.Tensor
    """The per-pair loss (differentiable w.r.t. the policy log-probs)."""
    rewards_chosen: torch.Tensor
    """``β·(log π(c) − log π_ref(c))`` (detached)."""
    rewards_rejected: torch.Tensor
    """``β·(log π(r) − log π_ref(r))`` (detached)."""

    @property
    def margin(self) -> torch.Tensor:
        """``rewards_chosen − rewards_rejected``."""
        return self.rewards_chosen - self.rewards_rejected

    @property
    def correct(self) -> torch.Tensor:
        """1.0 where the margin is positive (a tie counts as wrong), else 0.0."""
        return (self.margin > 0).float()


def check_dpo_options(beta: float, label_smoothing: float, loss_type: str) -> None:
    """ValueError naming the fix for a β, ε or loss type DPO cannot use."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"beta must be a number > 0 (the KL strength, e.g. 0.1), got {beta!r}")
    if (
        isinstance(label_smoothing, bool)
        or not isinstance(label_smoothing, (int, float))
        or not 0.0 <= label_smoothing < 0.5
    ):
        raise ValueError(
            f"label_smoothing must be in [0, 0.5) (the assumed share of flipped labels), got {label_smoothing!r}"
        )
    if loss_type == "ipo" and label_smoothing != 0:
        raise ValueError(f"label_smoothing={label_smoothing} applies to loss_type='sigmoid' only; set it to 0 for IPO")


def dpo_terms(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> DPOTerms:
    """The DPO loss and implicit rewards of ``n`` pairs from their summed response log-probs (each ``[n]``).

    Computed in fp32 with ``logsigmoid`` so that large margins stay finite; the reference log-probs are
    constants (no gradient flows into them)."""
    check_dpo_options(beta, label_smoothing, loss_type)
    chosen = policy_chosen.float() - reference_chosen.detach().float()
    rejected = policy_rejected.float() - reference_rejected.detach().float()
    logits = chosen - rejected  # h / β
    if loss_type == "ipo":
        loss = (logits - 1.0 / (2.0 * beta)) ** 2
    else:
        h = beta * logits
        loss = -(1.0 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return DPOTerms(loss=loss, rewards_chosen=(beta * chosen).detach(), rewards_rejected=(beta * rejected).detach())
