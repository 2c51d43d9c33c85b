"""The rerun state machine: validate each step's loss and gradient norm, replay a rejected step on the
same microbatches, and tell a transient fault (the replay differs) from a reproducible one (the same).

Semantics follow Megatron-LM's ``rerun_state_machine.py`` (DESIGN.md §3 "Rerun state machine"); plain
PyTorch, driven by :meth:`megatron_lite.core.engine.TrainingEngine.train_step`:

1. :meth:`RerunStateMachine.begin_step` snapshots what a replay must restore: the RNG streams (global
   generators and the model's dropout streams), so that a replay on healthy hardware computes the
   same numbers.
2. After the forward/backward, once the gradients are reduced and their global norm is known but
   *before* the optimizer has touched anything, :meth:`validate` checks the loss and the norm: NaN, Inf,
   or a spike (>= ``spike_factor`` x the largest of the first ``spike_window`` accepted values). Every
   rank reaches the same verdict (one all-reduce of a flag, as Megatron's ``_reduce_any``).
3. A rejected first attempt is replayed (:meth:`next_action` says ``"replay"``; the engine zeroes the
   gradients and runs the schedule again after :meth:`restore`). The replay's values are compared
   with the first attempt's, bit for bit (NaN equals NaN): different means a *transient* fault (the
   replay's values are used if they validate), the same means *reproducible*, and the policy decides:
   ``"continue"`` (apply the step anyway), ``"skip"`` (drop the update, as an fp16 overflow does) or
   ``"exit"`` (skip, then the caller saves a checkpoint and exits with :data:`EXIT_CODE_RESUME_TO_DISAMBIGUATE`,
   Megatron's 16: restart the job on other hardware).

A :class:`FaultInjection` (``RerunConfig(inject=...)`` or the environment variable
:data:`INJECT_ENV`) makes a step's loss NaN/Inf/huge, or its gradients NaN, for tests and drills.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, cast

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.parallel.random import model_rng_state, restore_model_rng_state

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
"""Megatron's exit code for "a reproducible fault: restart from the checkpoint, elsewhere"."""

INJECT_ENV = "MEGATRON_LITE_INJECT_FAULT"
"""Environment variable with a fault to inject (see :meth:`FaultInjection.parse`); the config's wins."""

Policy = Literal["continue", "skip", "exit"]
POLICIES = ("continue", "skip", "exit")
Action = Literal["accept", "replay", "continue", "skip", "exit"]

FaultKind = Literal["nan", "inf", "spike"]
FaultTarget = Literal["loss", "grad"]
_INJECTION = re.compile(r"^(nan|inf|spike)_(loss|grad)@(\d+)(?::(once|always))?(?::rank(\d+))?$")


@dataclass(frozen=True)
class FaultInjection:
    """A fault to inject into one step (counted in optimizer steps, 0-based: Lightning's ``global_step``)."""

    kind: FaultKind
    """NaN, Inf, or a spike (the loss x ``SPIKE_FACTOR``)."""
    target: FaultTarget
    """The loss (its gradients follow), or only the gradients (the loss stays finite)."""
    step: int
    """The optimizer step to inject into."""
    always: bool = False
    """Inject into every attempt of the step (a reproducible fault); else the first attempt only (transient)."""
    rank: Optional[int] = None
    """Only this global rank (a faulty device); None: every rank."""

    SPIKE_FACTOR = 1000.0

    @classmethod
    def parse(cls, text: str) -> "FaultInjection":
        """``<nan|inf|spike>_<loss|grad>@<step>[:once|:always][:rank<r>]``, e.g. ``nan_loss@3``,
        ``nan_loss@3:always``, ``nan_grad@5:once:rank1``."""
        match = _INJECTION.match(text.strip())
        if match is None:
            raise ValueError(
                f"fault injection {text!r} is not <nan|inf|spike>_<loss|grad>@<step>[:once|:always][:rank<r>]; "
                f"e.g. 'nan_loss@3' (once: a transient fault) or 'nan_loss@3:always' (a reproducible one)"
            )
        kind, target, step, times, rank = match.groups()
        # the pattern's alternatives are exactly the Literal values
        return cls(
            kind=cast(FaultKind, kind),
            target=cast(FaultTarget, target),
            step=int(step),
            always=times == "always",
            rank=None if rank is None else int(rank),
        )

    def applies(self, step: int, attempt: int, rank: int) -> bool:
        return step == self.step and (self.always or attempt == 0) and self.rank in (None, rank)


