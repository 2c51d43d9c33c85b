"""Chat preference pairs for DPO: both line forms (two conversations, or prompt messages + two replies)
tokenized with the chat template, prompt and assistant header masked (ids checked by hand with an
id-rendering template, and with GPT-2 BPE and the default ChatML template); each pair's global index;
bad chat lines name the line and the fix."""

import json
from pathlib import Path

import pytest

from megatron_lite.data import PreferenceDataModule, PreferenceDataset
from megatron_lite.data.preference import read_preferences
from megatron_lite.tokenizers import NullTokenizer, build_tokenizer

EOD = 49
NULL = NullTokenizer(EOD + 1)
# Renders ids: user turns start with 1, assistant turns with 2, every turn ends with 3; the generation
# prompt is the assistant header 2.
IDS_TEMPLATE = (
    "{% for m in messages %}{{ ('1 ' if m['role'] == 'user' else '2 ') + m['content'] + ' 3 ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '2 ' }}{% endif %}"
)
GPT2 = Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "gpt2"
USER = {"role": "user", "content": "10 11"}


def write(path: Path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "row",
    [
        {
            "chosen": [USER, {"role": "assistant", "content": "20 21"}],
            "rejected": [USER, {"role": "assistant", "content": "30"}],
        },
        {"prompt": [USER], "chosen": {"role": "assistant", "content": "20 21"}, "rejected": "30"},
        {
            "prompt": [USER],
            "chosen": [USER, {"role": "assistant", "content": "20 21"}],
            "rejected": [{"role": "assistant", "content": "30"}],
        },
    ],
)
def test_chat_pairs_by_hand(tmp_path, row):
    item = PreferenceDataset(
        read_preferences(write(tmp_path / "p.jsonl", [row])), NULL, seq_length=12, chat_template=IDS_TEMPLATE
    )[0]
    # prompt "1 10 11 3 2" (user turn + assistant header), then the reply and its end "20 21 3", then EOD
    assert item["chosen_tokens"].tolist() == [1, 10, 11, 3, 2, 20, 21, 3, EOD] + [EOD] * 4
    assert item["rejected_tokens"].tolist() == [1, 10, 11, 3, 2, 30, 3, EOD] + [EOD] * 5
    assert item["prompt_length"].item() == 5
    assert item["chosen_loss_mask"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]  # predicts 20 21 3 EOD
    assert item["rejected_loss_mask"].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]


def test_chat_pair_with_gpt2_and_the_default_template(tmp_path):
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2 / "vocab.json", merge_file=GPT2 / "merges.txt")
    row = {
        "prompt": [{"role": "user", "content": "Who comes here?"}],
        "chosen": "A friend, my lord.",
        "rejected": "Nobody.",
    }
    item = PreferenceDataset(read_preferences(write(tmp_path / "p.jsonl", [row])), tokenizer, seq_length=48)[0]
    p = item["prompt_length"].item()
    tokens = item["chosen_tokens"].tolist()
    assert tokenizer.detokenize(tokens[:p]) == "<|im_start|>user\nWho comes here?<|im_end|>\n<|im_start|>assistant\n"
    n = item["chosen_length"].item()
    assert tokens[n - 1] == tokenizer.eod
    assert tokenizer.detokenize(tokens[p : n - 1]) == "A friend, my lord.<|im_end|>\n"
    assert item["chosen_loss_mask"].sum().item() == n - p  # the reply, its end marker and EOD


def test_pairs_carry_a_global_index_unique_across_splits(tmp_path):
    rows = [{"prompt": f"{i}", "chosen": "1", "rejected": "2"} for i in range(10)]
    data = PreferenceDataModule(
        write(tmp_path / "p.jsonl", rows),
        NULL,
        seq_length=4,
        micro_batch_size=1,
        global_batch_size=1,
        split="80,20",
        seed=5,
    )
    data.setup()
    seen = {}
    for dataset in data.datasets.values():
        for item in dataset:
            seen[item["index"].item()] = item["chosen_tokens"][0].item()  # the prompt "i" is token i
    assert seen == {i: i for i in range(10)}


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {
                "chosen": [USER, {"role": "assistant", "content": "1"}],
                "rejected": [{"role": "user", "content": "9"}, {"role": "assistant", "content": "2"}],
            },
            "p.jsonl:1: 'chosen' and 'rejected' must be conversations with the same messages before their last",
        ),
        (
            {"prompt": [USER], "chosen": {"role": "user", "content": "1"}, "rejected": "2"},
            "p.jsonl:1: the chosen reply must be an assistant message",
        ),
        ({"prompt": [USER], "chosen": "1"}, "p.jsonl:1 lacks the field 'rejected'"),
        (
            {"prompt": [{"role": "robot", "content": "1"}], "chosen": "1", "rejected": "2"},
            "p.jsonl:1: 'prompt' must be a non-empty list of",
        ),
    ],
)
def test_bad_chat_lines(tmp_path, row, message):
    with pytest.raises(ValueError) as err:
        read_preferences(write(tmp_path / "p.jsonl", [row]))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_bad_line_is_reported_when_the_datamodule_is_made(tmp_path):
    """Before any process is started (the CLI prints this one line): the file is read in __init__."""
    path = write(
        tmp_path / "p.jsonl", [{"prompt": "1", "chosen": "2", "rejected": "3"}, {"prompt": "1", "chosen": "2"}]
    )
    with pytest.raises(ValueError, match=r"p.jsonl:2 lacks string field\(s\) \['rejected'\]"):
        PreferenceDataModule(path, NULL, seq_length=4)
