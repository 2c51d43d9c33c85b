"""The training engine: one object owns the step for every objective.

An objective (GPT pretraining, a reward model, DPO, ...) supplies the model of this rank, a stage
forward and a last-stage loss (:class:`Objective`). The engine owns the rest: the model chunks this
rank holds (one per virtual pipeline stage, one without pipelining), the schedule (no pipelining,
GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1), the reduction of the loss, its count and the metrics the loss reports
(summed on the last stage, over the pipeline and over DP x CP, in one collective per group and step, no
host sync; see ``core/parallel/loss_report.py``), the shared-embedding gradient sum between the first and
last stage, and the optimizer step (gradient reduction, loss scaling, clipping).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.optim.optimizer import MegatronOptimizer, StepResult
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.loss_report import ReportNames, ReportSums
from megatron_lite.core.parallel.pipeline.p2p import DTYPES, PipelineP2P
from megatron_lite.core.parallel.pipeline.schedules import PipelineEvent, run_pipeline, schedule_order, splits_backward
from megatron_lite.core.parallel.schedules import (
    StepLoss,
    backward_scale_for,
    finish_step_loss,
    forward_backward_no_pipelining,
    scale_model_grads,
    share_backward_scale,
    take_model_report,
)
from megatron_lite.core.parallel.tensor_parallel import defer_weight_grads
from megatron_lite.core.parallel.weight_grad import WeightGradStore
from megatron_lite.core.rerun import RerunStateMachine
from megatron_lite.core.timers import Timers, timed


@runtime_checkable
class Objective(Protocol):
    """What a training objective supplies to the engine."""

    def forward_step(self, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """Run one model chunk on a microbatch. ``input_tensor`` is the previous stage's output (None
        on the first stage). Returns the activations for the next stage, or on the last stage the
        output that :meth:`loss` reduces."""
        ...

    def loss(self, output: torch.Tensor, microbatch: dict) -> tuple:
        """(sum of the loss over the microbatch's loss units, number of units), on the last stage.
        The step's loss is the sum over the global batch divided by the global count. A third element,
        ``{name: [sum, count]}`` (``megatron_lite.core.engine.report_entry``), reports metrics: each is reduced like the
        loss and lands in ``StepLoss.report`` (``GPTModule`` logs it as ``train/<name>``)."""
        ...


class WholeModel:
    """A model without pipeline chunks, seen as one stage that is both first and last."""

    pre_process = post_process = True

    class _Stage:
        virtual_stage = 0

    stage = _Stage()

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


def model_parts(model: nn.Module) -> list:
    """The chunks (virtual pipeline stages) of ``model`` this rank runs, in chunk order."""
    chunks = getattr(model, "chunks", None)
    return list(chunks) if chunks else [WholeModel(model)]


class TrainingEngine:
    """Runs forward/backward schedules and optimizer steps of one objective on one rank.

    Args:
        model: this rank's model (all of its pipeline chunks; the optimizer and checkpoints see it whole).
        layout: the parallel layout.
        objective: the stage forward and the last-stage loss.
        optimizer: the Megatron optimizer (None for evaluation only).
        timers: Megatron timers (pipeline send/recv are timed at level 2).
        record_events: keep every forward/backward's start and end (for the pipeline timeline).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParallelLayout,
        objective: Objective,
        optimizer: Optional[MegatronOptimizer] = None,
        timers: Optional[Timers] = None,
        record_events: bool = False,
    ) -> None:
        if not isinstance(objective, Objective):
            raise TypeError(
                f"{type(objective).__name__} is not an engine Objective: it needs forward_step(part, "
                f"microbatch, input_tensor) and loss(output, microbatch)"
            )
        self.model, self.layout, self.objective = model, layout, objective
        self.optimizer = optimizer
        self.timers = timers
        self.record_events = record_events
        self.events: list[PipelineEvent] = []
        """Events of the last step run (with ``record_events``)."""
        self.parts = model_parts(model)
        self._p2p: Optional[PipelineP2P] = None
        self._weight_grads: Optional[WeightGradStore] = None  # a zero-bubble schedule's deferred weight gradients
        self._shared = [(name, p) for name, p in model.named_parameters() if getattr(p, "shared_embedding", False)]
        self.rerun: Optional[RerunStateMachine] = None
        """Validates every training step and replays rejected ones (see ``megatron_lite.core.rerun``)."""
        self._loss = objective.loss  # the objective's loss, with an injected fault during a drill
        self._report_names = ReportNames()  # the loss report's names, learnt at the first step of each kind

    @property
    def device(self) -> torch.device:
        param = next(self.model.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    @property
    def pipelined(self) -> bool:
        return self.layout.pp_size > 1

    def _stage_loss(self, model: nn.Module, microbatch: dict) -> tuple:
        return self._loss(self.objective.forward_step(self.parts[0], microbatch, None), microbatch)

    def p2p(self) -> PipelineP2P:
        if self._p2p is None:
            self._p2p = PipelineP2P(self.layout, self.device, self.timers)
        return self._p2p

    # --- schedules ---------------------------------------------------------------------------
    def forward_backward(
        self,
        microbatches: Sequence[dict],
        forward_only: bool = False,
        loss_scale: Optional[float] = None,
        scale_grads: bool = True,
        no_sync: Optional[Callable] = None,
    ) -> StepLoss:
        """Forward (and backward) of every microbatch through the layout's schedule; the loss is the
        global-batch mean on every rank. Gradients are left unnormalised with ``scale_grads=False``
        (``StepLoss.grad_scale`` says by what to multiply them). The loss's report is reduced with it."""
        if not self.pipelined:
            return forward_backward_no_pipelining(
                self.model,
                microbatches,
                self.layout,
                self._stage_loss,
                forward_only=forward_only,
                device=self.device,
                loss_scale=loss_scale,
                scale_grads=scale_grads,
                no_sync=no_sync,
                report_names=self._report_names,
            )
        backward_scale = backward_scale_for(loss_scale, microbatches)
        share_backward_scale(self.model, backward_scale)
        result = self._run(microbatches, forward_only, backward_scale, no_sync)
        recorded = take_model_report(self.model)  # every stage's layers may record (MoE), not only the last's
        if recorded:
            if result.report is None:
                result.report = ReportSums(self.device)
            result.report.add(recorded)
        local = result.report.names() if result.report is not None else None
        names = self._report_names.agree(local, self.layout, forward_only)
        step = finish_step_loss(
            result.loss_sum, result.num_tokens, self.layout, loss_scale, backward_scale, result.report, names
        )
        if not forward_only and scale_grads:
            scale_model_grads(self.model, step.grad_scale)
        return step

    def _run(
        self,
        microbatches: Sequence[dict],
        forward_only: bool,
        backward_scale: float = 1.0,
        no_sync: Optional[Callable] = None,
        loss: bool = True,
        keep_outputs: bool = False,
        forward_step: Optional[Callable] = None,
    ):
        order = schedule_order(
            self.layout.config.schedule,
            len(microbatches),
            self.layout.pp_size,
            self.layout.pp_rank,
            len(self.parts),
            forward_only,
        )
        if splits_backward(order) and self._weight_grads is None:
            self._weight_grads = WeightGradStore()
            defer_weight_grads(self.model, self._weight_grads)
        result = run_pipeline(
            order,
            self.parts,
            microbatches,
            forward_step or self.objective.forward_step,
            self._loss if loss else None,
            self.p2p(),
            self.device,
            forward_only=forward_only,
            backward_scale=backward_scale,
            no_sync=no_sync,
            keep_outputs=keep_outputs,
            record_events=self.record_events,
            weight_grads=self._weight_grads,
        )
        self.events = result.events
        return result

    # --- the optimizer step ------------------------------------------------------------------
    def train_step(
        self, microbatches: Sequence[dict], optimizer_step: Optional[Callable[[], Any]] = None
    ) -> tuple[StepLoss, StepResult]:
        """One optimizer step over ``microbatches`` (this DP rank's share of the global batch).

        ``optimizer_step`` runs the torch optimizer's step (Lightning passes its wrapped optimizer's,
        so its hooks run); by default the engine's optimizer steps directly.
        """
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer: build it with optimizer=... to train")
        mopt = self.optimizer
        rerun = self.rerun
        if rerun is not None:
            rerun.begin_step(self.model)
        seen: dict[str, torch.Tensor] = {}
        while True:
            mopt.zero_grad()
            if rerun is not None:
                self._loss = rerun.wrap_loss(self.objective.loss)
            try:
                # Gradients stay unnormalised until the optimizer has reduced them into fp32 main gradients.
                step = self.forward_backward(
                    microbatches, loss_scale=mopt.loss_scale, scale_grads=False, no_sync=mopt.no_sync
                )
            finally:
                self._loss = self.objective.loss
            self.reduce_shared_embedding_grads()
            finalize = getattr(self.model, "finalize_moe_step", None)
            if finalize is not None:  # MoE: expert biases move once per step, from the step's expert loads
                finalize()
            # The check runs once the norm is known and before the optimizer (or the loss scaler) changed
            # anything: a replay starts from exactly the state this attempt started from.
            accept = self._rerun_check(rerun, mopt, step.loss, seen) if rerun is not None else None
            result = mopt.prepare_step(step.grad_scale, accept=accept)
            if result is not None:
                break
            assert rerun is not None  # only the rerun check's verdict withholds a step
            action = rerun.next_action()
            if action == "replay":
                rerun.restore(self.model)
                continue
            # 'skip' / 'exit': the update is dropped, as for an fp16 overflow (the LR schedule does not advance)
            mopt.zero_grad()
            mopt.skipped_steps += 1
            result = StepResult(grad_norm=seen["grad_norm"], skipped=True, loss_scale=mopt.loss_scale)
            break
        # a skipped (overflowing) step has no main gradients: the parameters stay unchanged
        (optimizer_step or mopt.optimizer.step)()
        mopt.finish_step(result)
        if rerun is not None:
            rerun.end_step()
        return step, result

    @staticmethod
    def _rerun_check(
        rerun: RerunStateMachine, mopt: MegatronOptimizer, loss: torch.Tensor, seen: dict
    ) -> Callable[[torch.Tensor], bool]:
        """The rerun state machine's verdict on this attempt, given the global gradient norm (fp16 loss
        scaling skips overflowing gradients itself: then only the loss is validated)."""

        def accept(norm: torch.Tensor) -> bool:
            seen["grad_norm"] = norm
            return rerun.validate(loss, norm if mopt.loss_scaler is None else None)

        return accept

    @torch.no_grad()
    def reduce_shared_embedding_grads(self) -> None:
        """Sum the gradients of a tied embedding over its copies on the first and last stage, so both
        take the same step (Megatron's embedding group all-reduce)."""
        group = self.layout.group("embedding")
        if not self._shared or group is None or self.optimizer is None:
            return
        with timed(self.timers, "embedding-grads-all-reduce", log_level=1):
            for name, _ in self._shared:
                dist.all_reduce(self.optimizer.gradient_buffer(name), group=group)

    # --- forward only ------------------------------------------------------------------------
    @torch.no_grad()
    def forward_outputs(
        self, microbatches: Sequence[dict], forward_step: Optional[Callable] = None
    ) -> list[torch.Tensor]:
        """The last stage's outputs of every microbatch (forward only, no loss), on every rank of the
        pipeline (broadcast from the last stage). ``forward_step`` replaces the objective's (e.g. to
        return logits instead of a loss)."""
        step = forward_step or self.objective.forward_step
        if not self.pipelined:
            return [step(self.parts[0], mb, None) for mb in microbatches]
        result = self._run(microbatches, forward_only=True, loss=False, keep_outputs=True, forward_step=step)
        group = self.layout.group("pp")
        assert group is not None  # pipelined: pp_size > 1
        last = dist.get_global_rank(group, self.layout.config.last_stage_pp_rank)
        outputs = []
        for index in range(len(microbatches)):
            if self.layout.is_last_pipeline_stage:
                out = result.outputs[index].contiguous()
                meta = torch.tensor(
                    [out.ndim, DTYPES.index(out.dtype), *out.shape, *([0] * (6 - out.ndim))], dtype=torch.int64
                )
            else:
                meta = torch.zeros(8, dtype=torch.int64)
            meta = meta.to(self.device)
            dist.broadcast(meta, last, group=group)
            meta = meta.cpu()
            if not self.layout.is_last_pipeline_stage:
                out = torch.empty(meta[2 : 2 + int(meta[0])].tolist(), dtype=DTYPES[int(meta[1])], device=self.device)
            dist.broadcast(out, last, group=group)
            outputs.append(out)
        return outputs