def _finite_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 1:
        raise ValueError(f"RerunConfig({name}={value!r}): {name} must be a finite number > 1, e.g. 10.0")


@dataclass
class RerunConfig:
    """What the rerun state machine validates and what it does about a reproducible fault."""

    check_loss: bool = True
    """Reject a NaN/Inf loss, and a loss spike."""
    check_grad_norm: bool = True
    """Reject a NaN/Inf gradient norm (not under fp16 loss scaling: there an overflow skips the step anyway)."""
    check_grad_norm_spikes: bool = False
    """Also reject grad-norm spikes (off by default: norms legitimately grow 10x early in training)."""
    spike_factor: float = 10.0
    """A value >= spike_factor x the largest of the first spike_window accepted values is a spike."""
    spike_window: int = 100
    """Accepted values that set the spike reference; spikes are checked once that many were seen."""
    on_reproducible: Policy = "exit"
    """On a reproduced fault: 'continue', 'skip' the update, or 'exit' (skip, save, exit with code 16)."""
    inject: Optional[str] = None
    """A fault to inject (FaultInjection.parse syntax, e.g. 'nan_loss@3'); None: the environment variable, if set."""

    def __post_init__(self) -> None:
        _finite_positive("spike_factor", self.spike_factor)
        if isinstance(self.spike_window, bool) or not isinstance(self.spike_window, int) or self.spike_window < 1:
            raise ValueError(
                f"RerunConfig(spike_window={self.spike_window!r}) must be a positive number of steps, e.g. 100"
            )
        if self.on_reproducible not in POLICIES:
            raise ValueError(f"RerunConfig(on_reproducible={self.on_reproducible!r}) must be one of {POLICIES}")
        self.injection()  # a malformed injection fails here, not at the step

    def injection(self) -> Optional[FaultInjection]:
        """The configured fault, else the one in :data:`INJECT_ENV`, else None."""
        text = self.inject if self.inject is not None else os.environ.get(INJECT_ENV)
        return FaultInjection.parse(text) if text else None


