"""Pairwise preference losses (plain PyTorch): what reward models and, later, DPO optimise."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair ``-log sigmoid(r_chosen - r_rejected)`` [n] (the Bradley-Terry negative log-likelihood
    that ``chosen`` is preferred), computed in fp32 with ``logsigmoid`` so large margins stay finite."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} rewards must pair up")
    return -F.logsigmoid(chosen.float() - rejected.float())


def preference_correct(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per pair, 1.0 where ``r_chosen > r_rejected`` (a tie counts as wrong), else 0.0."""
    return (chosen.float() > rejected.float()).float()
