"""Packed preference rows (issue 16): first-fit is first-fit and deterministic; a packed row holds each pair's
chosen and rejected sequences as documents with the same tokens and response masks as the unpacked pair
(checked by hand), cu_seqlens in the packed-row format, positions restarting per sequence; DPO's sequence
slots put every response token's log-prob in its pair's slot; a pair longer than a row is refused naming
the line and the fix (from fit: in the launching process, before any rank starts); packing cuts the padding;
packing is deterministic; the reward model, which reads one pair per row pair, refuses packed rows."""

import json
import random

import pytest
import torch

from megatron_lite.data import PreferenceDataModule, PreferenceDataset
from megatron_lite.data.preference import first_fit, max_pairs_per_row, read_preferences
from megatron_lite.rl.dpo import pair_microbatch
from megatron_lite.tokenizers import NullTokenizer

EOD = 99
NULL = NullTokenizer(EOD + 1)


def write(path, rows) -> str:
    with open(path, "w") as f:
        for prompt, chosen, rejected in rows:
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return str(path)


def naive_first_fit(sizes, capacity):
    bins, room = [], []
    for i, size in enumerate(sizes):
        for b in range(len(bins)):
            if room[b] >= size:
                bins[b].append(i)
                room[b] -= size
                break
        else:
            bins.append([i])
            room.append(capacity - size)
    return bins


def test_first_fit():
    assert first_fit([5, 4, 3, 2, 6], 8) == [[0, 2], [1, 3], [4]]
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 17) for _ in range(rng.randint(1, 60))]
        assert first_fit(sizes, 17) == naive_first_fit(sizes, 17)


def test_packed_row_by_hand(tmp_path):
    # Sequences (prompt + response + EOD): pair 0: 3 + 3 / 3 + 2 tokens, pair 1: 2 + 3 / 2 + 2, pair 2: 1 + 6 / 1 + 6.
    rows = [("1 2 3", "4 5", "6"), ("7 8", "9 10", "12"), ("14", "1 2 3 4 5", "6 7 8 9 10")]
    pairs = read_preferences(write(tmp_path / "p.jsonl", rows))
    plain = PreferenceDataset(pairs, NULL, seq_length=19)
    packed = PreferenceDataset(pairs, NULL, seq_length=19, pack_sequences=True)  # rows of 20 tokens
    assert len(packed) == 2  # 6 + 5 + 5 + 4 = 20 fills row 0; pair 2's 7 + 7 goes into row 1
    row = packed[0]
    assert row["tokens"].tolist() == [1, 2, 3, 4, 5, EOD, 1, 2, 3, 6, EOD, 7, 8, 9, 10, EOD, 7, 8, 12, EOD]
    assert row["cu_seqlens"].tolist() == [0, 6, 11, 16, 20] + [-1] * (2 * max_pairs_per_row(19) + 2 - 5)
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
    assert row["index"].tolist() == [0, 1] + [-1] * (max_pairs_per_row(19) - 2)
    # each document's mask is the unpacked sequence's mask, shifted to where the document starts
    starts = [0, 6, 11, 16]
    for doc, (pair, name) in enumerate([(0, "chosen"), (0, "rejected"), (1, "chosen"), (1, "rejected")]):
        n = plain[pair][f"{name}_length"].item()
        assert row["tokens"][starts[doc] : starts[doc] + n].tolist() == plain[pair][f"{name}_tokens"][:n].tolist()
        assert (
            row["loss_mask"][starts[doc] : starts[doc] + n - 1].tolist()
            == plain[pair][f"{name}_loss_mask"][: n - 1].tolist()
        )
    assert row["loss_mask"].sum() == sum(
        plain[p][f"{k}_loss_mask"].sum() for p in (0, 1) for k in ("chosen", "rejected")
    )
    assert row["loss_mask"][[5, 10, 15]].tolist() == [0, 0, 0]  # never predicts the next sequence's first token
    assert packed[1]["cu_seqlens"].tolist()[:4] == [0, 7, 14, 20]  # a padding document ends the row
    assert packed.padding_fraction == pytest.approx(1 - 34 / 40)
    assert plain.padding_fraction == pytest.approx(1 - 34 / 120)

    # DPO's slots: chosen of (row r, pair p) at r·P + p, rejected at n + r·P + p, padding 2n.
    batch = {k: torch.stack([packed[0][k], packed[1][k]]) for k in packed[0]}
    slot = pair_microbatch(batch)["sequence_slot"]
    P = max_pairs_per_row(19)
    n = 2 * P
    assert slot[0].tolist() == [0] * 5 + [n] * 5 + [1] * 5 + [n + 1] * 4
    assert slot[1].tolist() == [P] * 6 + [n + P] * 7 + [2 * n] * 6