class _GradFault(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor`` (NaN/Inf gradients, finite loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


@dataclass
class RerunCounts:
    """What the machine saw so far in this run."""

    rejected: int = 0
    """First attempts that failed validation (each was replayed)."""
    transient: int = 0
    """Replays whose values differed from the first attempt's."""
    reproducible: int = 0
    """Replays that reproduced the first attempt's values."""
    skipped: int = 0
    """Steps whose update was dropped by the policy."""
    reasons: list = field(default_factory=list)
    """(step, what was rejected, verdict) per rejected step, for logs."""


class RerunStateMachine:
    """Validates each step and replays rejected ones; one per rank, the same decisions on every rank.

    Args:
        config: what to check and the policy.
        rank: this process's global rank (for a rank-targeted injection).
        group: the process group whose ranks must agree (None: the default group when initialised).
    """

    def __init__(
        self, config: Optional[RerunConfig] = None, rank: int = 0, group: Optional[dist.ProcessGroup] = None
    ) -> None:
        self.config = config or RerunConfig()
        self.injection = self.config.injection()
        self.rank, self.group = rank, group
        self.step = 0
        """The optimizer step being run (the Lightning callback keeps it at ``trainer.global_step``)."""
        self.counts = RerunCounts()
        self.exit_requested = False
        """Set when the policy 'exit' was applied: the caller saves and exits with code 16."""
        self._references: dict[str, list[float]] = {"loss": [], "grad_norm": []}
        self._attempt = 0
        self._first: Optional[tuple[float, float]] = None
        self._rng: dict[str, torch.Tensor] = {}
        self._rejection = ""

    # --- one step ----------------------------------------------------------------------------
    def begin_step(self, model: nn.Module) -> None:
        """Before the first attempt of a step: remember the RNG streams a replay restores."""
        self._attempt, self._first, self._rejection = 0, None, ""
        self._rng = model_rng_state(model)

    def restore(self, model: nn.Module) -> None:
        """Before a replay: the RNG streams as they were when the step began."""
        restore_model_rng_state(model, self._rng)

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` with this step's injected fault, if one applies to this attempt on this rank."""
        injection = self.injection
        if injection is None or not injection.applies(self.step, self._attempt, self.rank):
            return loss_fn
        factor = {"nan": math.nan, "inf": math.inf, "spike": FaultInjection.SPIKE_FACTOR}[injection.kind]

        def faulty(*args, **kwargs):
            loss_sum, *rest = loss_fn(*args, **kwargs)  # (sum, count) or (sum, count, report)
            if injection.target == "loss":
                return (loss_sum * factor, *rest)
            return (_GradFault.apply(loss_sum, factor), *rest)

        return faulty

    def validate(self, loss: torch.Tensor, grad_norm: Optional[torch.Tensor]) -> bool:
        """Whether this attempt's values may be applied (the same answer on every rank). ``grad_norm``
        None: not checked (fp16 loss scaling handles overflowing gradients itself)."""
        cfg = self.config
        loss_value = float(loss.detach().float().item())
        norm_value = float(grad_norm.detach().float().item()) if grad_norm is not None else 0.0
        problems = []
        if cfg.check_loss:
            problems += self._problems("loss", loss_value, spikes=True)
        if cfg.check_grad_norm and grad_norm is not None:
            problems += self._problems("grad_norm", norm_value, spikes=cfg.check_grad_norm_spikes)
        rejected = self._agree(bool(problems))
        values = (loss_value, norm_value)
        if self._attempt == 0:
            if not rejected:
                self._accept(values)
                return True
            self._first, self._rejection = values, ", ".join(problems) or "another rank's values"
            self.counts.rejected += 1
            self._action: Action = "replay"
            return False
        # a replay: compare with the first attempt, bit for bit (NaN == NaN), on every rank
        assert self._first is not None  # recorded when attempt 0 was rejected
        differs = self._agree(not all(_same(a, b) for a, b in zip(values, self._first)))
        verdict = "transient" if differs else "reproducible"
        setattr(self.counts, verdict, getattr(self.counts, verdict) + 1)
        self.counts.reasons.append((self.step, self._rejection, verdict))
        if differs and not rejected:  # a transient fault, and the replay is healthy: apply the replay
            self._action = "accept"
            self._accept(values)
            return True
        if not differs and cfg.on_reproducible == "continue":
            self._action = "continue"
            return True
        # a reproducible fault under 'skip'/'exit', or a replay that is bad too: drop the update
        self._action = "exit" if cfg.on_reproducible == "exit" else "skip"
        self.counts.skipped += 1
        self.exit_requested = self._action == "exit"
        return False

    def next_action(self) -> Action:
        """After :meth:`validate` returned False: ``"replay"`` (first attempt) or ``"skip"``/``"exit"``."""
        action = self._action
        if action == "replay":
            self._attempt += 1
        return action

    def end_step(self) -> None:
        """After the step (applied or skipped)."""
        self.step += 1

    # --- helpers -----------------------------------------------------------------------------
    def _problems(self, name: str, value: float, spikes: bool) -> list[str]:
        if math.isnan(value):
            return [f"{name} is NaN"]
        if math.isinf(value):
            return [f"{name} is Inf"]
        reference = self._references[name]
        if spikes and len(reference) >= self.config.spike_window:
            largest = max(reference)
            if largest > 0 and value >= self.config.spike_factor * largest:
                return [
                    f"{name} {value:.4g} >= {self.config.spike_factor:g} x {largest:.4g} (the largest of the first "
                    f"{self.config.spike_window})"
                ]
        return []

    def _accept(self, values: tuple[float, float]) -> None:
        for name, value in zip(("loss", "grad_norm"), values):
            reference = self._references[name]
            if len(reference) < self.config.spike_window and math.isfinite(value):
                reference.append(abs(value))

    def _agree(self, flag: bool) -> bool:
        """True when ``flag`` is set on any rank (one all-reduce of one integer)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(self.group) == 1:
            return flag
        backend = dist.get_backend(self.group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        tensor = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return bool(tensor.item())

    def state_dict(self) -> dict:
        """The spike references and counts (plain data), for checkpoints."""
        c = self.counts
        return {
            "references": {k: list(v) for k, v in self._references.items()},
            "rejected": c.rejected,
            "transient": c.transient,
            "reproducible": c.reproducible,
            "skipped": c.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self._references = {k: [float(x) for x in v] for k, v in state.get("references", {}).items()} or {
            "loss": [],
            "grad_norm": [],
        }
        for name in ("rejected", "transient", "reproducible", "skipped"):
            setattr(self.counts, name, int(state.get(name, 0)))


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b
