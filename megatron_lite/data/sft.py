"""Supervised fine-tuning data: chat conversations, loss on the assistant's turns, packing.

Each JSONL line holds ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``.
A conversation is rendered with the tokenizer's chat template (or ``DEFAULT_CHAT_TEMPLATE``) turn
by turn: the text each turn adds is tokenized on its own, so every token knows whether it belongs
to an assistant reply (trained) or to the prompt and the role headers (not trained).

Packed samples concatenate whole conversations up to ``seq_length + 1`` tokens and carry
``cu_seqlens`` (start offsets of each conversation, then the start of the padding if the row is not
full, then the row length ``seq_length + 1``, padded with -1: the format of
:mod:`megatron_lite.core.parallel.packing`) and ``position_ids`` restarting at 0 per conversation, for
packed-sequence attention. Every item is ``{"tokens": [s+1], "loss_mask": [s], "position_ids": [s],
"cu_seqlens": [cu_seqlens_length]}`` where ``loss_mask[j]`` says whether predicting ``tokens[j+1]`` counts.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_lite.core.object_staging import local_input
from megatron_lite.core.parallel.packing import check_cu_seqlens
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.data.datamodule import PretrainingDataModule
from megatron_lite.data.splits import parse_split, split_boundaries
from megatron_lite.tokenizers.base import Tokenizer
from megatron_lite.utils.jsonl import read_lines
from megatron_lite.utils.local_path import require_local_or_object_path

Render = Callable[[Sequence[dict], bool], str]
ROLES = ("system", "user", "assistant", "tool")


def iter_conversations(path: str, messages_key: str = "messages") -> Iterator[list[dict]]:
    """Conversations of a JSONL(.gz) file, one by one, validated: a list of {role, content} with an
    assistant turn. A bad line raises ValueError naming ``path:line`` and what the line must hold."""
    for line_no, line in read_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} is not valid JSON ({err}); {_LINE_FORMAT.format(key=messages_key)}") from err
        messages = obj.get(messages_key) if isinstance(obj, dict) else None
        if not isinstance(messages, list) or not messages:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            hint = " (or pass messages_key=<the key that holds them>)" if isinstance(obj, dict) else ""
            raise ValueError(
                f"{where} has no non-empty list under {messages_key!r} (found {keys}); "
                f"{_LINE_FORMAT.format(key=messages_key)}{hint}"
            )
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: every message needs a role in {ROLES} and a string content, got {m!r}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the conversation has no assistant turn, so nothing would be trained")
        yield messages


_LINE_FORMAT = 'each line must be {{"{key}": [{{"role": ..., "content": ...}}, ...]}}'


def read_conversations(path: str, messages_key: str = "messages") -> list[list[dict]]:
    """Every conversation of a JSONL(.gz) file (see :func:`iter_conversations`); an empty file is refused."""
    conversations = list(iter_conversations(path, messages_key))
    if not conversations:
        raise ValueError(_no_conversations(path, messages_key))
    return conversations


def _no_conversations(path: str, messages_key: str) -> str:
    return f"{path} holds no conversations; {_LINE_FORMAT.format(key=messages_key)}"


def tokenize_conversation(
    messages: Sequence[dict], render: Render, tokenize: Callable[[str], list[int]], eod: int
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, per-token train mask) of one conversation, EOD appended (and trained)."""
    ids: list[int] = []
    mask: list[int] = []
    shown = ""

    def add(text: str, train: bool) -> None:
        nonlocal shown
        if not text.startswith(shown):
            raise ValueError(
                "the chat template is not prefix-stable (rendering the first k turns is not a prefix of rendering "
                "k+1 turns), so prompt and reply tokens cannot be told apart; use a template without that property"
            )
        piece = tokenize(text[len(shown) :]) if len(text) > len(shown) else []
        ids.extend(piece)
        mask.extend([int(train)] * len(piece))
        shown = text

    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            add(render(messages[:i], True), False)  # the prompt, up to and including the assistant header
            add(render(messages[: i + 1], False), True)  # the reply and its end marker
        else:
            add(render(messages[: i + 1], False), False)
    ids.append(eod)
    mask.append(1)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int64)


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy in-order packing of items (indices) into bins of ``capacity`` tokens."""
    bins: list[list[int]] = []
    used = capacity
    for i, n in enumerate(lengths):
        n = min(n, capacity)
        if used + n > capacity:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


class SFTDataset(Dataset):
    """Tokenized (optionally packed) chat conversations; see the module docstring for the items."""

    def __init__(
        self,
        conversations: Sequence[Sequence[dict]],
        tokenizer,
        seq_length: int,
        *,
        pack_sequences: bool = True,
        chat_template: Optional[str] = None,
        seed: int = 1234,
    ):
        if seq_length < 2:
            raise ValueError(f"seq_length must be >= 2, got {seq_length}")
        self.seq_length = seq_length
        self.pad = tokenizer.pad if tokenizer.pad is not None else tokenizer.eod
        render = _renderer(tokenizer, chat_template)
        order = np.random.RandomState(seed).permutation(len(conversations))
        tokenized = [tokenize_conversation(conversations[i], render, tokenizer.tokenize, tokenizer.eod) for i in order]
        capacity = seq_length + 1
        self.num_truncated = sum(len(ids) > capacity for ids, _ in tokenized)
        bins = (
            pack([len(ids) for ids, _ in tokenized], capacity)
            if pack_sequences
            else [[i] for i in range(len(tokenized))]
        )
        self.max_seqs = max(len(b) for b in bins)
        """Most conversations in one sample."""
        rows = [self._build(b, tokenized, capacity) for b in bins]
        self.cu_seqlens_length = max(len(cu) for _, cu in rows)
        """Entries of every sample's ``cu_seqlens`` (the longest row's, so that rows stack)."""
        for sample, cu in rows:
            sample["cu_seqlens"] = torch.tensor(cu + [-1] * (self.cu_seqlens_length - len(cu)), dtype=torch.int32)
        self.samples = [sample for sample, _ in rows]

    def _build(self, members: list[int], tokenized, capacity: int) -> tuple[dict[str, torch.Tensor], list[int]]:
        """(the sample without ``cu_seqlens``, its unpadded ``cu_seqlens``)."""
        tokens = np.full(capacity, self.pad, dtype=np.int64)
        train = np.zeros(capacity, dtype=np.int64)
        positions = np.zeros(capacity, dtype=np.int64)
        cu: list[int] = []
        offset = 0
        for i in members:
            ids, mask = tokenized[i]
            n = min(len(ids), capacity - offset)
            tokens[offset : offset + n] = ids[:n]
            train[offset : offset + n] = mask[:n]
            positions[offset : offset + n] = np.arange(n)
            cu.append(offset)
            offset += n
        # Padding is a document of its own (never trained, seen by no real token), so the row always ends
        # at its length, the one format check_cu_seqlens and packed attention expect.
        cu += [offset, capacity] if offset < capacity else [capacity]
        # Never train across a conversation boundary: the first token of the next one is not predictable.
        train[cu[1 : len(members)]] = 0
        sample = {
            "tokens": torch.from_numpy(tokens),
            "loss_mask": torch.from_numpy(train[1:]).float(),
            "position_ids": torch.from_numpy(positions[:-1]),
        }
        return sample, cu

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.samples[index]


def _renderer(tokenizer, chat_template: Optional[str]) -> Render:
    from megatron_lite.tokenizers.chat import DEFAULT_CHAT_TEMPLATE, render_chat_template

    template = chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE

    def render(messages: Sequence[dict], add_generation_prompt: bool) -> str:
        return render_chat_template(
            template,
            list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
        )

    return render


class SFTDataModule(PretrainingDataModule):
    """Chat fine-tuning data for GPTModule: a JSONL of conversations split by conversation.

    Batches carry ``loss_mask`` so only the assistant's tokens are trained; the global-batch loss
    is the mean over those tokens (see ``megatron_lite.core.parallel.schedules``).
    """

    def __init__(
        self,
        path: str,
        tokenizer: Tokenizer,
        seq_length: int = 512,
        micro_batch_size: int = 4,
        global_batch_size: int = 16,
        split: str = "98,2",
        pack_sequences: bool = True,
        chat_template: Optional[str] = None,
        messages_key: str = "messages",
        seed: int = 1234,
        num_workers: int = 0,
        rampup_batch_size: Optional[list[int]] = None,
    ) -> None:
        super().__init__(seq_length, micro_batch_size, global_batch_size, num_workers, rampup_batch_size)
        # an s3:// object is read from a local copy (downloaded once per ETag): every rank reads the whole file
        path = local_input(require_local_or_object_path(path, "data.path"))
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"SFT data {path} does not exist; pass data.path=<a .jsonl or .jsonl.gz file "
                f'of {{"{messages_key}": [...]}} lines>'
            )
        self.path, self.tokenizer, self.split = path, tokenizer, parse_split(split)
        self.pack_sequences, self.chat_template, self.messages_key, self.seed = (
            pack_sequences,
            chat_template,
            messages_key,
            seed,
        )
        self.vocab_size = tokenizer.vocab_size
        self.datasets: dict[str, SFTDataset] = {}
        self._validated_inputs: Optional[tuple] = None  # (path, size, mtime, key) of the file last checked

    def check_before_launch(
        self, run: RunSpec, trainer: Any = None, module: Any = None, datamodule: Any = None
    ) -> None:
        """Read the whole file once and refuse it, naming the line and the fix, if it is empty, holds no
        ``messages_key`` list, a malformed message, or too few conversations for a train split. Every
        rank parses the whole file in ``setup`` anyway; this pass, in the launching process, makes a bad
        file fail before any rank starts. Remembered per file version, so a second fit skips it."""
        stat = os.stat(self.path)
        identity = (os.path.abspath(self.path), stat.st_size, stat.st_mtime_ns, self.messages_key)
        if self._validated_inputs == identity:
            return
        count = sum(1 for _ in iter_conversations(self.path, self.messages_key))
        if count == 0:
            raise ValueError(_no_conversations(self.path, self.messages_key))
        bounds = split_boundaries(self.split, count)
        if bounds[1] == bounds[0]:
            raise ValueError(
                f"{self.path} holds {count} conversation(s), which leaves the train split empty "
                f"(split fractions {self.split}); add conversations or raise the train weight of split"
            )
        self._validated_inputs = identity

    def setup(self, stage: Optional[str] = None) -> None:
        if self.datasets:
            return
        conversations = read_conversations(self.path, self.messages_key)
        order = np.random.RandomState(self.seed).permutation(len(conversations))
        bounds = split_boundaries(self.split, len(conversations))
        for name, lo, hi in zip(("train", "validation", "test"), bounds[:-1], bounds[1:]):
            if hi > lo:
                dataset = SFTDataset(
                    [conversations[i] for i in order[lo:hi]],
                    self.tokenizer,
                    self.seq_length,
                    pack_sequences=self.pack_sequences,
                    chat_template=self.chat_template,
                    seed=self.seed,
                )
                # every row is already in memory: check them all at once, before the first step
                check_cu_seqlens(
                    torch.stack([sample["cu_seqlens"] for sample in dataset.samples]),
                    self.seq_length + 1,
                    f"the {name} samples' cu_seqlens",
                )
                self.datasets[name] = dataset

    def _split(self, name: str) -> SFTDataset:
        self.setup()
        if name not in self.datasets:
            raise ValueError(f"the {name} split of {self.path} is empty; give it a weight in split (e.g. '90,10')")
        return self.datasets[name]

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._split("train"), "train", self._consumed_at_start())

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._split("validation"), "validation")

    def _too_small_hint(self, split: str) -> str:
        return f"add conversations to {self.path}, raise the {split} weight in split, or lower global_batch_size"
