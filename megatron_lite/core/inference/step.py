"""One prefill or decode step of a model replica, across its tensor- and pipeline-parallel ranks.

Every rank of the replica knows the step's shapes (the same prompts, the same tokens so far), so
the pipeline needs no shape headers and no schedule: each stage receives the previous stage's
activations ``[s, b, h]`` (tagged with the receiving virtual stage, so interleaved chunks travel
the ring in order), runs its chunk and sends the result on. That is the cheapest correct pipeline
for decoding: a decode step is one token per row, the next step depends on its result, and there
is nothing to overlap inside one step.

One rank per replica chooses the tokens — the *sampler*: the last pipeline stage's TP rank 0
(context-parallel rank 0). The TP ranks' logits slices are gathered there only, and the chosen
tokens (with their log-probs) are broadcast to every rank of the replica (the ``mp`` group) in
one collective per step. The alternative, every TP rank sampling from the same all-gathered logits
with identically seeded generators, needs no broadcast but relies on every rank's softmax, top-p
sort and RNG giving bit-identical results; one differing bit on one rank (another kernel, another
device type) would silently feed different tokens to different ranks — wrong text, or under PP a
hang. The broadcast cannot diverge, and under PP the tokens must reach the first stage anyway.

Greedy decoding under tensor parallelism alone needs neither: every TP rank takes the best token of its
vocabulary slice, and one all-gather of (best logit, its id, its word-embedding row, the slice's
log-sum-exp) gives every rank the winner — a choice made by exact comparisons of bit-identical copies,
so it cannot diverge — and the next step's embedding, so the lookup's all-reduce goes too: a decode step
waits on ``2 x layers + 1`` collectives instead of ``2 x layers + 3``. On CPU each of a decode step's sums
is one gloo all-gather round, not an all-reduce's two (``mappings.sum_in_one_round``); below that the floor is
gloo's latency, a round trip per collective (``benchmarks/generate.py --tp-decode-only``).

Generation runs whole rows: context-parallel ranks other than 0 (which hold the same weights)
compute nothing and only receive the broadcast tokens — unless the experts are folded over them (the ETP x EP
group of an MoE layer reads CP ranks as expert ranks): their experts are then needed, so every CP rank runs the
model on the same rows, and steps in rounds with the other ranks of its expert group (``expert_rounds.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_lite.core.inference.expert_rounds import ExpertRounds
from megatron_lite.core.inference.kv_cache import InferenceStep
from megatron_lite.core.parallel.layout import MESH_DIMS, ParallelLayout
from megatron_lite.core.parallel.mappings import all_gather_into_tensor

if TYPE_CHECKING:
    from megatron_lite.core.models.gpt import GPTModel


def _mesh_rank(layout: ParallelLayout, **coords: int) -> int:
    """Global rank of the mesh point with this rank's coordinates, overridden by ``coords``."""
    assert layout.mesh is not None  # asked only when distributed
    point = [coords.get(name, layout.coords.get(name, 0)) for name in MESH_DIMS]
    return int(layout.mesh.mesh[tuple(point)])


def _group(layout: ParallelLayout, name: str):
    """The layout's process group ``name``, or None when it holds this rank alone (no collective to issue)."""
    group = layout.group(name) if layout.mesh is not None else None
    return group if group is not None and dist.get_world_size(group) > 1 else None


