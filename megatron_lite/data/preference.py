"""Preference pairs for reward models and DPO: JSONL lines of ``{"prompt", "chosen", "rejected"}``.

A line is either text (three strings) or chat: ``{"chosen": [messages], "rejected": [messages]}`` (two
conversations that differ only in their last, assistant, message) or ``{"prompt": [messages], "chosen":
{assistant message}, "rejected": {...}}`` (a reply may also be given as a one-message list or a string). Chat
pairs are rendered with the chat template (``chat_template``, else the tokenizer's, else
``DEFAULT_CHAT_TEMPLATE``): the prompt with the generation prompt (the assistant header) is the prompt, what
rendering the whole conversation adds is the response, so prompt and header tokens are masked.

Prompt and response are tokenized separately (so the boundary between them is exact) and joined;
an EOD token ends each response (``append_eod``), so a reward model reads its score where the
response ends. A sequence holds at most ``seq_length`` tokens (the response's tail is cut when it
is longer) and is padded to ``seq_length + 1`` like every other datamodule's ``tokens``: the last
column is always padding, so a model can run on ``tokens[:, :-1]`` and still see every real token,
and next-token log-probs (DPO) shift by one with no sequence losing its end. Every item is::

    chosen_tokens, rejected_tokens        LongTensor [seq_length + 1]  (padded)
    chosen_length, rejected_length        LongTensor []  real tokens, prompt included (1..seq_length)
    prompt_length                         LongTensor []  prompt tokens (the same for both responses)
    index                                 LongTensor []  the pair's number in the file(s), unique across splits
    chosen_loss_mask, rejected_loss_mask  FloatTensor [seq_length]  1 where predicting token j+1
                                          predicts a response token (response-only log-probs)

**Packed** (``pack_sequences=True``): pairs are packed first-fit, in the split's (seeded) order, into rows of
``seq_length + 1`` tokens, a pair's two sequences side by side (a pair never spans rows, so a microbatch always
holds whole pairs); the rest of a row is padding. One item is one ROW, with the packed-row format of
:mod:`megatron_lite.core.parallel.packing`::

    tokens        LongTensor [seq_length + 1]   pair 0's chosen, pair 0's rejected, pair 1's chosen, ..., padding
    loss_mask     FloatTensor [seq_length]      1 where predicting token j+1 predicts a response token
    position_ids  LongTensor [seq_length]       restarting at 0 in every sequence
    cu_seqlens    IntTensor [2P + 2]            sequence starts, then the row length, -1 padded: document 2p is
                                                pair p's chosen, 2p + 1 its rejected, any later one padding
    index         LongTensor [P]                the row's pair numbers in order, -1 padded

with ``P = (seq_length + 1) // 2`` pair slots (:func:`max_pairs_per_row`), the same for every split. A pair
whose two sequences (each cut at ``seq_length`` as above) exceed a row is refused, naming the line.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_lite.core.object_staging import local_input
from megatron_lite.core.parallel.packing import check_cu_seqlens
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.data.datamodule import PretrainingDataModule
from megatron_lite.data.splits import parse_split, split_boundaries
from megatron_lite.tokenizers.base import Tokenizer
from megatron_lite.utils.jsonl import parse_object_line, read_lines
from megatron_lite.utils.local_path import require_local_or_object_path

FIELDS = ("prompt", "chosen", "rejected")
ROLES = ("system", "user", "assistant", "tool")
Pair = tuple[Any, Any, Any, str]
"""``(prompt, chosen, rejected, "file:line")``: three strings, or (chat) prompt messages and two assistant messages."""


def read_preferences(path: str, keys: Sequence[str] = FIELDS) -> list[Pair]:
    """The pair of every non-blank line of a JSONL(.gz) file (text or chat, see the module docstring); ``keys``
    names the prompt, chosen and rejected fields. One-line ValueErrors name the line and the fix."""
    pairs = []
    for line_no, line in read_lines(path):
        where = f"{path}:{line_no}"
        obj = parse_object_line(line, where, keys[0], what="a preference file")
        if obj is not None:
            pairs.append(_parse_pair(obj, keys, where))
    if not pairs:
        raise ValueError(f"{path} holds no preference pairs; write one JSON object per line with fields {list(keys)}")
    return pairs


def _parse_pair(obj: dict, keys: Sequence[str], where: str) -> Pair:
    prompt_key, chosen_key, rejected_key = keys
    values = [obj.get(k) for k in keys]
    if all(isinstance(v, str) for v in values):
        return (*values, where)
    chat = any(isinstance(v, (list, dict)) for v in values)
    if not chat:
        missing = [k for k, v in zip(keys, values) if not isinstance(v, str)]
        raise ValueError(
            f"{where} lacks string field(s) {missing} (found {sorted(obj)}); every line needs "
            f"{{{', '.join(repr(k) + ': str' for k in keys)}}}, or chat messages "
            f"{{{chosen_key!r}: [messages], {rejected_key!r}: [messages]}}"
        )
    prompt, chosen, rejected = values
    for key, value in ((chosen_key, chosen), (rejected_key, rejected)):
        if value is None:
            raise ValueError(
                f"{where} lacks the field {key!r} (found {sorted(obj)}); a chat pair needs "
                f"{{{chosen_key!r}: [messages], {rejected_key!r}: [messages]}} or a {prompt_key!r} "
                f"list of messages and one assistant message each"
            )
    if prompt is None:  # two whole conversations: the prompt is what they share
        conversations = [_messages(v, where, k) for k, v in ((chosen_key, chosen), (rejected_key, rejected))]
        if any(len(c) < 2 for c in conversations) or conversations[0][:-1] != conversations[1][:-1]:
            raise ValueError(
                f"{where}: {chosen_key!r} and {rejected_key!r} must be conversations with the same "
                f"messages before their last (assistant) message, or give {prompt_key!r} separately"
            )
        prompt = conversations[0][:-1]
        replies = [c[-1] for c in conversations]
    else:
        prompt = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _messages(prompt, where, prompt_key)
        )
        replies = [_reply(v, prompt, where, k) for k, v in ((chosen_key, chosen), (rejected_key, rejected))]
    for key, reply in zip((chosen_key, rejected_key), replies):
        if reply["role"] != "assistant":
            raise ValueError(f"{where}: the {key} reply must be an assistant message, got role {reply['role']!r}")
    return prompt, replies[0], replies[1], where


def _messages(value: Any, where: str, key: str) -> list[dict]:
    if isinstance(value, dict):
        value = [value]
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in value)
    ):
        raise ValueError(
            f'{where}: {key!r} must be a non-empty list of {{"role": one of {list(ROLES)}, '
            f'"content": str}} messages, got {value!r:.120}'
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _reply(value: Any, prompt: list[dict], where: str, key: str) -> dict:
    """The assistant reply of a pair given with a separate prompt: a string, one message, or prompt + reply."""
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    messages = _messages(value, where, key)
    if len(messages) > 1 and messages[:-1] != prompt:
        raise ValueError(
            f"{where}: {key!r} holds {len(messages)} messages that do not start with the prompt's; give "
            f"the assistant reply alone or the whole conversation"
        )
    return messages[-1]


def _pair_texts(pair: Pair, render: Callable[[list, bool], str]) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) texts: a text pair as it is, a chat pair rendered with the template."""
    prompt, chosen, rejected, where = pair
    if isinstance(prompt, str):
        return prompt, chosen, rejected
    prompt_text = render(prompt, True)
    responses = []
    for reply in (chosen, rejected):
        full = render(prompt + [reply], False)
        if not full.startswith(prompt_text):
            raise ValueError(
                f"{where}: the chat template renders the prompt with the generation prompt as text that "
                f"the whole conversation does not start with, so prompt and reply cannot be told apart; "
                f"use a prefix-stable template (chat_template=...)"
            )
        responses.append(full[len(prompt_text) :])
    return prompt_text, responses[0], responses[1]


