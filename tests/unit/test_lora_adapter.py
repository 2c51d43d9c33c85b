"""The LoRA adapter on one process (issue 24): it adds exactly ``alpha/dim · B A x`` to its layer (checked against the
formula on the layer's own input), starts as the base (B = 0), switches off to the base, merges into the weights
with the same logits, freezes everything but the adapters, carries its recipe through a state dict, and applies its
dropout only in training and only on its own path."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.core.peft import (
    LoRAConfig,
    adapters,
    adapters_disabled,
    apply_lora,
    lora_recipe,
    merge_lora,
    restore_lora,
)

CONFIG = GPTConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    seq_length=16,
    activation="swiglu",
    normalization="RMSNorm",
)


def _adapted(config: Optional[LoRAConfig] = None) -> GPTModel:
    model = GPTModel(CONFIG, seed=3)
    apply_lora(model, config or LoRAConfig(dim=4, alpha=8), model.layout, seed=5)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, adapter in adapters(model):  # a trained B (it starts at zero)
            adapter.linear_out.weight.normal_(0.0, 0.1, generator=generator)
    return model


def _logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)[..., : CONFIG.vocab_size]


TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def test_an_adapter_adds_scaled_b_a_x_to_its_layer():
    model = _adapted()
    layer = model.layers["0"].mlp.linear_fc1
    x = torch.randn(16, 2, 32)
    with torch.no_grad():
        expected = x @ layer.weight.T + 2.0 * (x @ layer.adapter.linear_in.weight.T) @ layer.adapter.linear_out.weight.T
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_a_new_adapter_starts_as_the_base_and_only_adapters_train():
    base = GPTModel(CONFIG, seed=3)
    model = GPTModel(CONFIG, seed=3)
    names = apply_lora(model, LoRAConfig(dim=4, alpha=8, target_modules=["linear_qkv", "linear_fc2"]), model.layout, 5)
    assert names == [
        "layers.0.self_attention.linear_qkv",
        "layers.0.mlp.linear_fc2",
        "layers.1.self_attention.linear_qkv",
        "layers.1.mlp.linear_fc2",
    ]
    torch.testing.assert_close(_logits(model, TOKENS), _logits(base, TOKENS), rtol=0, atol=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".adapter.linear_" in n for n in trainable) and len(trainable) == 8
    qkv = model.layers["0"].self_attention.linear_qkv.adapter
    assert qkv.linear_in.weight.shape == (4, 32) and qkv.linear_out.weight.shape == (64, 4)
    assert qkv.linear_in.weight.std() > 0 and qkv.linear_out.weight.abs().max() == 0


def test_switched_off_adapters_give_the_base_and_merged_ones_the_adapted_model():
    base = _logits(GPTModel(CONFIG, seed=3), TOKENS)
    model = _adapted()
    adapted = _logits(model, TOKENS)
    assert (adapted - base).abs().max() > 1e-2
    with adapters_disabled(model):
        torch.testing.assert_close(_logits(model, TOKENS), base, rtol=0, atol=0)
    torch.testing.assert_close(_logits(model, TOKENS), adapted, rtol=0, atol=0)  # switched back on
    merged = merge_lora(model)
    assert len(merged) == 8 and not list(adapters(model)) and lora_recipe(model) is None
    torch.testing.assert_close(_logits(model, TOKENS), adapted, rtol=1e-5, atol=1e-5)


def test_the_recipe_in_a_state_dict_rebuilds_the_adapters():
    config = LoRAConfig(dim=4, alpha=8, dropout=0.1, target_modules=["*.layers.1.*.linear_proj"])
    model = _adapted(config)
    state = model.state_dict()
    fresh = GPTModel(CONFIG, seed=3)
    assert restore_lora(fresh, state, fresh.layout)
    assert lora_recipe(fresh) == (config, 5)
    fresh.load_state_dict(state)
    torch.testing.assert_close(_logits(fresh.eval(), TOKENS), _logits(model.eval(), TOKENS), rtol=0, atol=0)
    assert not restore_lora(fresh, state, fresh.layout)  # already adapted: left as it is


def test_dropout_acts_in_training_only_and_on_the_adapter_path_only():
    for position in ("pre", "post"):
        model = _adapted(LoRAConfig(dim=4, alpha=8, dropout=0.5, dropout_position=position))
        model.eval()
        evaluated = _logits(model, TOKENS)
        model.train()
        first, second = _logits(model, TOKENS), _logits(model, TOKENS)
        assert (first - second).abs().max() > 0, position  # a new mask per call
        assert (first - evaluated).abs().max() > 0, position
        with adapters_disabled(model):  # the base path has no dropout (hidden/attention dropout are 0 here)
            torch.testing.assert_close(_logits(model, TOKENS), _logits(GPTModel(CONFIG, seed=3), TOKENS))
