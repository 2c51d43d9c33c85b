"""Packed samples: a sequence's loss inside a packed sample equals its loss on its own."""

import sys
from pathlib import Path

import pytest
import torch

import megatron_lite as ml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from mla_utils import TINY_MLA, TINY_YARN  # noqa: E402

from megatron_lite.core.parallel.context_parallel import document_ranges
from megatron_lite.core.parallel.schedules import gpt_loss


def test_document_ranges():
    # offsets past the row are clipped (a packed length of s + 1 counts the label token); a padding
    # tail after the packed length is a document of its own
    assert document_ranges([0, 3, 7, -1], 8) == [(0, 3), (3, 7), (7, 8)]
    assert document_ranges([0, 5, -1, -1], 8) == [(0, 5), (5, 8)]
    assert document_ranges([0, 4, 9], 8) == [(0, 4), (4, 8)]


MLA = dict(TINY_MLA, **TINY_YARN, q_lora_rank=12, init_method_std=0.3)  # far from uniform: a wrong scale shows


@pytest.mark.parametrize(
    "kwargs",
    [{}, dict(position_embedding_type="learned_absolute", normalization="LayerNorm", activation="gelu"), MLA],
    ids=["rope", "learned", "mla"],
)
def test_packed_loss_equals_separate_losses(kwargs):
    config = ml.GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=100,
        seq_length=16,
        make_vocab_size_divisible_by=4,
        **kwargs,
    )
    model = ml.GPTModel(config, seed=0)
    gen = torch.Generator().manual_seed(0)  # fixed tokens: the test must not depend on what ran before it
    a, b = torch.randint(0, 100, (7,), generator=gen), torch.randint(0, 100, (10,), generator=gen)  # 7 + 10 = 17
    packed = {
        "tokens": torch.cat([a, b])[None],
        "position_ids": torch.cat([torch.arange(7), torch.arange(9)])[None],
        "cu_seqlens": torch.tensor([[0, 7, 17]], dtype=torch.int32),
    }
    mask = torch.ones(1, 16)
    mask[0, 6] = 0  # predicting b's first token from a's last is not a real target
    loss_sum, n = gpt_loss(model, {**packed, "loss_mask": mask})
    alone_a, na = gpt_loss(model, {"tokens": a[None]})
    alone_b, nb = gpt_loss(model, {"tokens": b[None]})
    assert n == na + nb == 15
    torch.testing.assert_close(loss_sum, alone_a + alone_b, rtol=1e-5, atol=1e-5)
    # Without the packing information the second sequence would see the first: a different loss.
    unpacked_sum, _ = gpt_loss(model, {"tokens": packed["tokens"], "loss_mask": mask})
    # (a tiny random model attends almost uniformly, so the difference is small but far above fp32 noise)
    assert (unpacked_sum - loss_sum).abs() > 1e-3