class StepRunner:
    """Runs generation steps of ``model`` (this rank's part of one replica under ``layout``)."""

    def __init__(self, model: GPTModel, layout: ParallelLayout):
        self.model, self.layout = model, layout
        self.vocab_size = model.config.vocab_size
        self.hidden_size = model.config.hidden_size
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        distributed = layout.mesh is not None
        self.rounds = ExpertRounds(model, layout)
        """Keeps the ranks of a folded expert group stepping together (see the module docstring)."""
        self.computes = layout.cp_rank == 0 or self.rounds.active
        """Whether this rank runs the model (context-parallel ranks > 0 only follow the tokens, unless their
        experts serve the others)."""
        self.sampler_rank = _mesh_rank(layout, pp=layout.config.last_stage_pp_rank, cp=0, tp=0) if distributed else 0
        self.is_sampler = layout.rank == self.sampler_rank
        """Whether this rank chooses the tokens."""
        self.mp_group = _group(layout, "mp")
        self.tp_group = _group(layout, "tp")
        self.tp_root = _mesh_rank(layout, tp=0) if distributed else 0
        self.pp_group = _group(layout, "pp")
        self.layout = layout
        self.chunks = list(getattr(model, "chunks", None) or [])
        self.exchanges_greedy = layout.tp_size > 1 and layout.pp_size == 1 and layout.cp_size == 1
        """Whether greedy tokens come from one all-gather over TP (see the module docstring)."""

    def __call__(self, tokens: torch.Tensor, step: InferenceStep) -> Optional[torch.Tensor]:
        """Run ``tokens`` [b, s] through this rank's chunks; returns the last position's logits over the real
        vocabulary [b, vocab_size] (fp32) on the sampler, None on every other rank."""
        self.rounds.before_forward()
        if not self.computes:
            return None
        b, s = tokens.shape
        sends, logits = [], None
        x: Optional[torch.Tensor] = None
        held = {chunk.stage.virtual_stage for chunk in self.chunks}
        for index, chunk in enumerate(self.chunks):
            stage = chunk.stage
            if not stage.pre_process and stage.virtual_stage - 1 not in held:
                x = torch.empty(s, b, self.hidden_size, dtype=self.dtype, device=self.device)
                source = _mesh_rank(self.layout, pp=self.layout.config.stage_pp_rank(stage.virtual_stage - 1))
                dist.recv(x, source, group=self.pp_group, tag=stage.virtual_stage)
            # else: the first stage, or (V placement) the previous stage is this rank's other chunk: x is its output
            out = self.model.inference_forward(tokens, step, hidden_states=x, chunk=index)
            if stage.post_process:
                logits = out
            elif stage.virtual_stage + 1 in held:
                x = out
            else:
                out = out.contiguous()
                target = _mesh_rank(self.layout, pp=self.layout.config.stage_pp_rank(stage.virtual_stage + 1))
                sends.append((dist.isend(out, target, group=self.pp_group, tag=stage.virtual_stage + 1), out))
        for work, _ in sends:
            if work is not None:  # None: this rank is not in the group, nothing was sent
                work.wait()
        if logits is None:
            return None
        return self._gather_vocab(logits)

    def greedy(
        self, tokens: torch.Tensor, step: InferenceStep, embeddings: Optional[torch.Tensor], with_log_probs: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """Greedy step under TP alone: (chosen tokens [b], their log-probs [b] or None, their word embeddings
        [1, b, h] for the next step), the same on every TP rank."""
        self.rounds.before_forward()
        local = self.model.inference_forward(tokens, step, embeddings=embeddings).float()  # [b, V_padded/tp]
        start = self.model.vocab_start
        real = max(0, min(local.shape[-1], self.vocab_size - start))  # the rest is vocabulary padding
        b, h = local.shape[0], self.hidden_size
        mine = torch.zeros(b, h + 3, dtype=torch.float64, device=self.device)  # best, id, lse, embedding row
        if real:
            best, index = local[:, :real].max(dim=-1)  # ties: the first, as argmax over the whole vocabulary
            mine[:, 0], mine[:, 1] = best, index + start
            mine[:, 2] = torch.logsumexp(local[:, :real], dim=-1) if with_log_probs else 0.0
            assert self.model.embedding is not None  # one pipeline stage (exchanges_greedy): it embeds
            mine[:, 3:] = self.model.embedding.weight[index]
        else:
            mine[:, 0] = mine[:, 2] = float("-inf")
        every = torch.empty(self.layout.tp_size * b, h + 3, dtype=torch.float64, device=self.device)
        all_gather_into_tensor(every, mine, group=self.tp_group)
        every = every.view(self.layout.tp_size, b, h + 3)
        winner = every[:, :, 0].argmax(dim=0)  # ties: the lowest rank, i.e. the lowest token id
        picked = every.gather(0, winner.view(1, b, 1).expand(1, b, h + 3))[0]
        log_probs = picked[:, 0] - torch.logsumexp(every[:, :, 2], dim=0) if with_log_probs else None
        return picked[:, 1].to(torch.int64), log_probs, picked[:, 3:].to(self.dtype).unsqueeze(0)

    def _gather_vocab(self, local: torch.Tensor) -> Optional[torch.Tensor]:
        """This TP rank's logits [b, V_padded/tp] -> the full real vocabulary [b, vocab_size] on TP rank 0."""
        local = local.float().contiguous()
        if self.layout.cp_rank > 0:  # it computed for its experts' sake; the sampler is on CP rank 0
            return None
        if self.tp_group is None:
            return local[:, : self.vocab_size]
        if self.layout.tp_rank != 0:
            dist.gather(local, None, dst=self.tp_root, group=self.tp_group)
            return None
        parts = [torch.empty_like(local) for _ in range(self.layout.tp_size)]
        dist.gather(local, parts, dst=self.tp_root, group=self.tp_group)
        full = torch.cat(parts, dim=-1)[:, : self.vocab_size]
        return full if self.is_sampler else None

    def share(self, payload: torch.Tensor) -> torch.Tensor:
        """The sampler's ``payload`` on every rank of the replica (in place; one broadcast)."""
        if self.mp_group is not None:
            dist.broadcast(payload, self.sampler_rank, group=self.mp_group)
        return payload
