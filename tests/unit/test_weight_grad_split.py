"""The split backward of zero-bubble pipelines on a real GPT model (one process): the input-gradient pass leaves every
linear weight's gradient to the weight pass, which then gives exactly what one whole backward gives, through the
gradient buffers' hooks (fp32 main_grad) like any backward."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.core.parallel.grad_buffers import GradBuffers
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import defer_weight_grads
from megatron_lite.core.parallel.weight_grad import WeightGradStore

CONFIG = GPTConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64, seq_length=16
)
TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _loss(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens)[..., : CONFIG.vocab_size].float().log_softmax(-1).mean() * -1


def _linear_weights(model: GPTModel) -> set[str]:
    return {
        name + ".weight"
        for name, module in model.named_modules()
        if getattr(module, "weight_grad_store", None) is not None and module.weight is not None
    }


def test_the_weight_pass_gives_what_one_backward_gives():
    reference = GPTModel(CONFIG, seed=3)
    _loss(reference, TOKENS).backward()
    _loss(reference, TOKENS.flip(0)).backward()  # two microbatches accumulate

    model = GPTModel(CONFIG, seed=3)
    store = WeightGradStore()
    assert defer_weight_grads(model, store) == 2 * 4 + 1  # qkv, proj, fc1, fc2 per layer, and the output layer
    deferred = _linear_weights(model)
    with store.capture(0):
        _loss(model, TOKENS).backward()
    with store.capture(1):
        _loss(model, TOKENS.flip(0)).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(grads[name] is None for name in deferred)  # B: no weight GEMM ran
    assert all(grads[name] is not None for name in grads if name not in deferred)  # norms, embedding: as usual
    assert store.pending == 2
    store.apply(0)
    store.apply(1)
    assert store.pending == 0
    for name, param in reference.named_parameters():
        assert torch.equal(model.get_parameter(name).grad, param.grad), name


def test_deferred_gradients_reach_the_gradient_buffers_through_their_hooks():
    layout = ParallelLayout.single()
    reference = GPTModel(CONFIG, seed=3)
    reference_buffers = GradBuffers(list(reference.named_parameters()), layout)
    _loss(reference, TOKENS).backward()

    model = GPTModel(CONFIG, seed=3)
    buffers = GradBuffers(list(model.named_parameters()), layout)
    store = WeightGradStore()
    defer_weight_grads(model, store)
    with store.capture("mb"):
        _loss(model, TOKENS).backward()
    untouched = [name for name in _linear_weights(model) if buffers.main_grad(name).abs().sum() == 0]
    assert len(untouched) == len(_linear_weights(model))  # B left the buffers of the linear weights alone
    store.apply("mb")
    for name, param in model.named_parameters():
        assert param.grad is None  # moved into the buffer by the hook, as after a whole backward
        assert torch.equal(buffers.main_grad(name), reference_buffers.main_grad(name)), name


def test_without_a_capture_the_weight_gradient_is_computed_at_once():
    reference = GPTModel(CONFIG, seed=3)
    _loss(reference, TOKENS).backward()
    model = GPTModel(CONFIG, seed=3)
    defer_weight_grads(model, WeightGradStore())
    _loss(model, TOKENS).backward()
    for name, param in reference.named_parameters():
        assert torch.equal(model.get_parameter(name).grad, param.grad), name


def test_captures_are_keyed_once():
    store = WeightGradStore()
    with store.capture(0):
        pass
    with pytest.raises(RuntimeError, match="captured twice"):
        with store.capture(0):
            pass
    with pytest.raises(RuntimeError, match="do not nest"):
        with store.capture(1):
            with store.capture(2):
                pass
    store.clear()  # what a step that raised between a B and its W left: the next step starts clean
    with store.capture(0):
        pass
    assert store.pending == 1
