"""A Hugging Face Llama imported with ``GPTModule.from_pretrained`` generates what ``transformers``' own
``generate`` does on the same weights: greedy tokens and the scores of each step (tiny random Llamas,
saved with ``save_pretrained``; nothing is downloaded)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import megatron_lite as ml
from megatron_lite import ParallelConfig, ParallelLayout
from megatron_lite.core.checkpoint.full.state import carry_over_state
from megatron_lite.core.inference import generate
from megatron_lite.core.models import GPTModel

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from spawn_utils import run_ranks  # noqa: E402

PROMPTS = [[5, 17, 42, 8, 9], [7, 7, 1], [250]]
NEW = 16


def _llama(directory: Path, **overrides) -> Path:
    config = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    config.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    model.save_pretrained(directory)
    return directory


def _transformers_generate(directory: Path, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    model = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    log_probs = torch.stack([torch.log_softmax(step[0].float(), -1)[t] for step, t in zip(out.logits, tokens)])
    return tokens, log_probs


@pytest.mark.parametrize(
    "overrides", [dict(), dict(tie_word_embeddings=True, num_key_value_heads=8)], ids=["gqa-untied", "mha-tied"]
)
def test_imported_llama_generates_what_transformers_does(tmp_path, overrides):
    directory = _llama(tmp_path / "llama", **overrides)
    module = ml.GPTModule.from_pretrained(directory)
    ours = module.generate(PROMPTS, NEW, return_log_probs=True)  # one batch, prompts of different lengths
    for i, prompt in enumerate(PROMPTS):
        tokens, log_probs = _transformers_generate(directory, prompt)
        assert ours.tokens[i] == tokens
        torch.testing.assert_close(
            torch.tensor(ours.log_probs[i], dtype=torch.float32), log_probs, rtol=1e-4, atol=1e-4
        )


def _tp2(rank, world_size, directory):
    module = ml.GPTModule.from_pretrained(directory)
    layout = ParallelLayout.build(ParallelConfig(tensor_model_parallel_size=2))
    model = GPTModel(module.config, layout, seed=module.seed)
    carry_over_state(module.model, model, vocab_size=module.config.vocab_size)  # what configure_model does
    out = generate(model, PROMPTS, NEW).tokens
    layout.destroy()
    return out


def test_imported_llama_under_tp2_generates_what_transformers_does(tmp_path):
    directory = _llama(tmp_path / "llama")
    expected = [_transformers_generate(directory, p)[0] for p in PROMPTS]
    assert run_ranks(_tp2, 2, directory) == [expected, expected]
