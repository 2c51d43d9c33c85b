"""Megatron's parameter groups and a torch optimizer over them.

Groups are described by *entries* ``(name, model_param, optimizer_param)``: which group a parameter
joins is decided from its name and its model parameter, while the group holds the tensor the
optimizer actually steps. For plain training both are the same tensor; an optimizer over fp32
master copies or data-parallel shards passes those as ``optimizer_param`` and still gets the model's
grouping (a flat shard is 1-D, so its own shape cannot tell a weight from a bias).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable, Union

import torch
from torch import nn
from torch.optim import SGD, AdamW, Optimizer

from megatron_lite.core.optim.config import OptimizerConfig

ParamEntry = tuple[str, torch.Tensor, torch.Tensor]
"""(parameter name, the model's parameter, the tensor the optimizer steps for it)."""


def model_param_entries(model: nn.Module) -> list[ParamEntry]:
    """``(name, p, p)`` for every parameter of ``model``: the entries of plain (non-sharded) training."""
    return [(name, param, param) for name, param in model.named_parameters()]


def _multipliers(name: str, model_param: torch.Tensor, cfg: OptimizerConfig) -> tuple[float, float]:
    # Megatron's default no_weight_decay_cond: biases and 1-D parameters (norm weights) are not decayed.
    wd_mult = 0.0 if name.endswith(".bias") or model_param.ndim == 1 else 1.0
    lr_mult = cfg.lr_mult if any(fnmatchcase(name, pattern) for pattern in cfg.scale_lr_params) else 1.0
    return wd_mult, lr_mult


def param_groups(entries: Iterable[ParamEntry], cfg: OptimizerConfig) -> list[dict]:
    """Megatron's parameter groups, one per (wd_mult, lr_mult); parameters without requires_grad are left out.

    Each group is ``{"params", "wd_mult", "lr_mult", "weight_decay", "lr"}`` with the optimizer params in
    entry order. Groups are sorted (lr_mult == 1 first, then decayed before not decayed) so that the
    same model gives the same group order on every rank, whatever parameter it happens to see first.
    """
    start_weight_decay, _ = cfg.weight_decay_range()
    grouped: dict[tuple[float, float], list[torch.Tensor]] = {}
    owner_of: dict[int, str] = {}
    for name, model_param, optimizer_param in entries:
        if not model_param.requires_grad:
            continue
        if id(optimizer_param) in owner_of:
            raise ValueError(
                f"parameters {owner_of[id(optimizer_param)]!r} and {name!r} share one optimizer tensor; "
                f"list each optimizer parameter once (named_parameters() already drops tied copies)."
            )
        owner_of[id(optimizer_param)] = name
        grouped.setdefault(_multipliers(name, model_param, cfg), []).append(optimizer_param)
    order = sorted(grouped, key=lambda key: (key[1] != 1.0, -key[0], key[1]))
    return [
        {
            "params": grouped[key],
            "wd_mult": key[0],
            "lr_mult": key[1],
            "weight_decay": start_weight_decay * key[0],
            "lr": cfg.lr * key[1],
        }
        for key in order
    ]


def build_optimizer(entries: Union[nn.Module, Iterable[ParamEntry]], cfg: OptimizerConfig) -> Optimizer:
    """AdamW (decoupled weight decay) or SGD over :func:`param_groups`, with torch-native foreach kernels.

    ``entries`` may be a module, meaning :func:`model_param_entries` of it. The groups' lr and
    weight_decay are the schedule's starting values; :class:`MegatronLRScheduler` sets them every step.
    """
    if isinstance(entries, nn.Module):
        entries = model_param_entries(entries)
    groups = param_groups(entries, cfg)
    if not groups:
        raise ValueError("no parameter requires a gradient: there is nothing to optimize.")
    if cfg.optimizer == "adam":
        return AdamW(
            groups,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            foreach=True,
        )
    return SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay, foreach=True)
