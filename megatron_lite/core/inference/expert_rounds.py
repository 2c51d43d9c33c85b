"""Generation steps of several model replicas kept in lockstep where they share experts.

Under Megatron's MoE parallel folding the experts of a pipeline stage run on the ETP x EP group, read out of the
TP x CP x DP ranks: one expert group spans several data-parallel replicas (and context-parallel ranks). Each
forward of an MoE layer exchanges tokens over that whole group, so every rank of it must run as many MoE
forwards as every other. Generation breaks that: replicas continue their own prompts (GRPO gives each DP rank
its own), with their own batch sizes, lengths, ``max_new_tokens`` and stop tokens, so they need different
numbers of steps, and a data loader may even give them different numbers of batches.

Hence rounds. Before each of its forwards a rank says, in one small all-reduce (MAX) over the ETP x EP group,
what it is doing this round: running a forward (``FORWARD``), inside a generation but out of forwards
(``DRAINING``), or done with generating altogether (``DONE``). A rank that is not running a forward but sees
that some other rank is takes part with an *idle step*: each of its MoE layers serves its experts to the
others without tokens of its own (:meth:`MoELayer.idle_exchange`), so the group's exchanges still pair up.
A generation ends on the first round where no rank runs a forward. Every generation call (with equal numbers
of calls per rank, as in GRPO) therefore needs nothing more; a caller whose ranks may make different numbers of
calls (``trainer.predict``'s data-parallel split) ends with :func:`finish_generation` on every rank, which
takes part in the others' remaining generations until all of them are done too.

The rounds cost nothing when the experts are laid out like the dense layers (no folding: the expert group is
the replica's own TP group, which steps together anyway) or the model has no MoE layer on this rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from megatron_lite.core.models.gpt import GPTModel
    from megatron_lite.core.models.moe.layer import MoELayer

FORWARD, DRAINING, DONE = 2, 1, 0
"""What a rank does in a round (the all-reduce takes their maximum)."""


class ExpertRounds:
    """The rounds of this rank's expert group for ``model`` (this rank's stages) under ``layout``."""

    def __init__(self, model: nn.Module, layout: ParallelLayout):
        from megatron_lite.core.models.moe.layer import MoELayer

        # In the order a forward runs them: the layers are registered in execution order (stage by stage).
        self.moe_layers: list[MoELayer] = [m for m in model.modules() if isinstance(m, MoELayer)]
        group = layout.group("ep_etp") if layout.mesh is not None and layout.experts_folded else None
        self.group: Optional[dist.ProcessGroup] = (
            group if self.moe_layers and group is not None and dist.get_world_size(group) > 1 else None
        )
        self.device = next(model.parameters()).device

    @property
    def active(self) -> bool:
        """Whether this rank's expert group spans other replicas (or CP ranks): rounds are then kept."""
        return self.group is not None

    def _round(self, state: int) -> int:
        flag = torch.tensor([state], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def before_forward(self) -> None:
        """Announce a forward (call right before each of this rank's generation forwards)."""
        if self.group is not None:
            self._round(FORWARD)

    def idle_step(self) -> None:
        """One forward's worth of expert exchanges without tokens (every MoE layer of this rank once)."""
        for layer in self.moe_layers:
            layer.idle_exchange()

    def drain(self) -> None:
        """After this rank's last forward of a generation: serve the other ranks' forwards until none is left."""
        if self.group is None:
            return
        while self._round(DRAINING) == FORWARD:
            self.idle_step()

    def finish(self) -> None:
        """After this rank's last generation call: serve the other ranks' remaining forwards, through any number
        of their further generation calls, until every rank of the group is done too."""
        if self.group is None:
            return
        while (state := self._round(DONE)) != DONE:
            if state == FORWARD:
                self.idle_step()


@torch.no_grad()
def finish_generation(model: GPTModel, layout: Optional[ParallelLayout] = None) -> None:
    """Call on every rank once its generation calls are over when data-parallel replicas that share experts may
    make different numbers of calls (see the module docstring); returns when every rank of this rank's expert
    group has called it. Nothing to do (and no collective) without folded experts. Run it under the same
    precision context (autocast) as the generation calls: the idle steps' experts must compute in the same
    dtype as the other ranks' forwards."""
    ExpertRounds(model, layout if layout is not None else model.layout).finish()
