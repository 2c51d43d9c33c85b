"""Context-parallel attention equals full causal attention on the gathered sequence: output and the
gradients of q, k and v, for the ring (p2p) and the all-gather exchange, with GQA, with and without
packed documents, on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawn_utils import run_ranks

from megatron_lite.core.parallel.context_parallel import (
    AttentionContext,
    context_parallel_attention,
    packed_attention,
    zigzag_positions,
)

S, B, HEADS, GROUPS, D = 32, 2, 4, 2, 8


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, HEADS, D, generator=gen)
    k = torch.randn(S, B, GROUPS, D, generator=gen)
    v = torch.randn(S, B, GROUPS, D, generator=gen)
    dout = torch.randn(S, B, HEADS * D, generator=gen)
    return q, k, v, dout


# Row 0: three documents (one crossing several chunks, one inside a chunk), padding tail; row 1: two.
CU_SEQLENS = torch.tensor([[0, 11, 14, 29, -1], [0, 20, 33, -1, -1]], dtype=torch.int32)


def _reference(q, k, v, dout, cu_seqlens=None):
    """Dense causal attention on the whole rows (each document alone when packed), with autograd."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    context = AttentionContext(cu_seqlens=cu_seqlens)
    if cu_seqlens is None:
        rep = HEADS // GROUPS
        qs, ks, vs = (
            q.permute(1, 2, 0, 3),
            k.repeat_interleave(rep, 2).permute(1, 2, 0, 3),
            v.repeat_interleave(rep, 2).permute(1, 2, 0, 3),
        )
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).permute(2, 0, 1, 3).reshape(S, B, -1)
    else:
        out = packed_attention(q, k, v, context)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _cp_rank(rank, world_size, comm_type, packed, fused=False):
    q, k, v, dout = _inputs()
    index = zigzag_positions(S, world_size, rank)
    local = [t[index].clone().requires_grad_(True) for t in (q, k, v)]
    context = AttentionContext(
        cu_seqlens=CU_SEQLENS if packed else None,
        cp_size=world_size,
        cp_rank=rank,
        cp_group=dist.group.WORLD,
        comm_type=comm_type,
        fused=fused,
    )
    out = context_parallel_attention(*local, context)
    out.backward(dout[index])
    return index, out.detach(), *(t.grad for t in local)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_context_parallel_attention_equals_full_attention(cp, comm_type, packed):
    q, k, v, dout = _inputs()
    ref = _reference(q, k, v, dout, CU_SEQLENS if packed else None)
    results = run_ranks(_cp_rank, cp, comm_type, packed)
    for index, *local in results:
        for name, got, want in zip(("out", "dq", "dk", "dv"), local, ref):
            torch.testing.assert_close(got, want[index], rtol=1e-5, atol=1e-5, msg=f"{name} differs")


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_fused_cpu_blocks_equal_full_attention(packed):
    """The fused CPU flash blocks (the default; the test above runs the math path), through the ring at CP2."""
    q, k, v, dout = _inputs()
    ref = _reference(q, k, v, dout, CU_SEQLENS if packed else None)
    for index, *local in run_ranks(_cp_rank, 2, "p2p", packed, True):
        for name, got, want in zip(("out", "dq", "dk", "dv"), local, ref):
            torch.testing.assert_close(got, want[index], rtol=1e-5, atol=1e-5, msg=f"{name} differs")


def test_blocks_run_in_fp32_under_autocast():
    """bf16 autocast does not lower the blocks' precision: the result equals the fp32 computation on
    the same (bf16-rounded) inputs."""
    q, k, v, _ = (t.bfloat16().float() for t in _inputs(4))
    want = context_parallel_attention(q, k, v, AttentionContext())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = context_parallel_attention(q, k, v, AttentionContext())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_single_rank_block_attention_equals_sdpa():
    """The block kernel itself (no exchange): one CP rank, rows and packed."""
    q, k, v, dout = _inputs(1)
    for cu, fused in ((None, True), (CU_SEQLENS, True), (None, False), (CU_SEQLENS, False)):
        ref = _reference(q, k, v, dout, cu)
        local = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = context_parallel_attention(*local, AttentionContext(cu_seqlens=cu, fused=fused))
        out.backward(dout)
        for got, want in zip((out.detach(), *(t.grad for t in local)), ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_attention_equals_each_document_alone():
    q, k, v, dout = _inputs(2)
    got = packed_attention(q, k, v, AttentionContext(cu_seqlens=CU_SEQLENS))
    rep = HEADS // GROUPS
    for row, bounds in enumerate(([0, 11, 14, 29, 32], [0, 20, 32])):
        for start, end in zip(bounds, bounds[1:]):
            qs = q[start:end, row].transpose(0, 1)
            ks, vs = (t[start:end, row].repeat_interleave(rep, 1).transpose(0, 1) for t in (k, v))
            alone = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1).reshape(end - start, -1)
            torch.testing.assert_close(got[start:end, row], alone, rtol=1e-6, atol=1e-6)


def test_bad_cu_seqlens_is_refused_with_the_fix():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="start at 0 and increase strictly"):
        packed_attention(q, k, v, AttentionContext(cu_seqlens=torch.tensor([[0, 9, 5, -1], [0, 32, -1, -1]])))
    with pytest.raises(ValueError, match="divisible by 2 x context_parallel_size"):
        zigzag_positions(30, 4, 0)
