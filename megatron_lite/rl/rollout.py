"""Rollouts for GRPO as plain PyTorch: prompts expanded into groups, generated responses packed into the
``{"tokens", "loss_mask", "sampler_log_probs"}`` rows the training step runs, and the seeds that make a
rollout reproducible (and a resumed run continue exactly).

A row is the prompt followed by its response, from position 0, padded on the right to ``seq_length + 1``:
the same positions the generation used, so a teacher-forced forward of the row gives the sampler's
log-probs up to rounding. ``loss_mask[j]`` is 1 where label ``j + 1`` is a response token.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_lite.core.inference.sampling import _mix  # the per-prompt seed mixer, reused
from megatron_lite.rl.rewards import RewardFn, Sample, score


def rollout_seed(base_seed: int, rollout_step: int) -> int:
    """The sampling seed of rollout number ``rollout_step`` of a run seeded ``base_seed``: the generation's own
    splitmix of the pair (consecutive rollouts get unrelated streams)."""
    return _mix(base_seed, rollout_step)


def group_rows(
    prompts: Sequence[Sequence[int]], indices: Sequence[int], group_size: int
) -> tuple[list[list[int]], list[int]]:
    """Each prompt ``group_size`` times in a row, and the row ids that seed each sample's generator
    (``index * group_size + j``: a sample depends on its prompt's dataset index, not on batching or dp)."""
    rows = [list(p) for p in prompts for _ in range(group_size)]
    row_ids = [int(i) * group_size + j for i in indices for j in range(group_size)]
    return rows, row_ids


def pack_rows(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    seq_length: int,
    pad_id: int,
    sampler_log_probs: Optional[Sequence[Sequence[float]]] = None,
) -> dict[str, torch.Tensor]:
    """``tokens`` [n, seq_length + 1] (prompt + response, then ``pad_id``), ``loss_mask`` [n, seq_length] and,
    given the sampler's per-token log-probs, ``sampler_log_probs`` [n, seq_length] aligned with the mask."""
    n = len(prompts)
    tokens = torch.full((n, seq_length + 1), pad_id, dtype=torch.int64)
    mask = torch.zeros(n, seq_length, dtype=torch.float32)
    lps = torch.zeros(n, seq_length, dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        ids = list(prompt) + list(response)
        if len(ids) > seq_length + 1:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens and a response of {len(response)} do not fit "
                f"seq_length={seq_length}; raise the model's seq_length or lower max_new_tokens"
            )
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        start = len(prompt) - 1
        mask[i, start : start + len(response)] = 1.0
        if sampler_log_probs is not None:
            lps[i, start : start + len(response)] = torch.tensor(
                sampler_log_probs[i][: len(response)], dtype=torch.float32
            )
    out = {"tokens": tokens, "loss_mask": mask}
    if sampler_log_probs is not None:
        out["sampler_log_probs"] = lps
    return out


def make_samples(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    stopped: Sequence[bool],
    answers: Sequence[Optional[str]],
    detokenize,
    stop_ids: Sequence[int],
) -> list[Sample]:
    """One :class:`Sample` per response (its text without the stop token that ended it)."""
    samples = []
    for prompt, response, ended, answer in zip(prompts, responses, stopped, answers):
        body = list(response[:-1]) if ended and response and response[-1] in stop_ids else list(response)
        samples.append(
            Sample(
                prompt=detokenize(list(prompt)),
                completion=detokenize(body),
                answer=answer,
                prompt_ids=list(prompt),
                completion_ids=list(response),
                stopped=bool(ended),
            )
        )
    return samples


def score_samples(samples: Sequence[Sample], reward_fn: RewardFn) -> torch.Tensor:
    """Rewards [n] (float64) of ``samples``; errors name the function and the sample."""
    return score(samples, reward_fn)
