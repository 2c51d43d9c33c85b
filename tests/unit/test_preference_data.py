"""Preference data: token ids, lengths, prompt lengths and response loss masks checked by hand, a real
(SentencePiece) tokenizer's prompt/response boundary, batches of one optimizer step, and bad input."""

import json
from pathlib import Path

import pytest

from megatron_lite.data import PreferenceDataModule, PreferenceDataset, bundled_corpus
from megatron_lite.data.preference import read_preferences
from megatron_lite.tokenizers import NullTokenizer, build_tokenizer

EOD = 49
NULL = NullTokenizer(EOD + 1)  # text "1 2 3" is the ids; EOD = 49 (also the padding: no pad id)


def write(path: Path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def test_items_by_hand(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "1 2 3", "chosen": "4 5 6", "rejected": "7"}])
    item = PreferenceDataset(read_preferences(path), NULL, seq_length=8)[0]
    assert item["chosen_tokens"].tolist() == [1, 2, 3, 4, 5, 6, EOD, EOD, EOD]  # seq_length + 1 columns
    assert item["rejected_tokens"].tolist() == [1, 2, 3, 7, EOD, EOD, EOD, EOD, EOD]
    assert (item["chosen_length"].item(), item["rejected_length"].item(), item["prompt_length"].item()) == (7, 5, 3)
    # mask[j] = 1 where tokens[j + 1] is a response token (EOD included): response-only log-probs for DPO
    assert item["chosen_loss_mask"].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    assert item["rejected_loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]


def test_long_response_is_cut_to_seq_length_and_counted(tmp_path):
    path = write(
        tmp_path / "p.jsonl", [{"prompt": "1 2", "chosen": "3 4 5 6 7 8 9 10", "rejected": "11", "extra": "ignored"}]
    )
    dataset = PreferenceDataset(read_preferences(path), NULL, seq_length=6)
    item = dataset[0]
    assert item["chosen_tokens"].tolist() == [1, 2, 3, 4, 5, 6, EOD]  # the last column is always padding
    assert item["chosen_length"].item() == 6 and dataset.num_truncated == 1
    assert item["chosen_loss_mask"].tolist() == [0, 1, 1, 1, 1, 0]
    assert item["rejected_tokens"].tolist() == [1, 2, 11, EOD, EOD, EOD, EOD]


def test_empty_prompt_and_no_eod(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"prompt": "", "chosen": "4 5", "rejected": "6"}])
    item = PreferenceDataset(read_preferences(path), NULL, seq_length=4, append_eod=False)[0]
    assert item["chosen_tokens"].tolist() == [4, 5, EOD, EOD, EOD] and item["chosen_length"].item() == 2
    assert item["prompt_length"].item() == 0 and item["chosen_loss_mask"].tolist() == [1, 0, 0, 0]


def test_sentencepiece_prompt_response_boundary(tmp_path):
    tokenizer = build_tokenizer(
        "SentencePieceTokenizer", train_corpus=bundled_corpus(), vocab_size=600, output_prefix=tmp_path / "spm"
    )
    pair = {"prompt": "Who comes here?", "chosen": " A friend, my lord.", "rejected": " Nobody."}
    item = PreferenceDataset(read_preferences(write(tmp_path / "p.jsonl", [pair])), tokenizer, seq_length=32)[0]
    p = item["prompt_length"].item()
    for name in ("chosen", "rejected"):
        tokens, n = item[f"{name}_tokens"].tolist(), item[f"{name}_length"].item()
        assert tokenizer.detokenize(tokens[:p]) == pair["prompt"]
        assert tokenizer.detokenize(tokens[p : n - 1]) == pair[name] and tokens[n - 1] == tokenizer.eod
        masked = [tokens[j + 1] for j, m in enumerate(item[f"{name}_loss_mask"].tolist()) if m]
        assert masked == tokens[p:n]


def test_datamodule_batches_are_one_step_of_pairs(tmp_path):
    rows = [{"prompt": f"{i}", "chosen": "1 2", "rejected": "3"} for i in range(10)]
    more = [{"q": "5", "good": "6", "bad": "7 8"}] * 6
    data = PreferenceDataModule(
        [write(tmp_path / "a.jsonl", rows)], NULL, seq_length=8, micro_batch_size=2, global_batch_size=4, split="10,6"
    )
    batch = next(iter(data.train_dataloader()))
    assert batch["chosen_tokens"].shape == batch["rejected_tokens"].shape == (4, 9)
    assert batch["chosen_length"].shape == batch["prompt_length"].shape == (4,)
    assert batch["chosen_loss_mask"].shape == (4, 8) and next(iter(batch)) == "chosen_tokens"
    assert len(data.datasets["train"]) + len(data.datasets["validation"]) == 10
    assert data.vocab_size == 50 and data.seq_length == 8 and data.global_batch_size == 4
    other = PreferenceDataModule(
        write(tmp_path / "b.jsonl", more),
        NULL,
        seq_length=8,
        micro_batch_size=1,
        global_batch_size=2,
        split="100,0",
        prompt_key="q",
        chosen_key="good",
        rejected_key="bad",
    )
    other.setup()
    assert other.datasets["train"][0]["rejected_tokens"].tolist()[:4] == [5, 7, 8, EOD]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "holds no preference pairs"),
        (["", "  "], "holds no preference pairs"),
        ([{"prompt": "1", "chosen": "2"}], "p.jsonl:1 lacks string field(s) ['rejected']"),
        (
            [{"prompt": "1", "chosen": "2", "rejected": "3"}, {"prompt": 1, "chosen": "2", "rejected": "3"}],
            "p.jsonl:2 lacks string field(s) ['prompt']",
        ),
        (["{not json"], "p.jsonl:1 is not valid JSON"),
        (["[1, 2]"], "p.jsonl:1 is a JSON list"),
    ],
)
def test_bad_files(tmp_path, rows, message):
    with pytest.raises(ValueError) as err:
        read_preferences(write(tmp_path / "p.jsonl", rows))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "pair, kwargs, message",
    [
        (
            {"prompt": "1 2 3 4", "chosen": "5", "rejected": "6"},
            {},
            "p.jsonl:1: the prompt's 4 tokens fill seq_length=4, "
            "leaving nothing of the chosen response; raise seq_length or shorten the prompt",
        ),
        (
            {"prompt": "1", "chosen": "2", "rejected": ""},
            {"append_eod": False},
            "p.jsonl:1: the rejected response is empty",
        ),
    ],
)
def test_responses_that_vanish(tmp_path, pair, kwargs, message):
    with pytest.raises(ValueError) as err:
        PreferenceDataset(read_preferences(write(tmp_path / "p.jsonl", [pair])), NULL, seq_length=4, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_file_and_empty_split(tmp_path):
    with pytest.raises(FileNotFoundError, match="preference data .*nope.jsonl does not exist; pass data.path="):
        PreferenceDataModule(str(tmp_path / "nope.jsonl"), NULL)
    data = PreferenceDataModule(
        write(tmp_path / "p.jsonl", [{"prompt": "1", "chosen": "2", "rejected": "3"}] * 4),
        NULL,
        seq_length=8,
        micro_batch_size=1,
        global_batch_size=2,
        split="100,0",
    )
    with pytest.raises(ValueError, match="the validation split of .* is empty; give it a weight in split"):
        data.val_dataloader()
    with pytest.raises(TypeError, match="tokenizer must be a megatron_lite Tokenizer"):
        PreferenceDataModule(str(tmp_path / "p.jsonl"), "gpt2")
