"""Packed pretraining rows: Megatron's reset_position_ids / reset_attention_mask / eod_mask_loss on GPTDataset
and PretrainDataModule against a plain-Python port of Megatron's semantics, and check_cu_seqlens's errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from megatron_lite.core.parallel.context_parallel import document_ranges
from megatron_lite.core.parallel.packing import check_cu_seqlens
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.indexed_dataset import IndexedDataset, write_dataset
from megatron_lite.data.pretrain import PretrainDataModule
from megatron_lite.tokenizers import NullTokenizer

EOD = 99
SEQ = 8


def megatron_reference(tokens: list[int], eod: int) -> dict[str, Any]:
    """Megatron's ``_get_ltor_masks_and_position_ids`` on the inputs ``tokens[:-1]``, written as its loop.

    Returns the loss mask, the position ids, the attention mask as ``allowed[q][k]`` and the document starts
    (0, then one past every EOD input, then the row length) in the cu_seqlens format.
    """
    data = tokens[:-1]
    s = len(data)
    loss_mask = [0.0 if t == eod else 1.0 for t in data]
    position_ids = list(range(s))
    allowed = [[k <= q for k in range(s)] for q in range(s)]
    prev = 0
    for i in [j for j, t in enumerate(data) if t == eod]:
        for q in range(i + 1, s):  # attention_mask[0, (i + 1):, :(i + 1)] = 0
            for k in range(i + 1):
                allowed[q][k] = False
        for q in range(i + 1, s):  # position_ids[(i + 1):] -= i + 1 - prev_index
            position_ids[q] -= i + 1 - prev
        prev = i + 1
    starts = [0] + [j + 1 for j, t in enumerate(data) if t == eod]
    return {
        "loss_mask": loss_mask,
        "position_ids": position_ids,
        "allowed": allowed,
        "cu_seqlens": starts + [len(tokens)],
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Documents that end with EOD, as `preprocess --append-eod` writes them: long ones (rows without an EOD),
    lone EODs (consecutive EODs) and short ones (several EODs per row)."""
    rng = np.random.default_rng(0)
    lengths = [20, 1, 1, 3, 2, 12, 1, 4, 2, 5, 1, 1, 1, 9, 3, 2, 25, 1, 6, 2, 3]
    docs = [[np.append(rng.integers(1, EOD, size=n - 1), EOD)] for n in lengths]
    prefix = str(tmp_path_factory.mktemp("packed") / "corpus")
    write_dataset(prefix, docs, dtype=np.uint16)
    return prefix


def _dataset(prefix: str, **kwargs: Any) -> GPTDataset:
    data = IndexedDataset(prefix)
    return GPTDataset(data, prefix, np.arange(len(data)), 60, SEQ, seed=1, cache_dir=prefix + "_cache", **kwargs)


