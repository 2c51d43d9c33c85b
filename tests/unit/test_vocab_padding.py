"""Vocabulary padding is no part of the model (one process; the TP runs are in tests/distributed).

Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x tp``. Here the padding
changes nothing: the real rows are drawn from the seed exactly as an unpadded tensor's, the padding rows
are zero, their logits are -inf and outside every softmax, they get no gradient, and what is saved or
handed back holds the real ``vocab_size`` rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_lite as ml
from megatron_lite.core.checkpoint.state import sharded_model_state
from megatron_lite.core.inference import generate
from megatron_lite.core.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import TPShard

VOCAB = 100
PADDINGS = {1: 100, 128: 128, 256: 256, 1024: 1024}  # make_vocab_size_divisible_by -> padded rows at TP1


def _greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuation of every row of ``prompt`` (the rows have equal lengths, so equal outputs)."""
    return torch.tensor(generate(model, prompt.tolist(), max_new_tokens).tokens)


def _model(divisible_by: int, tied: bool = False, seed: int = 3) -> ml.GPTModel:
    config = ml.GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=VOCAB,
        seq_length=16,
        make_vocab_size_divisible_by=divisible_by,
        share_embeddings_and_output_weights=tied,
    )
    model = ml.GPTModel(config, seed=seed)
    assert model.padded_vocab_size == PADDINGS[divisible_by]
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_real_rows_are_drawn_as_an_unpadded_tensor_and_padding_is_zero(tied):
    unpadded = _model(1, tied)
    vocab_params = ["embedding.weight"] + ([] if tied else ["output_layer.weight"])
    for divisible_by in (128, 256, 1024):
        padded = _model(divisible_by, tied)
        for name, param in padded.named_parameters():
            reference = dict(unpadded.named_parameters())[name]
            if name in vocab_params:
                assert param.shape == (PADDINGS[divisible_by], 32)
                assert torch.equal(param[:VOCAB], reference), name
                assert not param[VOCAB:].any(), f"{name}: padding rows must be zero"
            else:
                assert torch.equal(param, reference), name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_padding_changes_no_logit_loss_or_gradient(tied):
    tokens = _tokens()
    outputs = {}
    for divisible_by in PADDINGS:
        model = _model(divisible_by, tied)
        logits = model(tokens[:, :-1])
        assert logits.shape == (2, 16, PADDINGS[divisible_by])
        assert torch.isneginf(logits[..., VOCAB:]).all(), "padded logits must be -inf in every logits output"
        full = model.full_logits(tokens[:, :-1])
        assert full.shape == (2, 16, VOCAB)
        # no padding hidden behind a view either (it would be saved, pickled and handed back with it)
        assert full.untyped_storage().nbytes() == full.numel() * full.element_size()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        for name in ("embedding.weight", *([] if tied else ["output_layer.weight"])):
            assert not grads[name][VOCAB:].any(), f"{name}: padding rows must get no gradient"
            grads[name] = grads[name][:VOCAB]
        outputs[divisible_by] = (logits[..., :VOCAB].detach(), full, loss.detach(), grads)
    ref_logits, ref_full, ref_loss, ref_grads = outputs[1]
    for divisible_by, (logits, full, loss, grads) in outputs.items():
        # bit-identical: the padding adds no term to any sum (the softmax sums the real entries only)
        assert torch.equal(logits, ref_logits) and torch.equal(full, ref_full), divisible_by
        assert torch.equal(loss, ref_loss), divisible_by
        for name, grad in ref_grads.items():
            assert torch.equal(grads[name], grad), (divisible_by, name)


def test_nonzero_padding_rows_still_never_enter_a_softmax():
    """Masking, not zero weights, keeps the padding out: give the padding rows large weights (as a
    carelessly loaded checkpoint might) and the loss, the logits and greedy tokens do not change."""
    tokens = _tokens()
    clean, dirty = _model(256), _model(256)
    with torch.no_grad():
        dirty.output_layer.weight[VOCAB:] = 50.0 * torch.randn(
            256 - VOCAB, 32, generator=torch.Generator().manual_seed(1)
        )
    assert torch.equal(dirty(tokens[:, :-1], tokens[:, 1:]), clean(tokens[:, :-1], tokens[:, 1:]))
    assert torch.equal(dirty.full_logits(tokens[:, :-1]), clean.full_logits(tokens[:, :-1]))
    assert torch.isneginf(dirty(tokens[:, :-1])[..., VOCAB:]).all()
    generated = _greedy(dirty, tokens[:, :3], 12)
    assert torch.equal(generated, _greedy(clean, tokens[:, :3], 12))
    assert int(generated.max()) < VOCAB


def test_cross_entropy_leaves_padded_logits_out_of_the_softmax():
    logits = torch.randn(5, 7, 160, generator=torch.Generator().manual_seed(0), requires_grad=True)
    target = torch.randint(0, VOCAB, (5, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits[..., VOCAB:] += 100.0  # padding that would dominate the softmax if it took part
    loss = vocab_parallel_cross_entropy(logits, target, None, 0, vocab_size=VOCAB)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    real = logits.detach()[..., :VOCAB].clone().requires_grad_(True)
    expected = F.cross_entropy(real.reshape(-1, VOCAB), target.reshape(-1), reduction="none").reshape(5, 7)
    (expected_grad,) = torch.autograd.grad(expected.sum(), real)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad[..., :VOCAB], expected_grad)
    assert not grad[..., VOCAB:].any()


def test_checkpoint_view_holds_the_real_rows_and_shares_storage():
    model = _model(256)
    state = sharded_model_state(model, ParallelLayout.single())
    assert state["embedding.weight"].shape == (VOCAB, 32) and state["output_layer.weight"].shape == (VOCAB, 32)
    with torch.no_grad():
        state["embedding.weight"].fill_(2.0)  # DCP loads in place through the view
    assert (model.embedding.weight[:VOCAB] == 2.0).all() and not model.embedding.weight[VOCAB:].any()


def test_tp_shard_padding_arithmetic():
    # 1001 real rows padded to 1200 over TP2 (600 per rank) and 128 padded to 512 over TP4
    assert [TPShard(0, 1, (1200, 8), r, 2, 1001).local_real_size for r in range(2)] == [600, 401]
    assert [TPShard(0, 1, (512, 8), r, 4, 128).local_real_size for r in range(4)] == [128, 0, 0, 0]
    shard = TPShard(0, 1, (512, 8), 1, 4, 128)
    assert shard.real_shape == (128, 8) and shard.local_start == 128
    real = torch.randn(128, 8)
    assert torch.equal(shard.pad(real)[:128], real) and not shard.pad(real)[128:].any()
    assert not shard.shard(real).any()  # rank 1 of 4 holds only padding
    with pytest.raises(ValueError, match="stride"):
        TPShard(0, 2, (512, 8), 0, 2, 128)
    with pytest.raises(ValueError, match="unpadded_size"):
        TPShard(0, 1, (512, 8), 0, 2, 513)