def test_a_pair_longer_than_a_row_is_refused(tmp_path):
    path = write(tmp_path / "p.jsonl", [("1", "2", "3"), ("1 2 3 4", "5 6 7 8 9", "10 11 12 13")])
    data = PreferenceDataModule(
        path, NULL, seq_length=15, micro_batch_size=1, global_batch_size=1, split="100,0", pack_sequences=True
    )
    with pytest.raises(
        ValueError,
        match=r"p\.jsonl:2: the pair's chosen and rejected sequences hold 10 \+ 9 "
        r"tokens.*raise seq_length to >= 18, or set pack_sequences=False",
    ):
        data.setup()


def test_packing_is_deterministic(tmp_path):
    rng = random.Random(1)
    words = lambda k: " ".join(str(rng.randrange(EOD)) for _ in range(k))  # noqa: E731
    path = write(
        tmp_path / "p.jsonl",
        [(words(rng.randint(1, 5)), words(rng.randint(0, 6)), words(rng.randint(0, 6))) for _ in range(40)],
    )
    samples = []
    for _ in range(2):
        data = PreferenceDataModule(
            path,
            NULL,
            seq_length=31,
            micro_batch_size=1,
            global_batch_size=2,
            split="90,10",
            pack_sequences=True,
            seed=5,
        )
        data.setup()
        samples.append([row for name in ("train", "validation") for row in data.datasets[name].samples])
    assert len(samples[0]) < 20  # several pairs per row
    for a, b in zip(*samples):
        assert all(torch.equal(a[k], b[k]) for k in a)
    indices = [i for r in samples[0] for i in r["index"].tolist() if i >= 0]
    assert sorted(indices) == list(range(40))  # every pair exactly once over the splits


def test_a_pair_longer_than_a_row_fails_before_any_rank_starts(tmp_path):
    import lightning as L

    import megatron_lite as ml
    from megatron_lite.rl import DPOModule

    path = write(tmp_path / "p.jsonl", [("1", "2", "3"), ("1 2 3 4", "5 6 7 8 9", "10 11 12 13")])
    data = PreferenceDataModule(
        path, NULL, seq_length=16, micro_batch_size=1, global_batch_size=2, split="100,0", pack_sequences=True
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    module = DPOModule(
        ml.GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=EOD + 1, seq_length=16)
    )
    with pytest.raises(ValueError, match=r"p\.jsonl:2: .* raise seq_length to >= 18"):
        trainer.fit(module, data)


def test_the_reward_model_refuses_packed_rows(tmp_path):
    import lightning as L

    import megatron_lite as ml
    from megatron_lite.rl import RewardModelModule

    data = PreferenceDataModule(
        write(tmp_path / "p.jsonl", [("1", "2", "3")] * 4),
        NULL,
        seq_length=16,
        micro_batch_size=1,
        global_batch_size=1,
        split="100,0",
        pack_sequences=True,
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    module = RewardModelModule(
        ml.GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=EOD + 1, seq_length=16)
    )
    with pytest.raises(
        ValueError,
        match="RewardModelModule reads one pair per row pair: set the PreferenceDataModule's pack_sequences=False",
    ):
        trainer.fit(module, data)
