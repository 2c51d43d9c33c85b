"""Prompts for generation: checked once (one clear error before any work), then left-padded into one
batch.

Left padding puts every prompt's last token in the same column, so each decode step writes one
cache slot for the whole batch. A row's padding is invisible to it: its positions start at 0 at its
first real token, and its queries never attend to padding keys (see :func:`attention_mask`), so a
row generates what it would alone.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch


def _as_rows(prompts: Any) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2:
            raise ValueError(
                f"prompts must be a list of token-id lists (or a [batch, length] tensor), got a tensor "
                f"of shape {tuple(prompts.shape)}"
            )
        return prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
        raise TypeError(
            f"prompts must be a list of token-id lists, e.g. [[5, 17, 42]], got {type(prompts).__name__}; "
            f"tokenize text first (tokenizer.tokenize(text))"
        )
    rows = []
    for i, row in enumerate(prompts):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if isinstance(row, (str, bytes)) or not isinstance(row, Iterable):
            raise TypeError(
                f"prompt {i} must be a list of token ids, got {type(row).__name__}; tokenize text first "
                f"(tokenizer.tokenize(text))"
            )
        rows.append(list(row))
    return rows


def _token_id(value: Any, where: str, vocab_size: Optional[int]) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # ints and numpy integers; floats and strings are refused
    except TypeError:
        raise TypeError(f"{where} is {value!r}, not an integer token id") from None
    if value < 0 or (vocab_size is not None and value >= vocab_size):
        bound = (
            "a token id must be >= 0"
            if value < 0 and vocab_size is None
            else f"outside the model's vocabulary [0, {vocab_size}); "
            "use ids of the tokenizer the model was trained with"
        )
        raise ValueError(f"{where} is {value}, {bound}")
    return value


def check_prompts(
    prompts: Any, max_new_tokens: int, vocab_size: Optional[int], context: Optional[int]
) -> list[list[int]]:
    """``prompts`` as lists of ints, or one ValueError/TypeError naming the prompt and the fix: an empty
    batch or prompt, an id outside ``[0, vocab_size)``, a prompt that with ``max_new_tokens`` new tokens
    does not fit the model's ``context`` (its position table / trained length). None skips a bound (the
    model is not known yet)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    rows = _as_rows(prompts)
    if not rows:
        raise ValueError("prompts is empty: pass at least one prompt (a list of token ids)")
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. the tokenizer's BOS)")
        rows[i] = row = [_token_id(token, f"prompt {i}, token {j}", vocab_size) for j, token in enumerate(row)]
        if context is None:
            continue
        if len(row) > context:
            raise ValueError(
                f"prompt {i} has {len(row)} tokens, longer than the model's context of {context} "
                f"positions: shorten it to at most {context} tokens"
            )
        if len(row) + max_new_tokens > context:
            raise ValueError(
                f"prompt {i} has {len(row)} tokens; with max_new_tokens={max_new_tokens} the sequence "
                f"would reach {len(row) + max_new_tokens} positions, past the model's context of "
                f"{context}: lower max_new_tokens to {context - len(row)} or shorten the prompt"
            )
    return rows


def check_stop_ids(stop_ids: Optional[Iterable[int]], vocab_size: Optional[int]) -> tuple[int, ...]:
    """``stop_ids`` as a tuple of valid token ids (an int alone is accepted)."""
    if stop_ids is None:
        return ()
    if isinstance(stop_ids, int) and not isinstance(stop_ids, bool):
        stop_ids = (stop_ids,)
    return tuple(_token_id(t, "stop id", vocab_size) for t in stop_ids)


@dataclass
class PromptBatch:
    """Left-padded prompts."""

    tokens: torch.Tensor
    """[b, S] token ids, each prompt right-aligned (the padding is token 0 and is never attended to)."""
    pad: torch.Tensor
    """[b] padding slots in front of each prompt."""
    padded: bool
    """Whether any row has padding (else masks are unnecessary: plain causal attention)."""
    key_mask: torch.Tensor
    """bool [b, S + new tokens]: which slots hold real tokens (the padding's are False)."""

    @property
    def width(self) -> int:
        """S: the longest prompt's length (the first generated token goes in slot S)."""
        return self.tokens.shape[1]

    def positions(self, start: int, length: int) -> torch.Tensor:
        """[b, length] position ids of slots ``start .. start+length-1`` (0 at each row's first real token);
        [1, length] when no row is padded (the same for every row: RoPE's tables are computed once)."""
        slots = torch.arange(start, start + length, device=self.pad.device).unsqueeze(0)
        return (slots - self.pad.unsqueeze(1)).clamp_(min=0) if self.padded else slots


def left_pad(rows: Sequence[Sequence[int]], device: torch.device, width_after: int = 0) -> PromptBatch:
    """One batch of ``rows`` (checked by :func:`check_prompts`), right-aligned, with room for
    ``width_after`` generated tokens in its key mask."""
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, row in enumerate(rows):
        tokens[i, width - len(row) :] = torch.tensor(row, dtype=torch.int64)
    pad = torch.tensor([width - len(r) for r in rows], dtype=torch.int64)
    key_mask = torch.arange(width + width_after).unsqueeze(0) >= pad.unsqueeze(1)
    return PromptBatch(tokens.to(device), pad.to(device), padded=bool((pad > 0).any()), key_mask=key_mask.to(device))


def attention_mask(pad: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Which keys the queries of slots ``start .. start+length-1`` see: bool [b, 1, length, start+length].

    Causal, and never a padding key. A padding query sees only itself: a row of nothing but masked keys
    would give NaN, and NaN in a padding slot's cached values would poison every later query (0 x NaN)."""
    keys = torch.arange(start + length, device=pad.device)
    queries = torch.arange(start, start + length, device=pad.device).unsqueeze(1)
    visible = (keys <= queries) & (keys.unsqueeze(0) >= pad.view(-1, 1, 1))
    visible |= keys == queries
    return visible.unsqueeze(1)
