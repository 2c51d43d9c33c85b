"""Packed rows: several documents in one sample, described by ``cu_seqlens``.

A sample is a row of ``row_length`` tokens (``seq_length + 1``: the model's inputs are the first
``seq_length``, its labels the last ``seq_length``). Its ``cu_seqlens`` is an integer vector: the start
offset of each document in the row (the first is 0, strictly increasing), then ``row_length``, then ``-1``
padding up to a fixed length so that rows of one batch stack. Document ``d`` holds the tokens
``[cu[d], cu[d + 1])``; a document that starts at the row's last token only supplies a label. Padding
tokens at the end of a row (packed SFT) form a document of their own, so the last entry is always the
row length. Attention never crosses a document boundary and positions restart at 0 in each document.
"""

from __future__ import annotations

import torch

_FORMAT = (
    "cu_seqlens lists each document's start offset in the row (the first is 0, strictly increasing), "
    "then the row length, then -1 padding: e.g. [0, 7, 17, -1] for documents of 7 and 10 tokens in a "
    "17-token row"
)


def check_cu_seqlens(cu_seqlens: torch.Tensor, row_length: int, what: str = "cu_seqlens") -> None:
    """Raise ValueError naming the first bad row of ``cu_seqlens`` ([k] or [b, k]) and what is wrong with it.

    Every row must start at 0, increase strictly, end at ``row_length`` and then hold only -1 padding. The
    check runs on the whole tensor at once and reads one boolean back (a single device sync); only a bad
    tensor is walked in Python to say what is wrong. ``what`` names the tensor in the message (e.g. "the
    first train sample's cu_seqlens").
    """
    if isinstance(row_length, bool) or not isinstance(row_length, int) or row_length < 1:
        raise ValueError(f"row_length must be a positive integer (tokens per row), got {row_length!r}")
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dtype.is_floating_point
        or cu_seqlens.dtype.is_complex
        or cu_seqlens.dtype == torch.bool
    ):
        kind = cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
        raise ValueError(f"{what} must be an integer tensor (int32 or int64), got {kind}; {_FORMAT}")
    if cu_seqlens.dim() not in (1, 2) or cu_seqlens.shape[-1] < 2:
        raise ValueError(
            f"{what} must have shape [k] or [batch, k] with k >= 2 (0 and the row length), got "
            f"{tuple(cu_seqlens.shape)}; {_FORMAT}"
        )
    rows = cu_seqlens.reshape(-1, cu_seqlens.shape[-1]).long()
    pad = rows == -1
    ok = rows[:, 0] == 0
    ok &= ~(rows < -1).any(dim=1)
    ok &= ~(pad[:, :-1] & ~pad[:, 1:]).any(dim=1)  # once padding starts it never stops
    ok &= ((rows[:, 1:] > rows[:, :-1]) | pad[:, 1:]).all(dim=1)
    last_used = (~pad).sum(dim=1).clamp(min=1) - 1
    ok &= rows.gather(1, last_used[:, None])[:, 0] == row_length
    if bool(ok.all()):
        return
    bad = int((~ok).nonzero()[0, 0])
    where = f"{what} (row {bad} of the batch)" if cu_seqlens.dim() == 2 else what
    values = rows[bad].tolist()
    raise ValueError(
        f"{where} = {values} is not a packed row of {row_length} tokens: "
        f"{_diagnose(values, row_length)}. {_FORMAT}; fix the packing that built it"
    )


def _diagnose(row: list[int], row_length: int) -> str:
    """What is wrong with one row that failed :func:`check_cu_seqlens` (the first problem found)."""
    if row[0] != 0:
        return f"it starts at {row[0]}, but the first document starts at offset 0"
    end = row.index(-1) if -1 in row else len(row)
    for j, value in enumerate(row):
        if value < -1:
            return f"entry {j} is {value}: offsets are >= 0 and the padding is -1"
        if j > end and value != -1:
            return f"entry {j} is {value} after the -1 padding began at entry {end}: padding goes only at the end"
    for j in range(1, end):
        if row[j] <= row[j - 1]:
            return (
                f"entry {j} ({row[j]}) is not greater than entry {j - 1} ({row[j - 1]}): offsets must "
                f"strictly increase (every document holds at least one token)"
            )
    return (
        f"its last entry before the padding is {row[end - 1]}, but it must be the row length {row_length} "
        f"(the end of the last document)"
    )


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Per-token position in its own document, [length] (long), for a checked 1-D ``cu_seqlens``.

    Positions restart at 0 at every document start below ``length`` (``length`` may be shorter than the
    row: the model's inputs are its first ``row_length - 1`` tokens).
    """
    starts = cu_seqlens[cu_seqlens >= 0][:-1].long()
    tokens = torch.arange(length, device=cu_seqlens.device)
    document = torch.searchsorted(starts, tokens, right=True) - 1
    return tokens - starts[document]


def cu_seqlens_from_eod(tokens: torch.Tensor, eod_token: int, padded_length: int) -> torch.Tensor:
    """``cu_seqlens`` (int32, [padded_length]) of a row whose documents end with ``eod_token``.

    Megatron's document boundaries (``_get_ltor_masks_and_position_ids``): an EOD *input* token (any token
    but the last) ends its document, and the next token starts a new one; an EOD in the last position is
    only a label and starts nothing. ``padded_length`` must be at least the number of EOD inputs + 2.
    """
    row_length = tokens.shape[0]
    eods = torch.nonzero(tokens[:-1] == eod_token)[:, 0]
    used = eods.numel() + 2  # start 0, one start per EOD input, the row length
    if used > padded_length:
        raise ValueError(
            f"a row with {eods.numel()} EOD inputs needs cu_seqlens of length >= {used}, got "
            f"padded_length={padded_length}"
        )
    cu = torch.full((padded_length,), -1, dtype=torch.int32)
    cu[0] = 0
    cu[1 : used - 1] = (eods + 1).to(torch.int32)
    cu[used - 1] = row_length
    return cu
