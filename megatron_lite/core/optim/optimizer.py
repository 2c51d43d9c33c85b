"""Megatron's optimizer step around a torch optimizer: fp32 main parameters, gradient reduction over
data parallelism, fp16 loss scaling with skipped steps, and one global gradient-norm clip.

The torch optimizer (AdamW/SGD) updates *main* parameters. With fp32 model parameters (fp32 and the
``*-mixed`` autocast precisions) the main parameters are the model parameters themselves; with
half-precision model parameters (``bf16-true``/``16-true``) they are fp32 master copies, and the
updated masters are copied back into the model after each step. As in Megatron, the gradients of
half-precision parameters are accumulated over microbatches in fp32 ``main_grad`` buffers (a hook
moves each fresh half-precision gradient into the buffer), so accumulation and the DP reduction run
in fp32. The buffers and their reduction (all-reduce, overlappable with the backward) are
:class:`megatron_lite.core.parallel.grad_buffers.GradBuffers`, which the schedules drive through
:meth:`MegatronOptimizer.no_sync`. :class:`DistributedOptimizer` (ZeRO-1) shards the main parameters
and optimizer state over data-parallel ranks (the buffers are reduce-scattered); with FSDP the
parameters are already sharded DTensors and the gradients arrive reduced.

One step::

    opt.zero_grad(); loss = schedule(..., loss_scale=opt.loss_scale)   # backward of the scaled loss
    result = opt.prepare_step(loss.grad_scale)   # reduce, unscale, inf check, norm, clip
    opt.optimizer.step()                         # no-op on a skipped step: main grads are None
    opt.finish_step(result)                      # masters -> model params (all-gather for ZeRO-1)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Optional, cast

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.optim.build import build_optimizer
from megatron_lite.core.optim.clip_grads import (
    clip_coefficient,
    counts_in_norm,
    grad_norm_of,
    replicated_norm_group,
    scale_grads,
)
from megatron_lite.core.optim.config import OptimizerConfig
from megatron_lite.core.optim.grad_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from megatron_lite.core.parallel.data_parallel import reduce_tp_partial_grads
from megatron_lite.core.parallel.grad_buffers import GradBuffers, Reduction
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.timers import timed

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

GradReduction = Literal["all_reduce", "fsdp"]


@dataclass
class StepResult:
    """What one optimizer step did."""

    grad_norm: torch.Tensor
    """Global L2 norm of the unscaled gradients, before clipping."""
    skipped: bool
    """True when the gradients overflowed (fp16) and the update was skipped."""
    loss_scale: Optional[float]
    """The loss scale the step ran with (None without loss scaling)."""


def build_loss_scaler(config: OptimizerConfig) -> LossScaler:
    """A constant scaler when ``loss_scale`` is set, else Megatron's dynamic scaler."""
    if config.loss_scale is not None:
        return ConstantLossScaler(config.loss_scale)
    return DynamicLossScaler(
        initial_scale=config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_interval=config.loss_scale_window,
        hysteresis=config.hysteresis,
    )


