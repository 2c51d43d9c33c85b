"""Speculative greedy generation: an EAGLE draft head proposes tokens, the base model verifies them.

Each round the draft head proposes ``k`` tokens autoregressively (cheap: one transformer layer), then the
base model runs ONE forward over the last accepted token and the ``k`` proposals, writing them into its
KV cache. Position j of that forward gives the base's own greedy choice after proposal j; the longest
prefix of proposals that matches those choices is accepted, plus the base's next token after it (always
one new token, so a round never does worse than a plain decode step). Rejected positions need no undoing:
the cache is static and a step only attends to slots up to its own, so the next round simply writes over
them. The draft head's own cache is rewritten the same way, from the base's true features of the
accepted positions (EAGLE feeds its own predicted features only within a round).

Every accepted token is one the base chose greedily given the tokens before it, so the output equals the
base's greedy :func:`~megatron_lite.core.inference.generate` token for token (up to floating-point ties:
a forward over k+1 positions may round a logit differently from one over 1 position).

Acceptance length (DESIGN §3) = generated tokens / base-model forward passes, counting the prefill;
plain greedy decoding scores exactly 1.

Prompts run one at a time (batch size 1: rows accept different numbers of tokens per round, so a batch
would need per-row cache positions). Tensor parallelism works through the model (every TP rank gathers
the same logits and makes the same exact choices); pipeline parallelism is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from megatron_lite.core.inference.expert_rounds import ExpertRounds
from megatron_lite.core.inference.generate import generation_mode, model_context
from megatron_lite.core.inference.kv_cache import InferenceStep, KVCache
from megatron_lite.core.inference.prompts import check_prompts, check_stop_ids
from megatron_lite.core.models.attention import rotary_tables
from megatron_lite.core.models.draft_head import EagleDraftHead, base_fingerprint
from megatron_lite.core.models.gpt import GPTModel
from megatron_lite.core.models.mtp import MTPLayer
from megatron_lite.core.parallel.vocab_padding import gather_real_vocab


@dataclass
class SpeculativeResult:
    """What :func:`speculative_generate` returns (the same on every rank of the replica)."""

    tokens: list[list[int]]
    """The new tokens of each prompt (a stop id that ended a row is its last token)."""
    stopped: list[bool]
    """Per prompt: True if it ended on a stop id, False if it ran to max_new_tokens."""
    base_forwards: list[int]
    """Per prompt: forward passes of the base model (the prefill included)."""
    draft_steps: list[int]
    """Per prompt: forward passes of the draft head."""

    @property
    def acceptance_length(self) -> float:
        """Generated tokens per base-model forward pass over every prompt (1.0 for plain greedy decoding)."""
        return sum(len(t) for t in self.tokens) / max(1, sum(self.base_forwards))


def check_draft(model: GPTModel, draft: Any, num_draft_tokens: int, check_base: bool = True) -> None:
    """One clear error when ``draft`` cannot draft for ``model`` (another base model -- compared only with
    ``check_base`` --, another layout, a head never trained) or ``num_draft_tokens`` is not an integer >= 1."""
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(
            f"num_draft_tokens must be an integer >= 1 (tokens proposed per base forward), got {num_draft_tokens!r}"
        )
    own_mtp = isinstance(draft, MTPLayer) and model.mtp is not None and any(d is draft for d in model.mtp.depths())
    if not isinstance(draft, EagleDraftHead) and not own_mtp:
        raise TypeError(
            f"draft must be an EagleDraftHead (trained with megatron_lite.callbacks.TrainDraftHead or "
            f"loaded with megatron_lite.post_training.load_draft_head) or the model's own MTP depth "
            f"(megatron_lite.core.models.mtp.mtp_draft(model)), got {type(draft).__name__}"
        )
    if model.layout.pp_size > 1:
        raise ValueError("speculative decoding runs the whole model on each rank: set pipeline_model_parallel_size=1")
    if ExpertRounds(model, model.layout).active:
        layout = model.layout
        raise ValueError(
            f"speculative decoding steps each replica on its own, but this MoE model's experts are folded over "
            f"other replicas (expert_model_parallel_size={layout.ep_size}, expert_tensor_parallel_size="
            f"{layout.etp_size}, tensor_model_parallel_size={layout.tp_size}), which must step together: use "
            f"generate(), or expert_model_parallel_size=1 and expert_tensor_parallel_size=tensor_model_parallel_size"
        )
    if model.output_layer is None:
        raise ValueError(
            "speculative decoding verifies the draft with the model's output layer: this model was built "
            "with output_layer=False"
        )
    if own_mtp:
        return  # part of the model: its layout, trained with it
    if draft.layout.tp_size != model.layout.tp_size or draft.layout.tp_rank != model.layout.tp_rank:
        raise ValueError(
            f"the draft head is built for TP rank {draft.layout.tp_rank} of {draft.layout.tp_size}, the "
            f"model for rank {model.layout.tp_rank} of {model.layout.tp_size}: load the draft head for "
            f"the model's layout (load_draft_head(path, model))"
        )
    if not check_base:
        return
    if draft.base is None:
        raise ValueError(
            "the draft head was never bound to a base model (it is untrained): train it with "
            "megatron_lite.callbacks.TrainDraftHead or load a trained one with load_draft_head"
        )
    problem = draft.base.mismatch(base_fingerprint(model))
    if problem is not None:
        raise ValueError(
            f"this draft head was trained for another base model: {problem}. A draft head only "
            f"predicts the model it was trained on; train one for this model with "
            f"megatron_lite.callbacks.TrainDraftHead"
        )


@torch.no_grad()
def speculative_generate(
    model: GPTModel,
    draft: EagleDraftHead | MTPLayer,
    prompts: Any,
    max_new_tokens: int,
    *,
    num_draft_tokens: int = 4,
    stop_ids: Optional[Iterable[int]] = None,
    check_base: bool = True,
) -> SpeculativeResult:
    """Greedy continuation of each of ``prompts`` (lists of token ids) by up to ``max_new_tokens`` tokens,
    ``num_draft_tokens`` proposed by ``draft`` (an EAGLE head, or the model's MTP depth: ``mtp_draft(model)``) per
    base forward. ``model`` is a GPTModel (one pipeline stage;
    any TP: every rank of its replica calls this with the same arguments). ``check_base`` compares the
    draft head's recorded base model with ``model`` first (hashes every weight: turn it off only when the
    same pair was just checked)."""
    config = model.config
    rows = check_prompts(prompts, max_new_tokens, config.vocab_size, model_context(config))
    stops = check_stop_ids(stop_ids, config.vocab_size)
    check_draft(model, draft, num_draft_tokens, check_base=check_base)
    result = SpeculativeResult([], [], [], [])
    was_training = draft.training
    draft.eval()
    try:
        with generation_mode(model):
            for row in rows:
                tokens, forwards, steps = _Speculator(model, draft, len(row) + max_new_tokens).run(
                    row, max_new_tokens, num_draft_tokens, stops
                )
                result.tokens.append(tokens)
                result.stopped.append(bool(tokens) and tokens[-1] in stops)
                result.base_forwards.append(forwards)
                result.draft_steps.append(steps)
    finally:
        draft.train(was_training)
    return result


class _Speculator:
    """The state of one prompt's speculative decoding: the base's and the draft head's KV caches, and the
    per-position tables every step slices (positions, RoPE, causal mask: built once, not per forward).

    Tokens stay on the device from the draft head's argmax to the verify pass: a round reads the host once
    (its proposals and the base's choices together, to count what is accepted), so drafting never waits on
    the device."""

    def __init__(self, model: GPTModel, draft: EagleDraftHead | MTPLayer, max_len: int):
        self.model, self.draft = model, draft
        # check_draft: one pipeline stage (it embeds and ends the model) with its output layer
        assert model.embedding is not None and model.final_layernorm is not None and model.output_layer is not None
        self.embedding, self.final_layernorm, self.output_layer = (
            model.embedding,
            model.final_layernorm,
            model.output_layer,
        )
        self.tp_group = model.layout.group("tp") if model.layout.tp_size > 1 else None
        self.device = next(model.parameters()).device
        self.cache = KVCache.for_model(model, 1, max_len)
        self.draft_cache = KVCache.for_layers(
            model, [0], 1, max_len, like=draft
        )  # the draft's layer has the model's shape
        self.output_weight = model._output_weight()
        self.base_forwards = self.draft_steps = 0
        # Every slot's tables, sliced per step: RoPE is elementwise in the position, so a slice holds the bits
        # a per-step computation would give.
        self.positions = torch.arange(max_len, device=self.device).unsqueeze(0)  # [1, max_len]
        rotary = model.rotary
        self.rope = rotary_tables(*(t.unsqueeze(3) for t in rotary(self.positions))) if rotary is not None else None
        self.causal = torch.ones(max_len, max_len, dtype=torch.bool, device=self.device).tril()

    def run(self, row: list[int], max_new_tokens: int, k: int, stops: tuple[int, ...]) -> tuple[list[int], int, int]:
        try:
            return self._run(row, max_new_tokens, k, stops), self.base_forwards, self.draft_steps
        finally:
            self.cache.free()
            self.draft_cache.free()

    def _run(self, row: list[int], max_new_tokens: int, k: int, stops: tuple[int, ...]) -> list[int]:
        if max_new_tokens == 0:
            return []
        prompt = torch.tensor(row, dtype=torch.int64, device=self.device)
        features, greedy = self._base(prompt, 0)  # the prefill
        out = [int(greedy[-1])]
        # The draft head's inputs at slot p are (feature of base slot p, token of base slot p+1).
        pending_features, pending_tokens, draft_start = features, torch.cat([prompt[1:], greedy[-1:]]), 0
        position = len(row)  # base-cache slot of the newest token (not yet run through the base)
        newest = greedy[-1:]
        while len(out) < max_new_tokens and out[-1] not in stops:
            count = min(k, max_new_tokens - len(out) - 1)
            proposals = self._propose(pending_features, pending_tokens, draft_start, count)
            features, greedy = self._base(torch.cat([newest, proposals]), position)
            # The round's one read of the host: the proposals and the base's choice after each.
            chosen = torch.cat([proposals, greedy]).tolist()
            drafted, verified = chosen[:count], chosen[count:]
            accepted = 0
            while accepted < count and drafted[accepted] == verified[accepted]:
                accepted += 1
            # accepted proposals equal the base's choices, so the new tokens are the base's first accepted + 1
            pending_features, pending_tokens, draft_start = features[: accepted + 1], greedy[: accepted + 1], position
            newest = greedy[accepted : accepted + 1]
            position += accepted + 1
            for token in verified[: accepted + 1]:
                out.append(token)
                if token in stops:
                    break
        return out

    def _step(self, start: int, length: int, cache: Optional[KVCache]) -> InferenceStep:
        end = start + length
        # One query sees every cached slot; several after cached slots need the causal mask offset by `start`.
        mask = self.causal[start:end, :end].view(1, 1, length, end) if length > 1 and start > 0 else None
        return InferenceStep(start=start, positions=self.positions[:, start:end], mask=mask, cache=cache)

    def _rope(self, step: InferenceStep):
        if self.rope is None:
            return None
        start, length = step.start, step.positions.shape[1]
        return tuple(t.narrow(0, start, length) for t in self.rope)

    def _greedy(self, features: torch.Tensor) -> torch.Tensor:
        """The base's greedy token [s] after each of ``features`` [s, 1, h] (the output layer's input)."""
        local = self.output_layer(features, self.output_weight)[:, 0].float()  # [s, V_padded/tp]
        return gather_real_vocab(local, self.tp_group, self.model.config.vocab_size).argmax(dim=-1)

    def _base(self, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` [s] through the base at cache slots ``start..``: (their features [s, 1, h], the greedy
        token after each [s])."""
        model = self.model
        step = self._step(start, tokens.shape[0], self.cache)
        rope = self._rope(step)
        x = model._embed(tokens.unsqueeze(0), step.positions)  # the model's own embedding (word + learned positions)
        for i in model.chunks[0].stage.layers:
            x = model.layer(i).inference_forward(x, rope, step.kv(i), step)
        features = self.final_layernorm(x)
        self.base_forwards += 1
        return features, self._greedy(features)

    def _propose(self, features: torch.Tensor, tokens: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """``count`` draft tokens [count]: the head first reads the pending (true) features at slots ``start..``
        (``tokens`` [n] the tokens after them), then its own predictions, one slot at a time."""
        proposals = []
        slot = start
        for _ in range(count):
            step = self._step(slot, tokens.shape[0], None)
            embeddings = self.embedding(tokens.unsqueeze(1))  # [n, 1, h]
            predicted = self.draft.inference_forward(
                features, embeddings, self._rope(step), self.draft_cache.layers[0], step
            )[-1:]
            self.draft_steps += 1
            slot += tokens.shape[0]
            tokens = self._greedy(predicted)
            proposals.append(tokens)
            features = predicted
        return torch.cat(proposals) if proposals else torch.empty(0, dtype=torch.int64, device=self.device)
