"""Text generation with the core GPT model: prefill the prompts into a KV cache, then decode one token
per row per step, under any TP/PP layout.

Every rank of a model replica calls :func:`generate` with the same arguments (the tokens they get
back are the same). Log-probs are those of the model's own distribution — ``log_softmax`` of the raw
full-vocabulary logits at temperature 1, before top-k/top-p — of the chosen tokens: equal to a
teacher-forced forward of the generated sequence, which is what RL's importance ratios need. A row
stops after a stop id (included in its tokens) or after ``max_new_tokens``; the batch stops when
every row has.

With an MoE model whose experts are folded over data-parallel replicas (``expert_model_parallel_size > 1``),
the replicas' generations step in rounds (``expert_rounds.py``): each replica may continue its own prompts,
as many as it likes, to its own ``max_new_tokens``, but every rank of the expert group must call
:func:`generate` as many times as the others (or end with
:func:`~megatron_lite.core.inference.expert_rounds.finish_generation`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from megatron_lite.core.inference.expert_rounds import ExpertRounds
from megatron_lite.core.inference.kv_cache import InferenceStep, KVCache
from megatron_lite.core.inference.prompts import PromptBatch, attention_mask, check_prompts, check_stop_ids, left_pad
from megatron_lite.core.inference.sampling import SamplingParams, TokenSampler, token_log_probs
from megatron_lite.core.inference.step import StepRunner
from megatron_lite.core.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from megatron_lite.core.models.gpt import GPTModel


@dataclass
class GenerationResult:
    """What :func:`generate` returns (the same on every rank of the replica)."""

    tokens: list[list[int]]
    """The new tokens of each prompt (a stop id that ended a row is its last token)."""
    log_probs: Optional[list[list[float]]]
    """log p(token) of each new token under the model (temperature 1, unfiltered); None unless asked for."""
    stopped: list[bool]
    """Per prompt: True if it ended on a stop id, False if it ran to max_new_tokens."""


def model_context(config: Any) -> int:
    """How many positions a model can take: its position table (``max_position_embeddings``, which
    defaults to ``seq_length``)."""
    return int(getattr(config, "max_position_embeddings", None) or config.seq_length)


@contextlib.contextmanager
def generation_mode(model: GPTModel) -> Iterator[None]:
    """Eval mode, whole rows (sequence and context parallelism off) and, under FSDP2, the parameters
    gathered once for the whole generation rather than per layer per token; all restored afterwards."""
    was_training = model.training
    sequence_parallel = getattr(model, "sequence_parallel", False)
    fsdp_units = _fsdp_units(model)
    model.eval()
    if sequence_parallel:
        model.set_sequence_parallel(False)
    whole = model.whole_sequence() if hasattr(model, "whole_sequence") else contextlib.nullcontext()
    try:
        for unit in fsdp_units:
            unit.unshard()
        with whole:
            yield
    finally:
        for unit in fsdp_units:
            unit.reshard()
        if sequence_parallel:
            model.set_sequence_parallel(True)
        model.train(was_training)


def _fsdp_units(model: nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@torch.no_grad()
def generate(
    model: GPTModel,
    prompts: Any,
    max_new_tokens: int,
    sampling: Optional[SamplingParams] = None,
    *,
    stop_ids: Optional[Iterable[int]] = None,
    return_log_probs: bool = False,
    use_cache: bool = True,
    row_ids: Optional[Sequence[int]] = None,
    layout: Optional[ParallelLayout] = None,
) -> GenerationResult:
    """Continue each of ``prompts`` (lists of token ids, of any lengths) by up to ``max_new_tokens`` tokens.

    ``model`` is a :class:`~megatron_lite.core.models.GPTModel` (this rank's stages under pipeline
    parallelism); every rank of its replica must call this with the same arguments. ``sampling``
    defaults to greedy. ``row_ids`` name the prompts for their sampling generators (default 0..b-1;
    give global indices to make a prompt's samples independent of how prompts are batched).
    ``use_cache=False`` recomputes the whole sequence for every new token (the reference the cache is
    tested against; slow). Bad input raises one ValueError/TypeError naming the fix, before any work.
    """
    sampling = sampling if sampling is not None else SamplingParams()
    config = model.config
    rows = check_prompts(prompts, max_new_tokens, config.vocab_size, model_context(config))
    stops = check_stop_ids(stop_ids, config.vocab_size)
    if row_ids is not None and len(row_ids) != len(rows):
        raise ValueError(f"row_ids has {len(row_ids)} entries for {len(rows)} prompts; give one per prompt")
    layout = layout if layout is not None else model.layout
    if max_new_tokens == 0:
        ExpertRounds(model, layout).drain()  # no forward of its own, but other replicas' may need its experts
        return GenerationResult(
            [[] for _ in rows], [[] for _ in rows] if return_log_probs else None, [False] * len(rows)
        )
    with generation_mode(model):
        return _decode(
            model,
            layout,
            rows,
            max_new_tokens,
            sampling,
            stops,
            return_log_probs,
            use_cache,
            row_ids if row_ids is not None else range(len(rows)),
        )


def _decode(
    model: GPTModel,
    layout: ParallelLayout,
    rows: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams,
    stops: tuple[int, ...],
    return_log_probs: bool,
    use_cache: bool,
    row_ids: Sequence[int],
) -> GenerationResult:
    runner = StepRunner(model, layout)
    batch = left_pad(rows, runner.device, width_after=max_new_tokens)
    b, width = batch.tokens.shape
    sampler = TokenSampler(sampling, row_ids, runner.device) if runner.is_sampler else None
    cache = KVCache.for_model(model, b, width + max_new_tokens) if use_cache and runner.computes else None
    stop_tensor = torch.tensor(stops, dtype=torch.int64, device=runner.device)
    # On the device, copied to the host once at the end: a per-token copy would sync a GPU every step.
    new_tokens = torch.empty(b, max_new_tokens, dtype=torch.int64, device=runner.device)
    log_probs = torch.empty(b, max_new_tokens, dtype=torch.float64, device=runner.device) if return_log_probs else None
    lengths = torch.full((b,), max_new_tokens, dtype=torch.int64, device=runner.device)
    finished = torch.zeros(b, dtype=torch.bool, device=runner.device)
    payload = torch.empty(b * (2 if return_log_probs else 1), dtype=torch.float64, device=runner.device)
    inputs, sequence, embeddings = batch.tokens, batch.tokens, None
    exchange = sampling.greedy and runner.exchanges_greedy
    try:
        step = _step(batch, 0, width, cache)
        for t in range(max_new_tokens):
            if exchange:  # greedy under TP alone: one all-gather chooses (see step.py)
                chosen, lps, embeddings = runner.greedy(inputs, step, embeddings, return_log_probs)
                embeddings = embeddings if cache is not None else None  # recompute embeds the whole sequence
            else:
                logits = runner(inputs, step)
                if sampler is not None:
                    assert logits is not None  # the runner returns logits on the sampler's rank
                    chosen = sampler(logits)
                    payload[:b] = chosen
                    if return_log_probs:
                        payload[b:] = token_log_probs(logits, chosen)
                runner.share(payload)  # token ids < 2**53 are exact in float64
                chosen, lps = payload[:b].to(torch.int64), payload[b:]
            new_tokens[:, t] = chosen
            if log_probs is not None:
                assert lps is not None  # asked for (return_log_probs): both branches give them
                log_probs[:, t] = lps
            if stops:
                ended = torch.isin(chosen, stop_tensor) & ~finished
                lengths.masked_fill_(ended, t + 1)
                finished |= ended
                if bool(finished.all()):  # the one host sync per step, and only with stop ids: when to stop
                    break
            if t + 1 == max_new_tokens:
                break
            slot = width + t  # where the chosen token goes
            if cache is not None:
                inputs, step = chosen.unsqueeze(1), _step(batch, slot, 1, cache)
            else:  # recompute: the whole sequence again, from slot 0
                sequence = torch.cat([sequence, chosen.unsqueeze(1)], dim=1)
                inputs, step = sequence, _step(batch, 0, slot + 1, None)
        runner.rounds.drain()
    finally:
        if cache is not None:
            cache.free()
    ends = lengths.tolist()
    tokens = [row[:end] for row, end in zip(new_tokens.tolist(), ends)]
    row_log_probs = [row[:end] for row, end in zip(log_probs.tolist(), ends)] if log_probs is not None else None
    return GenerationResult(tokens, row_log_probs, [bool(row) and row[-1] in stops for row in tokens])


def _step(batch: PromptBatch, start: int, length: int, cache: Optional[KVCache]) -> InferenceStep:
    """The step of slots ``start .. start+length-1``: positions, and a mask only where plain causal
    attention is not right (padding, or several queries after cached slots)."""
    positions = batch.positions(start, length)
    if length == 1:  # a decode step: its query sees every earlier slot but the padding
        mask = batch.key_mask[:, None, None, : start + 1] if batch.padded else None
    elif batch.padded or start > 0:
        mask = attention_mask(batch.pad, start, length)
    else:
        mask = None
    return InferenceStep(start=start, positions=positions, mask=mask, cache=cache)
