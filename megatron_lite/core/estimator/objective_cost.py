"""What one sample of a training objective's data costs the model, beyond pre-training's one sequence.

GPT pre-training runs each sample -- one sequence of ``seq_length`` tokens -- through one forward and one
backward. Other objectives do more per sample: a DPO pair is two sequences (chosen and rejected, one
microbatch of twice the rows) and, unless its log-probs were precomputed, a frozen reference model runs a
forward over both every step; a GRPO prompt becomes ``group_size`` sequences, each run forward for the old
log-probs (and the reference's, with a KL term) and then trained ``updates_per_batch`` times. The objective
(the LightningModule) says so with ``objective_cost(datamodule)``, and the FLOPs (the metrics callback's
TFLOP/s and MFU, ``megatron-lite estimate``) and the memory estimate (the microbatch's rows, the
reference's weights) count it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

FORWARD_AND_BACKWARD = 3  # backward = gradient w.r.t. the inputs + gradient w.r.t. the weights


@dataclass(frozen=True)
class ObjectiveCost:
    """One sample's work per training step, in sequences of ``seq_length`` tokens (pre-training: the defaults)."""

    sequences_per_sample: int = 1
    """Sequences one sample becomes: a microbatch of ``b`` samples runs ``b x`` this many rows (a DPO pair: 2,
    a packed row of pairs: 1, a GRPO prompt: ``group_size``)."""
    training_passes: int = 1
    """Forward-and-backward passes over each sequence per step (GRPO: ``updates_per_batch``)."""
    forward_only_passes: int = 0
    """Forward-only passes over each sequence per step (a reference model's, GRPO's old log-probs)."""
    frozen_models: int = 0
    """Frozen copies of the model held while training, each as large as its weights (a reference model)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value, least = getattr(self, f.name), 1 if f.name == "sequences_per_sample" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"ObjectiveCost.{f.name} must be an integer >= {least}, got {value!r}")

    @property
    def forwards_per_sample(self) -> int:
        """Forward passes of one sequence that a sample costs per step (a backward costs two)."""
        return self.sequences_per_sample * (FORWARD_AND_BACKWARD * self.training_passes + self.forward_only_passes)


def objective_cost(objective: Any, datamodule: Any = None) -> ObjectiveCost:
    """``objective.objective_cost(datamodule)`` where the objective defines it, else pre-training's cost."""
    method = getattr(objective, "objective_cost", None)
    cost = method(datamodule) if callable(method) else ObjectiveCost()
    if not isinstance(cost, ObjectiveCost):
        raise TypeError(f"{type(objective).__name__}.objective_cost() must return an ObjectiveCost, got {cost!r}")
    return cost
