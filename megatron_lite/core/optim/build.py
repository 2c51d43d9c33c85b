"""Build a torch optimizer from OptimizerConfig with Megatron's parameter groups."""
from __future__ import annotations

from torch import nn
from torch.optim import SGD, AdamW, Optimizer

from megatron_lite.core.optim.config import OptimizerConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weights, and biases/norm weights (1-D) without weight decay."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim == 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "lr_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> Optimizer:
    """AdamW or SGD over ``model``'s parameters (torch-native foreach kernels, no apex)."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adam":
        return AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                     weight_decay=cfg.weight_decay, foreach=True)
    return SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay, foreach=True)
