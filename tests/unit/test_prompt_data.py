"""PromptDataModule: its batches, and its bad input refused at construction (before any process starts)."""

import pytest
import torch

import megatron_lite as ml
from megatron_lite.data import PromptDataModule
from megatron_lite.tokenizers import build_tokenizer


def test_batches_carry_prompts_lengths_indices_and_options():
    data = PromptDataModule(
        [[5, 6, 7], [8], [9, 10]], batch_size=2, max_new_tokens=4, temperature=0.5, seed=3, stop_ids=[2]
    )
    first, second = list(data.predict_dataloader())
    assert first["prompt_tokens"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert first["prompt_lengths"].tolist() == [3, 1] and first["index"].tolist() == [0, 1]
    assert second["index"].tolist() == [2]
    assert first["generation"] == {
        "max_new_tokens": 4,
        "temperature": 0.5,
        "top_k": 0,
        "top_p": 1.0,
        "seed": 3,
        "stop_ids": [2],
    }


def test_text_prompts_are_tokenized():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    data = PromptDataModule(["5 6 7", [1, 2]], tokenizer=tokenizer)
    assert data.prompts == [tokenizer.tokenize("5 6 7"), [1, 2]]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(prompts=[]), ValueError, "prompts is empty"),
        (dict(prompts="hello"), TypeError, r"wrap a single prompt in a list"),
        (dict(prompts=["hello"]), ValueError, "text prompts need a tokenizer"),
        (dict(prompts=[[1, -2]]), ValueError, "prompt 0, token 1 is -2, a token id must be >= 0"),
        (dict(prompts=[[1]], top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(prompts=[[1]], temperature=-1.0), ValueError, "temperature must be a finite number >= 0"),
        (dict(prompts=[[1]], max_new_tokens=-1), ValueError, "max_new_tokens must be an integer >= 0"),
        (dict(prompts=[[1]], batch_size=0), ValueError, "batch_size must be a positive integer"),
    ],
)
def test_bad_input_is_refused_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        PromptDataModule(**kwargs)


def test_prompts_are_checked_against_the_model():
    config = ml.GPTConfig(vocab_size=100, seq_length=16)
    PromptDataModule([[1] * 10], max_new_tokens=6).check_fits_model(config)
    with pytest.raises(ValueError, match="lower max_new_tokens to 6"):
        PromptDataModule([[1] * 10], max_new_tokens=7).check_fits_model(config)
    with pytest.raises(ValueError, match=r"stop id is 100, outside the model's vocabulary \[0, 100\)"):
        PromptDataModule([[1]], max_new_tokens=4, stop_ids=[100]).check_fits_model(config)
    assert torch.equal(PromptDataModule([[1, 2]]).dataset[0]["prompt"], torch.tensor([1, 2]))
