"""Loss-masked (SFT) training keeps the global-batch semantics under DP and TP.

Each DP rank sees a different number of trained tokens; the loss must still be the mean over
every trained token of the global batch, so DP2 and TP2 equal one process exactly.
"""

import gzip
import json
from pathlib import Path

import pytest
from parity_utils import assert_same_training, run, tiny_config

from megatron_lite.data import bundled_corpus
from megatron_lite.data.sft import SFTDataModule
from megatron_lite.tokenizers import GPT2BPETokenizer

GPT2 = Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "gpt2"  # tests/data/README.md: origin, licence


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    with gzip.open(bundled_corpus("shakespeare"), "rt") as f:
        lines = [line.strip() for line in json.loads(f.readline())["text"].splitlines() if line.strip()][:400]
    path = tmp_path_factory.mktemp("sft") / "chat.jsonl"
    with open(path, "w") as f:
        for i in range(0, len(lines) - 4, 4):  # replies of different lengths: uneven masks across ranks
            messages = [
                {"role": "user", "content": lines[i]},
                {"role": "assistant", "content": " ".join(lines[i + 1 : i + 1 + (i // 4) % 3 + 1])},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def _data(path):
    tokenizer = GPT2BPETokenizer(str(GPT2 / "vocab.json"), str(GPT2 / "merges.txt"))
    return SFTDataModule(
        path,
        tokenizer,
        seq_length=64,
        micro_batch_size=2,
        global_batch_size=8,
        split="100,0",
        pack_sequences=True,
        seed=3,
    )


@pytest.mark.parametrize("layout", [dict(devices=2, tp=1), dict(devices=2, tp=2)], ids=["dp2", "tp2"])
def test_sft_layouts_match_single_process(sft_file, tmp_path, layout):
    # 64 x tp pads 50257 to 50304 at TP1 and TP2 alike (Megatron pads to a multiple of divisor x tp).
    config = tiny_config(vocab_size=50257, seq_length=64, make_vocab_size_divisible_by=64)
    reference = run(tmp_path / "single", devices=1, config=config, steps=4, data=_data(sft_file))
    result = run(tmp_path / "parallel", config=config, steps=4, data=_data(sft_file), **layout)
    assert_same_training(result, reference)