class MegatronOptimizer:
    """fp32 main params + DP gradient reduction + loss scaling + global clipping around a torch optimizer.

    Args:
        model: the (possibly half-precision, possibly FSDP-sharded) model of this rank.
        config: optimizer, schedule, clipping and loss-scale settings.
        layout: the parallel layout (groups for the reductions and the norm).
        fp16: scale the loss (dynamic or constant scaler) and skip steps whose gradients overflow.
        grad_reduction: ``"all_reduce"`` (plain DP) or ``"fsdp"`` (FSDP reduced in its hooks).
    """

    buffer_reduction: Reduction = "all_reduce"
    """How the gradient buffers are reduced over DP (the distributed optimizer reduce-scatters)."""

    def __init__(
        self,
        model: nn.Module,
        config: OptimizerConfig,
        layout: ParallelLayout,
        fp16: bool = False,
        grad_reduction: GradReduction = "all_reduce",
        build: Callable = build_optimizer,
        bucket_size: Optional[int] = None,
        overlap_grad_reduce: bool = False,
    ) -> None:
        self.model, self.config, self.layout = model, config, layout
        self.grad_reduction = grad_reduction
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._by_name = dict(self.named_params)
        # FSDP reduce-scatters in its own hooks and leaves sharded gradients in param.grad.
        self.grad_buffers: Optional[GradBuffers] = (
            None
            if grad_reduction == "fsdp"
            else GradBuffers(self.named_params, layout, self.buffer_reduction, bucket_size, overlap_grad_reduce)
        )
        self.loss_scaler: Optional[LossScaler] = build_loss_scaler(config) if fp16 else None
        self.skipped_steps = 0
        self.timers = None
        """Optional :class:`megatron_lite.core.timers.Timers`: the step's phases are timed with Megatron's names."""
        entries = self._main_param_entries()
        self.optimizer = build(entries, config)

    # --- main parameters ------------------------------------------------------------------
    def _main_param_entries(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, model param, main param) for the torch optimizer; masters only for half params."""
        self.masters: dict[str, torch.Tensor] = {}
        entries: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for name, param in self.named_params:
            if param.dtype in (torch.float16, torch.bfloat16):
                self.masters[name] = param.detach().clone().float()
                entries.append((name, param, self.masters[name]))
            else:
                entries.append((name, param, param))
        return entries

    @property
    def overlapped_reductions(self) -> int:
        """Bucket reductions launched during a backward so far (observability, tests)."""
        return self.grad_buffers.overlapped_reductions if self.grad_buffers is not None else 0

    def remove_hooks(self) -> None:
        """Detach from the model's parameters (before another optimizer is built on the same model, and
        after training, so that a later backward leaves its gradients in ``param.grad``)."""
        if self.grad_buffers is not None:
            self.grad_buffers.remove_hooks()

    def drop_state(self, names: set[str]) -> None:
        """Forget the optimizer state of these parameters (absent from a loaded checkpoint: a parameter
        that had not been stepped yet), so that their first real step starts Adam from scratch."""
        dropped = {id(p) for n, p in self.named_params if n in names}
        for model_param, main in self.main_params():
            if id(model_param) in dropped:
                self.optimizer.state.pop(main, None)

    def _model_grad(self, name: str, param: torch.Tensor) -> Optional[torch.Tensor]:
        """Where ``param``'s accumulated gradient is: its fp32 main_grad buffer, else (FSDP) ``param.grad``."""
        return self.grad_buffers.main_grad(name) if self.grad_buffers is not None else param.grad

    def gradient_buffer(self, name: str) -> torch.Tensor:
        """The tensor that holds ``name``'s accumulated, not yet reduced gradient (its fp32 main_grad
        buffer, else ``param.grad``, created as zeros if the parameter got none): collectives that
        must run before the DP reduction (the tied-embedding sum over pipeline stages) work on it."""
        param = self._by_name[name]
        grad = self._model_grad(name, param)
        if grad is None:  # FSDP: a parameter without a gradient
            param.grad = grad = torch.zeros_like(param)
        return grad

    def main_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model param, main param) pairs this rank updates."""
        return [(p, self.masters.get(n, p)) for n, p in self.named_params]

    @property
    def loss_scale(self) -> Optional[float]:
        return self.loss_scaler.scale if self.loss_scaler is not None else None

    # --- the step -------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Around the backward of every microbatch but the last: accumulate without reducing (FSDP2
        would otherwise reduce-scatter after every microbatch)."""
        if self.grad_buffers is not None:
            with self.grad_buffers.no_sync():
                yield
            return
        # grad_reduction="fsdp": the model was sharded with fully_shard (an FSDPModule); torch's nn.Module is
        # not typed as one
        fsdp_model = cast("FSDPModule", self.model)
        fsdp_model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            fsdp_model.set_requires_gradient_sync(True)

    def zero_grad(self) -> None:
        for _, p in self.named_params:
            p.grad = None
        for master in self.masters.values():
            master.grad = None
        if self.grad_buffers is not None:
            self.grad_buffers.zero()

    def reduce_gradients(self) -> None:
        """Make the gradients those of the global batch: the partial gradients of replicated parameters
        (under sequence parallelism; qk_layernorm's always) are summed over TP, then everything over DP
        (experts over expert-DP; FSDP has already reduce-scattered over DP in its backward hooks)."""
        if self.grad_reduction == "fsdp":
            for _, param in self.named_params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            reduce_tp_partial_grads([p for _, p in self.named_params], self.layout)
            return
        # A parameter that got no gradient keeps a zero buffer slice and still takes a step (weight
        # decay, Adam's moments), as with Megatron's buffers, the same under every optimizer and precision.
        assert self.grad_buffers is not None  # every reduction but FSDP's has them
        self.grad_buffers.reduce()

    def collect_main_grads(self) -> None:
        """Point the main parameters' gradients at their (reduced) fp32 buffer slices."""
        if self.grad_buffers is None:
            return
        for name, param in self.named_params:
            self.masters.get(name, param).grad = self.grad_buffers.main_grad(name)

    def norm_inputs(self) -> tuple[list[torch.Tensor], Optional[dist.ProcessGroup], bool]:
        """(gradients counted in the global norm on this rank, group to sum over, whether over all ranks)."""
        sharded = self.grad_reduction == "fsdp"  # disjoint shards on every rank
        grads = [
            main.grad
            for model_param, main in self.main_params()
            if main.grad is not None and counts_in_norm(model_param, self.layout, sliced_over_dp=sharded)
        ]
        if sharded:
            return grads, None, True
        group, all_ranks = replicated_norm_group(self.layout)
        return grads, group, all_ranks

    @torch.no_grad()
    def prepare_step(
        self, grad_scale: Optional[torch.Tensor] = None, accept: Optional[Callable[[torch.Tensor], bool]] = None
    ) -> Optional[StepResult]:
        """Reduce gradients, unscale them (``grad_scale`` from the schedule, divided by the loss
        scale), check for overflow, compute the global norm and clip. On overflow the main
        gradients are dropped, so the torch optimizer's step leaves parameters and state untouched.

        ``accept(grad_norm)`` (the rerun state machine's check) runs once the norm is known and before
        anything that a replay would have to undo (loss scaler, skipped-step count, clipping): when it
        returns False the step stops there and None is returned."""
        with timed(self.timers, "all-grads-sync"):
            self.reduce_gradients()
        self.collect_main_grads()
        main_grads = [main.grad for _, main in self.main_params() if main.grad is not None]
        # The model's device even on a ZeRO-1 rank that owns no slice (NCCL reduces only device tensors).
        device = self.named_params[0][1].device if self.named_params else torch.device("cpu")
        factor = torch.ones((), dtype=torch.float32, device=device)
        if grad_scale is not None:
            factor = factor * grad_scale.to(device=device, dtype=torch.float32)
        loss_scale = self.loss_scale
        if loss_scale is not None:
            factor = factor / loss_scale
        if grad_scale is not None or loss_scale is not None:
            scale_grads(main_grads, factor)
        with timed(self.timers, "optimizer-clip-main-grad"):
            grads, group, all_ranks = self.norm_inputs()
            norm = grad_norm_of(grads, group, device, all_ranks=all_ranks)
        if accept is not None and not accept(norm):
            return None
        skipped = False
        if self.loss_scaler is not None:
            # The norm is inf/NaN exactly when some gradient is: one reduction serves both (Megatron
            # reduces a separate found-inf flag). The host sync is unavoidable: skipping is a branch.
            skipped = not bool(torch.isfinite(norm).item())
            self.loss_scaler.update(skipped)
        elif self.config.check_for_nan_in_grad and not bool(torch.isfinite(norm).item()):
            # Without loss scaling nothing would skip the update: every weight would turn NaN.
            raise FloatingPointError(
                f"the global gradient norm is {norm.item()} (NaN/Inf gradients) and this run has no fp16 loss "
                f"scaler to skip the step: lower the learning rate or check the data; set "
                f"OptimizerConfig(check_for_nan_in_grad=False) to train on regardless (Megatron's "
                f"--no-check-for-nan-in-loss-and-grad)."
            )
        if skipped:
            self.skipped_steps += 1
            for _, main in self.main_params():
                main.grad = None
        elif self.config.clip_grad > 0 and main_grads:
            scale_grads(main_grads, clip_coefficient(norm, self.config.clip_grad))
        return StepResult(grad_norm=norm, skipped=skipped, loss_scale=loss_scale)

    @torch.no_grad()
    def finish_step(self, result: StepResult) -> None:
        """Copy updated fp32 masters into the half-precision model parameters."""
        if result.skipped:
            return
        with timed(self.timers, "optimizer-copy-main-to-model-params"):
            for name, master in self.masters.items():
                self._by_name[name].data.copy_(master)

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master copy of every half-precision parameter, by name, shaped like the (TP-local) parameter:
        the weights the optimizer trains, of which the model holds a rounded copy. Empty for fp32 parameters."""
        return dict(self.masters)

    # --- checkpoints ----------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state per model parameter name, each tensor shaped like the (TP-local) model
        parameter, plus ``master`` for fp32 master copies: the same format whatever the DP size or
        sharding, so checkpoints move between the plain and the distributed optimizer."""
        by_main = {id(main): (name, p) for (name, p), (_, main) in zip(self.named_params, self.main_params())}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for group in self.optimizer.param_groups:
            for main in group["params"]:
                name, param = by_main[id(main)]
                entry = state.setdefault(name, {})
                for key, value in self.optimizer.state.get(main, {}).items():
                    entry[key] = value
        for name, master in self.masters.items():
            state.setdefault(name, {})["master"] = master
        return state

    def load_checkpoint_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Counterpart of :meth:`checkpoint_state`; its tensors were loaded in place, so only masters
        that were absent from the checkpoint need refreshing from the (loaded) model weights."""
        for name, master in self.masters.items():
            if "master" not in state.get(name, {}):
                master.copy_(self._by_name[name].detach().float())

    @torch.no_grad()
    def ensure_state(self) -> None:
        """Create optimizer state tensors (a zero-gradient step at lr 0) so a checkpoint loads in place."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if params and all(self.optimizer.state.get(p) for p in params):
            return
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in self.optimizer.param_groups]
        grads = [p.grad for p in params]
        for g in self.optimizer.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for g, (lr, wd) in zip(self.optimizer.param_groups, saved):
            g["lr"], g["weight_decay"] = lr, wd
        for p, grad in zip(params, grads):
            p.grad = grad

    def state_dict_extra(self) -> dict:
        """Non-tensor state: the loss scaler and the skipped-step count."""
        return {
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict_extra(self, extra: dict) -> None:
        if self.loss_scaler is not None and extra.get("loss_scaler"):
            self.loss_scaler.load_state_dict(extra["loss_scaler"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
