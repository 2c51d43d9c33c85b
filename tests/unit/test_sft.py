"""SFT data: assistant-only loss masks through a real chat template and tokenizer, packing, errors."""

import json
from pathlib import Path

import pytest
import torch

from megatron_lite.core.parallel.packing import check_cu_seqlens
from megatron_lite.data.sft import SFTDataModule, SFTDataset, pack, read_conversations, tokenize_conversation
from megatron_lite.tokenizers import DEFAULT_CHAT_TEMPLATE, GPT2BPETokenizer, render_chat_template

GPT2 = Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "gpt2"  # tests/data/README.md: origin, licence

CONVERSATIONS = [
    [
        {"role": "system", "content": "You speak like Shakespeare."},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "A humble player upon this stage."},
        {"role": "user", "content": "And where?"},
        {"role": "assistant", "content": "In fair Verona, where we lay our scene."},
    ],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Good morrow!"}],
]


@pytest.fixture(scope="module")
def tokenizer():
    return GPT2BPETokenizer(str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt"))


def _render(messages, add_generation_prompt):
    return render_chat_template(DEFAULT_CHAT_TEMPLATE, list(messages), add_generation_prompt=add_generation_prompt)


def test_only_assistant_replies_are_trained(tokenizer):
    ids, mask = tokenize_conversation(CONVERSATIONS[0], _render, tokenizer.tokenize, tokenizer.eod)
    assert tokenizer.detokenize(ids[:-1].tolist()) == _render(CONVERSATIONS[0], False)  # nothing lost or added
    trained = tokenizer.detokenize(ids[mask == 1][:-1].tolist())
    replies = [m["content"] for m in CONVERSATIONS[0] if m["role"] == "assistant"]
    assert trained == "".join(f"{r}<|im_end|>\n" for r in replies)
    assert ids[-1] == tokenizer.eod and mask[-1] == 1


def test_packing_is_in_order_and_respects_capacity():
    assert pack([3, 4, 2, 6, 1], capacity=7) == [[0, 1], [2], [3, 4]]
    assert pack([9], capacity=7) == [[0]]  # truncated, still its own bin


@pytest.mark.parametrize("pack_sequences", [True, False])
def test_samples_are_fixed_size_and_consistent(tokenizer, pack_sequences):
    conversations = CONVERSATIONS * 6  # 115 and 42 tokens: bins of 161 hold 115+42 or 3x42
    ds = SFTDataset(conversations, tokenizer, seq_length=160, pack_sequences=pack_sequences, seed=0)
    if pack_sequences:
        assert len(ds) < len(conversations) and ds.max_seqs >= 2
    else:
        assert len(ds) == len(conversations) and ds.max_seqs == 1
    assert ds.num_truncated == 0
    for item in ds:
        assert (
            item["tokens"].shape == (161,)
            and item["loss_mask"].shape == (160,)
            and item["position_ids"].shape == (160,)
        )
        cu = item["cu_seqlens"]
        assert cu.shape == (ds.cu_seqlens_length,) and cu.dtype == torch.int32
        check_cu_seqlens(cu, 161)  # starts at 0, strictly increasing, ends at the row length, then -1
        used = cu[cu >= 0].tolist()
        assert len(used) - 1 <= ds.max_seqs + 1  # the conversations, and the padding when the row is not full
        padding = item["tokens"][used[-2] :] == ds.pad
        if bool(padding.all()):  # the row's last document is its padding: never trained
            assert torch.all(item["loss_mask"][used[-2] - 1 :] == 0)
        for start in used[1:-1]:
            assert item["loss_mask"][start - 1] == 0  # no loss across a conversation boundary
        for start in used[:-1]:
            assert item["position_ids"][start] == 0
        assert item["loss_mask"].sum() > 0


def test_a_full_row_ends_without_a_padding_document(tokenizer):
    # 115 + 42 tokens fill a row of 157 exactly (in either order); two 42-token conversations leave 73 of padding
    ds = SFTDataset(CONVERSATIONS * 3, tokenizer, seq_length=156, seed=0)
    rows = {tuple(int(x) for x in item["cu_seqlens"] if x >= 0): item for item in ds}
    assert set(rows) == {(0, 115, 157), (0, 42, 157), (0, 42, 84, 157)}
    assert torch.all(rows[(0, 42, 84, 157)]["tokens"][84:] == ds.pad)
    assert ds.cu_seqlens_length == 4 and all(len(item["cu_seqlens"]) == 4 for item in ds)


def test_long_conversations_are_truncated_and_counted(tokenizer):
    ds = SFTDataset(CONVERSATIONS * 2, tokenizer, seq_length=64, seed=0)
    assert ds.num_truncated == 2 and len(ds) == 4


def test_bad_files(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"conversation": []}) + "\n")
    with pytest.raises(ValueError, match="has no non-empty list under 'messages'"):
        read_conversations(str(path))
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant turn"):
        read_conversations(str(path))
    path.write_text(json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="every message needs a role"):
        read_conversations(str(path))


def test_datamodule_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="SFT data .* does not exist"):
        SFTDataModule(str(tmp_path / "none.jsonl"), tokenizer)