def test_samples_equal_megatrons_masks_and_positions(corpus: str) -> None:
    ds = _dataset(corpus, eod_mask_token=EOD, reset_position_ids=True, reset_attention_mask=True)
    seen = {
        "no eod": 0,
        "one eod": 0,
        "several eods": 0,
        "eod as last input": 0,
        "eod as first input": 0,
        "consecutive eods": 0,
        "eod only as label": 0,
    }
    for i in range(len(ds)):
        sample = ds[i]
        tokens = sample["tokens"].tolist()
        ref = megatron_reference(tokens, EOD)
        assert sample["loss_mask"].tolist() == ref["loss_mask"]
        assert sample["position_ids"].dtype == torch.long and sample["position_ids"].tolist() == ref["position_ids"]
        cu = sample["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu.shape == (SEQ + 2,)
        assert cu.tolist() == ref["cu_seqlens"] + [-1] * (SEQ + 2 - len(ref["cu_seqlens"]))
        # what the model makes of cu_seqlens is Megatron's attention mask
        segments = [
            doc for doc, (start, end) in enumerate(document_ranges(cu.tolist(), SEQ)) for _ in range(start, end)
        ]
        allowed = [[k <= q and segments[q] == segments[k] for k in range(SEQ)] for q in range(SEQ)]
        assert allowed == ref["allowed"]
        eods = [j for j, t in enumerate(tokens[:-1]) if t == EOD]
        seen["no eod"] += not eods
        seen["one eod"] += len(eods) == 1
        seen["several eods"] += len(eods) >= 3
        seen["eod as last input"] += SEQ - 1 in eods
        seen["eod as first input"] += 0 in eods
        seen["consecutive eods"] += any(b == a + 1 for a, b in zip(eods, eods[1:]))
        seen["eod only as label"] += tokens[-1] == EOD and SEQ - 1 not in eods
    assert all(seen.values()), seen  # the corpus reaches every case


def test_options_are_independent_and_share_the_index_cache(corpus: str) -> None:
    plain = _dataset(corpus)
    positions = _dataset(corpus, eod_token=EOD, reset_position_ids=True)
    attention = _dataset(corpus, eod_token=EOD, reset_attention_mask=True)
    assert set(plain[0]) == {"tokens"}
    assert set(positions[0]) == {"tokens", "position_ids"} and set(attention[0]) == {"tokens", "cu_seqlens"}
    # the options are computed from the tokens: the index arrays (and their cache entry) do not change
    assert plain.unique_description_hash == positions.unique_description_hash == attention.unique_description_hash
    for i in range(len(plain)):
        ref = megatron_reference(plain[i]["tokens"].tolist(), EOD)
        assert positions[i]["position_ids"].tolist() == ref["position_ids"]
        assert attention[i]["cu_seqlens"][: len(ref["cu_seqlens"])].tolist() == ref["cu_seqlens"]


def test_dataset_errors_name_the_fix(corpus: str) -> None:
    with pytest.raises(ValueError, match="find documents by their EOD token; pass eod_token=tokenizer.eod"):
        _dataset(corpus, reset_attention_mask=True)
    with pytest.raises(ValueError, match="eod_token=1 and eod_mask_token=99 name different EOD ids"):
        _dataset(corpus, eod_token=1, eod_mask_token=EOD, reset_position_ids=True)


def _module(prefix: str, **kwargs: Any) -> PretrainDataModule:
    args: dict[str, Any] = dict(
        seq_length=SEQ,
        micro_batch_size=2,
        global_batch_size=4,
        split="80,20",
        cache_dir=prefix + "_cache",
        tokenizer=NullTokenizer(EOD + 1),
    )
    return PretrainDataModule([prefix], **{**args, **kwargs})


def test_datamodule_batches_carry_the_packing(corpus: str) -> None:
    dm = _module(corpus, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape == (4, SEQ + 1) and batch["cu_seqlens"].shape == (4, SEQ + 2)
    check_cu_seqlens(batch["cu_seqlens"], SEQ + 1)
    for row in range(4):
        ref = megatron_reference(batch["tokens"][row].tolist(), EOD)
        assert batch["position_ids"][row].tolist() == ref["position_ids"]
        assert batch["loss_mask"][row].tolist() == ref["loss_mask"]
    assert dm.hparams["reset_position_ids"] and dm.hparams["reset_attention_mask"]


def test_datamodule_refuses_bad_options_and_bad_packing(corpus: str) -> None:
    for name in ("reset_position_ids", "reset_attention_mask"):
        with pytest.raises(ValueError, match=f"{name}=True needs the tokenizer .*pass tokenizer="):
            _module(corpus, tokenizer=None, vocab_size=EOD + 1, **{name: True})
        with pytest.raises(ValueError, match=f"{name} must be true or false, got 'yes'"):
            _module(corpus, **{name: "yes"})

    class ShiftedPacking(PretrainDataModule):
        """A subclass whose own packing forgets the row's last token: setup must refuse it before training."""

        def _build(self, split: str) -> Any:
            dataset = super()._build(split)

            class Shifted(torch.utils.data.Dataset):
                def __len__(self) -> int:
                    return len(dataset)

                def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
                    sample = dict(dataset[i])
                    cu = sample["cu_seqlens"].clone()
                    cu[cu == SEQ + 1] = SEQ
                    return {**sample, "cu_seqlens": cu}

            return Shifted()

    dm = ShiftedPacking(
        [corpus],
        seq_length=SEQ,
        micro_batch_size=2,
        global_batch_size=4,
        split="80,20",
        cache_dir=corpus + "_cache",
        tokenizer=NullTokenizer(EOD + 1),
        reset_attention_mask=True,
    )
    with pytest.raises(
        ValueError,
        match=r"the first train sample's cu_seqlens = \[0, .*\] is not a packed row of "
        r"9 tokens: its last entry before the padding is 8, but it must be the "
        r"row length 9",
    ):
        dm.setup("fit")


@pytest.mark.parametrize("cu", [[0, 9], [0, 4, 9, -1, -1], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
def test_check_cu_seqlens_accepts_packed_rows(cu: list[int]) -> None:
    check_cu_seqlens(torch.tensor(cu, dtype=torch.int32), 9)
    check_cu_seqlens(torch.tensor([cu, cu], dtype=torch.int64), 9)


@pytest.mark.parametrize(
    "cu, message",
    [
        ([1, 4, 9], "it starts at 1, but the first document starts at offset 0"),
        ([-1, 4, 9], "it starts at -1, but the first document starts at offset 0"),
        ([0, 4, 4, 9], r"entry 2 \(4\) is not greater than entry 1 \(4\): offsets must strictly increase"),
        ([0, 6, 4, 9], r"entry 2 \(4\) is not greater than entry 1 \(6\)"),
        ([0, 4, 8, -1], "its last entry before the padding is 8, but it must be the row length 9"),
        ([0, 4, 10, -1], "its last entry before the padding is 10, but it must be the row length 9"),
        ([0, 4, 9, -1, 3], "entry 4 is 3 after the -1 padding began at entry 3: padding goes only at the end"),
        ([0, 4, -1, 9], "entry 3 is 9 after the -1 padding began at entry 2"),
        ([0, -2, 9], "entry 1 is -2: offsets are >= 0 and the padding is -1"),
    ],
)
def test_check_cu_seqlens_says_what_is_wrong(cu: list[int], message: str) -> None:
    fix = r"cu_seqlens lists each document's start offset in the row .* fix the packing that built it"
    with pytest.raises(ValueError, match=rf"cu_seqlens = \[.*\] is not a packed row of 9 tokens: {message}.*{fix}"):
        check_cu_seqlens(torch.tensor(cu), 9)
    batch = torch.tensor([[0, 9] + [-1] * (len(cu) - 2), cu])
    with pytest.raises(ValueError, match=rf"^rows' cu_seqlens \(row 1 of the batch\) = .*{message}"):
        check_cu_seqlens(batch, 9, "rows' cu_seqlens")


def test_check_cu_seqlens_refuses_wrong_types_and_shapes() -> None:
    with pytest.raises(ValueError, match="must be an integer tensor .* got torch.float32"):
        check_cu_seqlens(torch.tensor([0.0, 9.0]), 9)
    with pytest.raises(ValueError, match="must be an integer tensor .* got list"):
        check_cu_seqlens([0, 9], 9)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shape \[k\] or \[batch, k\] with k >= 2 .* got \(1,\)"):
        check_cu_seqlens(torch.tensor([0]), 9)
    with pytest.raises(ValueError, match=r"got \(1, 1, 2\)"):
        check_cu_seqlens(torch.tensor([[[0, 9]]]), 9)
    with pytest.raises(ValueError, match="row_length must be a positive integer"):
        check_cu_seqlens(torch.tensor([0, 9]), 0)