def first_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit packing of items (indices, in order) into bins of ``capacity``: each item goes into the first
    bin with room, a new bin only when none has; deterministic. A segment tree over the bins' free room finds
    that bin in O(log n), so large files pack in seconds. Every size must be <= ``capacity``."""
    leaves = 1
    while leaves < max(len(sizes), 1):
        leaves *= 2
    room = np.full(2 * leaves, capacity, dtype=np.int64)  # max free room under each node; unopened bins are empty
    bins: list[list[int]] = []
    for item, size in enumerate(sizes):
        node = 1
        while node < leaves:  # the leftmost leaf with room: an opened bin, or else the next new one
            node = 2 * node if room[2 * node] >= size else 2 * node + 1
        b = node - leaves
        if b == len(bins):
            bins.append([])
        bins[b].append(item)
        room[node] -= size
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    return bins


def max_pairs_per_row(seq_length: int) -> int:
    """Pair slots of a packed row: every sequence holds >= 1 token, so a row of ``seq_length + 1`` tokens holds
    at most this many pairs. Fixed by ``seq_length`` alone so that rows of every split stack."""
    return (seq_length + 1) // 2


class PreferenceDataset(Dataset):
    """Tokenized preference pairs (see the module docstring for the items), one pair per item or, with
    ``pack_sequences``, several pairs per packed row."""

    def __init__(
        self,
        pairs: Sequence[Pair],
        tokenizer: Tokenizer,
        seq_length: int,
        append_eod: bool = True,
        indices: Optional[Sequence[int]] = None,
        chat_template: Optional[str] = None,
        pack_sequences: bool = False,
    ):
        """``indices``: each pair's id, yielded as ``index`` (a global pair number, unique across splits: DPO
        caches reference log-probs by it); by default the position in ``pairs``."""
        if seq_length < 2:
            raise ValueError(f"seq_length must be >= 2, got {seq_length}")
        self.seq_length = seq_length
        self.pad = tokenizer.pad if tokenizer.pad is not None else tokenizer.eod
        self.num_truncated = 0
        """Responses whose tail was cut to fit ``seq_length``."""
        indices = list(range(len(pairs))) if indices is None else list(indices)
        if len(indices) != len(pairs):
            raise ValueError(f"{len(indices)} indices for {len(pairs)} pairs")
        render = None
        tokenized = []  # per pair: (where, prompt length, chosen ids, rejected ids)
        for pair in pairs:
            where = pair[3]
            if render is None and not isinstance(pair[0], str):
                from megatron_lite.data.sft import _renderer  # the template only when a chat pair needs it

                render = _renderer(tokenizer, chat_template)
            prompt, chosen, rejected = _pair_texts(pair, render)
            prompt_ids = tokenizer.tokenize(prompt)
            sequences = []
            for name, text in (("chosen", chosen), ("rejected", rejected)):
                response = tokenizer.tokenize(text) + ([tokenizer.eod] if append_eod else [])
                if not response:
                    raise ValueError(
                        f"{where}: the {name} response is empty (no tokens); remove the pair or keep "
                        f"append_eod=True so every response ends in EOD"
                    )
                if len(prompt_ids) >= seq_length:
                    raise ValueError(
                        f"{where}: the prompt's {len(prompt_ids)} tokens fill seq_length={seq_length}, "
                        f"leaving nothing of the {name} response; raise seq_length or shorten the prompt"
                    )
                self.num_truncated += len(prompt_ids) + len(response) > seq_length
                sequences.append((prompt_ids + response)[:seq_length])
            tokenized.append((where, len(prompt_ids), *sequences))
        self.real_tokens = sum(len(c) + len(r) for _, _, c, r in tokenized)
        """Tokens of every pair's two sequences (prompt included), padding excluded."""
        if pack_sequences:
            self.samples = self._packed_rows(tokenized, indices)
            self.padding_fraction = 1.0 - self.real_tokens / (len(self.samples) * (seq_length + 1))
        else:
            self.samples = [self._pair_sample(t, i) for t, i in zip(tokenized, indices)]
            self.padding_fraction = 1.0 - self.real_tokens / (2 * len(self.samples) * (seq_length + 1))
        """Share of the token positions the model runs on (``seq_length + 1`` per row) that are padding."""

    def _sequence_mask(self, prompt_length: int, length: int, size: int) -> np.ndarray:
        """1 where predicting token j+1 predicts a response token of a sequence starting at 0 (size >= length - 1)."""
        mask = np.zeros(size, dtype=np.float32)
        mask[prompt_length - 1 if prompt_length else 0 : length - 1] = 1.0
        return mask

    def _pair_sample(self, pair: tuple, pair_index: int) -> dict[str, torch.Tensor]:
        _, prompt_length, *sequences = pair
        sample = {}
        for name, ids in zip(("chosen", "rejected"), sequences):
            tokens = np.full(self.seq_length + 1, self.pad, dtype=np.int64)
            tokens[: len(ids)] = ids
            sample[f"{name}_tokens"] = torch.from_numpy(tokens)
            sample[f"{name}_length"] = torch.tensor(len(ids))
            sample[f"{name}_loss_mask"] = torch.from_numpy(
                self._sequence_mask(prompt_length, len(ids), self.seq_length)
            )
        sample["prompt_length"] = torch.tensor(prompt_length)
        sample["index"] = torch.tensor(pair_index)
        return sample

    def _packed_rows(self, tokenized: list, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """Pairs packed first-fit (in order) into rows of ``seq_length + 1`` tokens; see the module docstring."""
        capacity = self.seq_length + 1
        for where, _, chosen, rejected in tokenized:
            if len(chosen) + len(rejected) > capacity:
                raise ValueError(
                    f"{where}: the pair's chosen and rejected sequences hold {len(chosen)} + {len(rejected)} tokens "
                    f"(prompt included, each cut at seq_length), more than a packed row of seq_length + 1 = "
                    f"{capacity}; raise seq_length to >= {len(chosen) + len(rejected) - 1}, or set "
                    f"pack_sequences=False (one pair per row, each sequence padded to its own row)"
                )
        slots = max_pairs_per_row(self.seq_length)
        rows = []
        for members in first_fit([len(c) + len(r) for _, _, c, r in tokenized], capacity):
            tokens = np.full(capacity, self.pad, dtype=np.int64)
            mask = np.zeros(capacity, dtype=np.float32)  # indexed by the predicting position, last unused
            positions = np.zeros(capacity, dtype=np.int64)
            cu: list[int] = []
            offset = 0
            for member in members:
                _, prompt_length, *sequences = tokenized[member]
                for ids in sequences:  # document 2p: pair p's chosen, 2p + 1: its rejected
                    n = len(ids)
                    tokens[offset : offset + n] = ids
                    mask[offset : offset + n] = self._sequence_mask(prompt_length, n, n)
                    positions[offset : offset + n] = np.arange(n)
                    cu.append(offset)
                    offset += n
            cu += [offset, capacity] if offset < capacity else [capacity]  # the padding is a document of its own
            index = np.full(slots, -1, dtype=np.int64)
            index[: len(members)] = [indices[m] for m in members]
            rows.append(
                {
                    "tokens": torch.from_numpy(tokens),
                    "loss_mask": torch.from_numpy(mask[:-1]),
                    "position_ids": torch.from_numpy(positions[:-1]),
                    "cu_seqlens": torch.tensor(cu + [-1] * (2 * slots + 2 - len(cu)), dtype=torch.int32),
                    "index": torch.from_numpy(index),
                }
            )
        return rows

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.samples[index]


class PreferenceDataModule(PretrainingDataModule):
    """Preference pairs from JSONL file(s), split by pair (``split``, Megatron's weights) after a seeded
    shuffle. One sample is one pair; ``micro_batch_size`` and ``global_batch_size`` count pairs, and a
    batch is one optimizer step's pairs for this data-parallel rank (split into microbatches by the module).

    With ``pack_sequences=True`` one sample is one packed ROW of several pairs (as SFT packing and Megatron's
    packed sequences count rows): ``micro_batch_size`` and ``global_batch_size`` count rows, consumed samples
    (and so resume) count rows, and a step holds a variable number of pairs; DPO still averages its loss over
    the global batch's pairs. The packing is deterministic (seed and files), so a resumed run sees the same rows.
    """

    def __init__(
        self,
        path: Union[str, Sequence[str]],
        tokenizer: Tokenizer,
        seq_length: int = 512,
        micro_batch_size: int = 4,
        global_batch_size: int = 16,
        split: str = "98,2",
        append_eod: bool = True,
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        chat_template: Optional[str] = None,
        seed: int = 1234,
        num_workers: int = 0,
        rampup_batch_size: Optional[list[int]] = None,
        pack_sequences: bool = False,
    ) -> None:
        """``chat_template``: a Jinja2 template (text) for chat pairs; the tokenizer's or the default otherwise.
        ``pack_sequences``: pack several pairs per row of ``seq_length + 1`` tokens (batch sizes then count rows)."""
        super().__init__(seq_length, micro_batch_size, global_batch_size, num_workers, rampup_batch_size)
        self.paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
        if not self.paths:
            raise ValueError("PreferenceDataModule needs at least one path (a .jsonl or .jsonl.gz file)")
        # s3:// objects are read from local copies (downloaded once per ETag)
        self.paths = [local_input(require_local_or_object_path(p, "data.path")) for p in self.paths]
        for p in self.paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(
                    f"preference data {p} does not exist; pass data.path=<a .jsonl(.gz) file of "
                    f'{{"{prompt_key}": ..., "{chosen_key}": ..., "{rejected_key}": ...}} lines>'
                )
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"tokenizer must be a megatron_lite Tokenizer (see build_tokenizer), got {type(tokenizer).__name__}"
            )
        self.tokenizer, self.split, self.append_eod, self.seed = tokenizer, parse_split(split), append_eod, seed
        self.keys = (prompt_key, chosen_key, rejected_key)
        self.chat_template = chat_template
        self.pack_sequences = bool(pack_sequences)
        self.vocab_size = tokenizer.vocab_size
        self.datasets: dict[str, PreferenceDataset] = {}
        # Read (not tokenized) now: a malformed line is reported before any process is started.
        self._pairs: Optional[list[Pair]] = [pair for p in self.paths for pair in read_preferences(p, self.keys)]

    def check_before_launch(
        self, run: RunSpec, trainer: Any = None, module: Any = None, datamodule: Any = None
    ) -> None:
        """Tokenize (and pack) every split here, in the launching process (MegatronStrategy's pre-launch check,
        before it starts any rank): a pair that cannot be used fails once, naming its line, instead of in every rank's
        setup; forked ranks inherit the datasets and do not tokenize again."""
        self.setup()

    def setup(self, stage: Optional[str] = None) -> None:
        if self.datasets:
            return
        pairs, self._pairs = self._pairs, None  # the datasets hold what is needed from here on
        if pairs is None:
            pairs = [pair for p in self.paths for pair in read_preferences(p, self.keys)]
        order = np.random.RandomState(self.seed).permutation(len(pairs))
        bounds = split_boundaries(self.split, len(pairs))
        for name, lo, hi in zip(("train", "validation", "test"), bounds[:-1], bounds[1:]):
            if hi > lo:
                self.datasets[name] = PreferenceDataset(
                    [pairs[i] for i in order[lo:hi]],
                    self.tokenizer,
                    self.seq_length,
                    self.append_eod,
                    indices=[int(i) for i in order[lo:hi]],
                    chat_template=self.chat_template,
                    pack_sequences=self.pack_sequences,
                )
                if self.pack_sequences:  # every row is in memory: check them all before the first step
                    check_cu_seqlens(
                        torch.stack([row["cu_seqlens"] for row in self.datasets[name].samples]),
                        self.seq_length + 1,
                        f"the packed {name} rows' cu_seqlens",
                    )

    def _split(self, name: str) -> PreferenceDataset:
        self.setup()
        if name not in self.datasets:
            raise ValueError(f"the {name} split of {self.paths} is empty; give it a weight in split (e.g. '90,10')")
        return self.datasets[name]

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._split("train"), "train", self._consumed_at_start())

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._split("validation"), "validation")

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._split("test"), "test")

    def _too_small_hint(self, split: str) -> str:
        rows = " (with pack_sequences=True it counts packed rows of several pairs)" if self.pack_sequences else ""
        return (
            f"add preference pairs to {self.paths}, raise the {split} weight in split, or lower global_batch_size{rows}"
        )
