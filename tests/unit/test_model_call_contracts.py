"""Calls the type checker showed could not work: a RewardModel called with GPTModel's positional arguments,
and generation or speculative decoding with a model built without its output layer (one clear error
up front, instead of a TypeError from deep inside)."""

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.inference import generate
from megatron_lite.core.inference.speculative import speculative_generate
from megatron_lite.core.models.draft_head import EagleDraftHead
from megatron_lite.core.models.reward import RewardModel

CONFIG = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8)


def test_reward_model_takes_gpt_models_arguments_by_position():
    model = RewardModel(CONFIG, seed=3).eval()
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    positions = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        by_name = model(tokens, position_ids=positions, chunk=0)
        # GPTModel.forward(tokens, labels, position_ids, cu_seqlens, hidden_states, chunk)
        by_position = model(tokens, None, positions, None, None, 0)
    torch.testing.assert_close(by_position, by_name, rtol=0, atol=0)


def test_generation_refuses_a_model_without_its_output_layer():
    trunk = ml.GPTModel(CONFIG, seed=3, output_layer=False)
    with pytest.raises(ValueError, match="output_layer=False"):
        generate(trunk, [[1, 2, 3]], max_new_tokens=2)


def test_speculative_decoding_refuses_a_base_without_its_output_layer():
    trunk = ml.GPTModel(CONFIG, seed=3, output_layer=False)
    with pytest.raises(ValueError, match="output_layer=False"):
        speculative_generate(trunk, EagleDraftHead(CONFIG), [[1, 2, 3]], max_new_tokens=2, check_base=False)
