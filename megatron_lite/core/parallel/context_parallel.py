"""Context parallelism: the sequence split over CP ranks, attention that sees all of it exactly.

The sequence of every row is cut into ``2·C`` equal chunks and CP rank ``r`` holds chunks ``r`` and
``2C−1−r`` (Megatron's load balancing: under the causal mask early chunks attend to little and late
chunks to much, so pairing them gives every rank the same work). Everything outside attention is
per token and runs on the local tokens unchanged; attention needs the keys and values of every
earlier token, which live on other ranks. They are fetched block by block (``p2p``: passed around
the CP ring, the next block in flight while the current one is computed) or all at once
(``all_gather``), and the partial results of each block are merged exactly with their log-sum-exp.

Packed rows (several documents in one row, ``cu_seqlens``) use the same machinery: a row is a list
of *pieces*, the runs of one document inside one chunk, and a query piece attends to a key piece of
the same document that lies entirely before it (no mask) or is the same run (causal mask); every
other pair is skipped. No ``[s, s]`` mask is ever built, so the work and the memory grow with the
documents, not with the square of the row.

Only the key/value heads travel (GQA): query heads are grouped over their key/value head inside the
block computation instead of being expanded.

One file (past the usual ~500 lines, on purpose): the zigzag split, the document pieces and the block attention
are one contract -- which tokens a rank holds decides which blocks it computes and in what order they travel --
and are read and changed together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.core.parallel.mappings import _all_gather_single, _reduce_scatter_single

# --- the zigzag split of the data ----------------------------------------------------------------


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of ``2·cp_size`` sequence chunks that CP rank ``cp_rank`` holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_positions(
    seq_length: int, cp_size: int, cp_rank: int, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Global positions ``[seq_length / cp_size]`` of the tokens CP rank ``cp_rank`` holds."""
    if seq_length % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_length} must be divisible by 2 x context_parallel_size "
            f"({2 * cp_size}); set seq_length to a multiple of {2 * cp_size}."
        )
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in zigzag_chunks(cp_size, cp_rank)])


def rank_share(rows: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The ``[b, s/C, ...]`` share of whole ``rows`` [b, s, ...] that CP rank ``cp_rank`` holds."""
    return rows[:, zigzag_positions(rows.shape[1], cp_size, cp_rank, rows.device)]


def context_parallel_microbatch(microbatch: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's share of a ``{"tokens": [b, s+1], "loss_mask"?: [b, s], "position_ids"?: [b, s],
    "cu_seqlens"?: [b, k], ...}`` microbatch.

    Returns ``{"tokens": [b, s/C]`` (inputs), ``"labels": [b, s/C], "position_ids": [b, s/C]`` (global
    positions, or the packed per-document positions), the ``loss_mask`` and any other per-token
    ``[b, s]`` tensor sliced the same way; ``cu_seqlens`` stays whole (it describes the full row and
    every rank needs it to know which document each of its tokens belongs to). The shift between
    inputs and labels happens before the split, so no label is lost at a chunk boundary.
    """
    if "labels" in microbatch:
        raise ValueError("this microbatch was already split for context parallelism (it carries 'labels')")
    tokens = microbatch["tokens"]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    s = inputs.shape[1]
    out = {"tokens": rank_share(inputs, cp_size, cp_rank), "labels": rank_share(labels, cp_size, cp_rank)}
    for key, value in microbatch.items():
        if key in ("tokens", "cu_seqlens"):
            continue
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == s:
            out[key] = rank_share(value, cp_size, cp_rank)
        else:
            out[key] = value
    if "cu_seqlens" in microbatch:
        out["cu_seqlens"] = microbatch["cu_seqlens"]
    if "position_ids" not in out:
        index = zigzag_positions(s, cp_size, cp_rank, tokens.device)
        out["position_ids"] = index.unsqueeze(0).expand(inputs.shape[0], -1)
    return out


# --- which query tokens attend to which key tokens ------------------------------------------------


def document_ranges(cu_seqlens_row: list[int], length: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each document of a row of ``length`` input tokens from its ``cu_seqlens``
    (start offsets, then the packed length, padded with -1). Offsets past the row (a packed length of
    ``s + 1`` counts the extra label token) are clipped; tokens after the packed length (padding) form
    one more document, so they attend among themselves only."""
    bounds = [int(b) for b in cu_seqlens_row if b >= 0]
    if not bounds or bounds[0] != 0 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens {bounds} must start at 0 and increase strictly (document start offsets, then "
            f"the packed length, padded with -1); fix the packing of the data."
        )
    bounds = [min(b, length) for b in bounds]
    if bounds[-1] < length:
        bounds.append(length)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


@dataclass(frozen=True)
class _Piece:
    """A run of one document's tokens inside one chunk: global ``[start, end)``, local offset."""

    doc: int
    start: int
    end: int
    local: int


def _pieces(docs: list[tuple[int, int]], row_length: int, cp_size: int, cp_rank: int) -> list[_Piece]:
    chunk = row_length // (2 * cp_size)
    pieces, local = [], 0
    for c in zigzag_chunks(cp_size, cp_rank):
        lo, hi = c * chunk, (c + 1) * chunk
        for doc, (start, end) in enumerate(docs):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                pieces.append(_Piece(doc, a, b, local + a - lo))
        local += chunk
    return pieces


@dataclass(frozen=True)
class _Block:
    """Queries ``q_lo:q_hi`` (local) of ``rows`` attend to keys ``k_lo:k_hi`` (the source's local
    positions), with a causal mask when both are the same run of tokens."""

    rows: slice
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool


def _blocks(
    rows: slice, docs: list[tuple[int, int]], row_length: int, cp_size: int, cp_rank: int, source: int
) -> list[_Block]:
    blocks = []
    sources = _pieces(docs, row_length, cp_size, source)
    for q in _pieces(docs, row_length, cp_size, cp_rank):
        for k in sources:
            if k.doc != q.doc or k.start >= q.end:
                continue
            # Chunks are disjoint and aligned, so two runs of one document are the same run or disjoint.
            causal = k.start == q.start
            blocks.append(
                _Block(rows, q.local, q.local + (q.end - q.start), k.local, k.local + (k.end - k.start), causal)
            )
    return blocks


@dataclass
class AttentionContext:
    """How the tokens of one forward relate to the full rows: packing and context parallelism.

    Built once per forward by the model and shared by its layers, which reuse the block plan.
    """

    cu_seqlens: Optional[torch.Tensor] = None
    """[b, k] document start offsets of packed rows, then the packed length, -1 padded (None: one
    document per row)."""
    cp_size: int = 1
    """Context-parallel ranks that share each row."""
    cp_rank: int = 0
    """This rank's index in the CP group."""
    cp_group: Optional[dist.ProcessGroup] = None
    """The CP process group (None when cp_size is 1)."""
    comm_type: str = "p2p"
    """'p2p' (ring) or 'all_gather'."""
    fused: bool = True
    """Blocks through a fused kernel that returns the log-sum-exp the merge needs and never holds a block's
    score matrix (CPU: torch's flash kernel, about 5x faster per block; CUDA: the memory-efficient SDPA kernel,
    which takes fp32); False: the portable math path (scores materialized per block; for debugging or a
    device without such a kernel, where it also runs). Both are exact (tests/distributed/test_ring_attention.py)
    and modelled by the memory estimator (core/estimator/context_parallel.py)."""
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def documents(self, length: int) -> list[list[tuple[int, int]]]:
        """Per row, the document ranges of a row of ``length`` tokens (one host sync, cached)."""
        key = ("docs", length)
        if key not in self._plans:
            assert self.cu_seqlens is not None  # asked only for packed rows
            rows = self.cu_seqlens.tolist()
            self._plans[key] = [document_ranges(row, length) for row in rows]
        return self._plans[key]

    def blocks(self, local_length: int, batch: int) -> list[list[_Block]]:
        """For each source CP rank, the blocks this rank's queries compute against its keys."""
        key = ("blocks", local_length, batch)
        if key not in self._plans:
            row_length = local_length * self.cp_size
            if row_length % (2 * self.cp_size):
                raise ValueError(
                    f"sequence length {row_length} must be divisible by 2 x context_parallel_size ({2 * self.cp_size})"
                )
            if self.packed:
                per_row = [(slice(i, i + 1), docs) for i, docs in enumerate(self.documents(row_length))]
            else:
                per_row = [(slice(0, batch), [(0, row_length)])]
            self._plans[key] = [
                [
                    b
                    for rows, docs in per_row
                    for b in _blocks(rows, docs, row_length, self.cp_size, self.cp_rank, source)
                ]
                for source in range(self.cp_size)
            ]
        return self._plans[key]


# --- block attention with log-sum-exp ---------------------------------------------------------------


def _to_blocks(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[s, b, heads, d] -> fp32 [b, groups, heads/groups, s, d]."""
    s, b, n, d = x.shape
    return x.float().permute(1, 2, 0, 3).reshape(b, groups, n // groups, s, d)


def _from_blocks(x: torch.Tensor) -> torch.Tensor:
    """fp32 [b, groups, heads/groups, s, d] -> [s, b, heads, d]."""
    b, g, q, s, d = x.shape
    return x.reshape(b, g * q, s, d).permute(2, 0, 1, 3)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).triu(1 + lk - lq)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _kernel(q: torch.Tensor, fused: bool) -> str:
    """Which kernel computes a block: 'cpu_flash' (torch's fused CPU flash kernel), 'cuda_efficient' (the
    memory-efficient CUDA kernel: flash proper takes only 16-bit inputs, and the blocks run in fp32) or 'math'.
    Decided by the tensor's device type alone: no CUDA call happens off a GPU."""
    if not fused:
        return "math"
    if q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "cpu_flash"
    if q.device.type == "cuda" and hasattr(torch.ops.aten, "_efficient_attention_forward"):
        return "cuda_efficient"
    return "math"


# custom_mask_type of the memory-efficient kernel: 0 no mask, 1 causal from the top-left corner (a causal
# block is always square here -- the same run of tokens -- so top-left and bottom-right agree).
_NO_MASK, _CAUSAL = 0, 1


def _cuda_forward(qh, kh, vh, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, heads, l, d] blocks through the memory-efficient kernel (which takes [n, l, heads, d]); returns
    out [n, heads, lq, d] and lse [n, heads, lq] (the kernel pads the lse to a multiple of 32 rows)."""
    out, lse, *_ = torch.ops.aten._efficient_attention_forward(
        qh.transpose(1, 2),
        kh.transpose(1, 2),
        vh.transpose(1, 2),
        None,
        None,
        None,
        None,
        None,
        0.0,
        _CAUSAL if causal else _NO_MASK,
        True,
        scale=scale,
    )
    return out.transpose(1, 2), lse[..., : qh.shape[2]]


def _cuda_backward(d_out, qh, kh, vh, out, lse, causal: bool, scale: float):
    """Gradients of [n, heads, l, d] blocks through the memory-efficient kernel's backward, given the merged
    output and log-sum-exp (laid out as the forward returns it: padded to a multiple of 32 rows)."""
    lq, lk = qh.shape[2], kh.shape[2]
    padded = F.pad(lse, (0, -lq % 32))
    unused = torch.empty((), dtype=torch.int64, device=qh.device)  # philox seed and offset: no dropout
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        d_out.transpose(1, 2),
        qh.transpose(1, 2),
        kh.transpose(1, 2),
        vh.transpose(1, 2),
        None,
        out.transpose(1, 2),
        None,
        None,
        lq,
        lk,
        padded.contiguous(),
        0.0,
        unused,
        unused,
        _CAUSAL if causal else _NO_MASK,
        False,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Grouped [n, g, qpg, l, d] queries and [n, g, 1, l, d] keys/values -> [n, g·qpg, l, d] each."""
    n, g, qpg, lq, d = q.shape
    expand = (lambda t: t.squeeze(2).repeat_interleave(qpg, dim=1)) if qpg > 1 else (lambda t: t.squeeze(2))
    return q.reshape(n, g * qpg, lq, d), expand(k).contiguous(), expand(v).contiguous()


def _block_forward(q, k, v, causal: bool, scale: float, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block: (out [n, g, qpg, lq, d], lse [n, g, qpg, lq]) in fp32."""
    kernel = _kernel(q, fused)
    if kernel != "math":
        qh, kh, vh = _heads(q, k, v)
        if kernel == "cpu_flash":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, causal, scale=scale)
        else:
            out, lse = _cuda_forward(qh, kh, vh, causal, scale)
        return out.reshape(q.shape), lse.reshape(q.shape[:-1])
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def _block_backward(q, k, v, d_out, out, lse, delta, causal: bool, scale: float, fused: bool):
    """Gradients (dq, dk, dv) of one block given the merged output ``out`` and log-sum-exp ``lse`` of
    its queries over every block: the probabilities are rebuilt from the final lse, so the block's
    share of the gradient is exact (flash attention's backward, block by block)."""
    kernel = _kernel(q, fused)
    if kernel != "math":
        qh, kh, vh = _heads(q, k, v)
        n, g, qpg, lq, d = q.shape
        if kernel == "cpu_flash":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                d_out.reshape(qh.shape),
                qh,
                kh,
                vh,
                out.reshape(qh.shape),
                lse.reshape(qh.shape[:-1]),
                0.0,
                causal,
                scale=scale,
            )
        else:
            dq, dk, dv = _cuda_backward(
                d_out.reshape(qh.shape), qh, kh, vh, out.reshape(qh.shape), lse.reshape(qh.shape[:-1]), causal, scale
            )
        lk = k.shape[3]
        return (
            dq.reshape(q.shape),
            dk.reshape(n, g, qpg, lk, d).sum(dim=2, keepdim=True),
            dv.reshape(n, g, qpg, lk, d).sum(dim=2, keepdim=True),
        )
    probs = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), d_out).sum(dim=2, keepdim=True)
    d_scores = probs * (torch.matmul(d_out, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(d_scores, k) * scale
    dk = torch.matmul(d_scores.transpose(-1, -2), q).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


def _attend_forward(q, k, v, blocks: list[_Block], out, lse, scale: float, fused: bool) -> None:
    """Merge the blocks' attention results into the running ``out`` [b, g, qpg, s, d] and ``lse``."""
    for blk in blocks:
        qs = q[blk.rows, :, :, blk.q_lo : blk.q_hi]
        ks, vs = k[blk.rows, :, :, blk.k_lo : blk.k_hi], v[blk.rows, :, :, blk.k_lo : blk.k_hi]
        block_out, block_lse = _block_forward(qs, ks, vs, blk.causal, scale, fused)
        old_out = out[blk.rows, :, :, blk.q_lo : blk.q_hi]
        old_lse = lse[blk.rows, :, :, blk.q_lo : blk.q_hi]
        new_lse = torch.logaddexp(old_lse, block_lse)
        # exp(-inf - finite) = 0: a query's first block simply replaces the empty running result
        old_out.mul_(torch.exp(old_lse - new_lse).unsqueeze(-1)).add_(
            block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
        )
        old_lse.copy_(new_lse)


def _attend_backward(
    q, k, v, dout, out, delta, lse, blocks: list[_Block], dq, dk, dv, scale: float, fused: bool
) -> None:
    """Accumulate the blocks' gradients into ``dq`` (local queries) and ``dk``/``dv`` (the source's keys)."""
    for blk in blocks:
        rows, qsl, ksl = blk.rows, slice(blk.q_lo, blk.q_hi), slice(blk.k_lo, blk.k_hi)
        grads = _block_backward(
            q[rows, :, :, qsl],
            k[rows, :, :, ksl],
            v[rows, :, :, ksl],
            dout[rows, :, :, qsl],
            out[rows, :, :, qsl],
            lse[rows, :, :, qsl],
            delta[rows, :, :, qsl],
            blk.causal,
            scale,
            fused,
        )
        dq[rows, :, :, qsl] += grads[0]
        dk[rows, :, :, ksl] += grads[1]
        dv[rows, :, :, ksl] += grads[2]


# --- the exchange of keys and values ------------------------------------------------------------------


_KV_TAG, _GRAD_TAG = 0, 1


class _Ring:
    """Neighbours on the CP ring: receive from the previous rank, send to the next."""

    def __init__(self, context: AttentionContext):
        group, size, rank = context.cp_group, context.cp_size, context.cp_rank
        assert group is not None  # a ring only for cp_size > 1, which has a CP group
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post sending ``tensor`` onward and receiving the previous rank's; returns (buffer, works).
        Keys/values and their gradients travel with different tags: with two ranks the next and the
        previous rank are the same, and both streams are in flight at once."""
        received = torch.empty_like(tensor)
        works = [
            dist.isend(tensor, self.next, group=self.group, tag=tag),
            dist.irecv(received, self.prev, group=self.group, tag=tag),
        ]
        return received, works


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _all_gather_blocks(kv: torch.Tensor, context: AttentionContext) -> torch.Tensor:
    """Every CP rank's stacked keys/values ``[C, 2, ...]``."""
    gathered = torch.empty((context.cp_size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    _all_gather_single(gathered, kv, group=context.cp_group)
    return gathered.view(context.cp_size, *kv.shape)


class _ContextParallelAttention(torch.autograd.Function):
    """Exact causal attention of this rank's queries over every CP rank's keys and values."""

    @staticmethod
    def forward(ctx, q, k, v, context: AttentionContext, scale: float):
        # fp32 blocks and merge whatever autocast is active: the log-sum-exp merge is where precision is lost
        with torch.autocast(device_type=q.device.type, enabled=False):
            return _ContextParallelAttention._forward(ctx, q, k, v, context, scale)

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(device_type=grad.device.type, enabled=False):
            return _ContextParallelAttention._backward(ctx, grad)

    @staticmethod
    def _forward(ctx, q, k, v, context: AttentionContext, scale: float):
        s, b, hq, d = q.shape
        groups = k.shape[2]
        plan = context.blocks(s, b)
        qb = _to_blocks(q, groups)
        out = torch.zeros_like(qb)
        lse = torch.full(qb.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # only the key/value heads travel
        rank, size = context.cp_rank, context.cp_size
        if size == 1:
            _attend_forward(qb, _to_blocks(k, groups), _to_blocks(v, groups), plan[0], out, lse, scale, context.fused)
        elif context.comm_type == "all_gather":
            gathered = _all_gather_blocks(kv, context)
            for source in [rank] + [j for j in range(size) if j != rank]:  # own block first: finite lse early
                _attend_forward(
                    qb,
                    _to_blocks(gathered[source, 0], groups),
                    _to_blocks(gathered[source, 1], groups),
                    plan[source],
                    out,
                    lse,
                    scale,
                    context.fused,
                )
        else:
            ring = _Ring(context)
            current = kv
            for step in range(size):
                source = (rank - step) % size
                if step + 1 < size:
                    incoming, works = ring.shift(current, _KV_TAG)  # the next block travels while this one is computed
                _attend_forward(
                    qb,
                    _to_blocks(current[0], groups),
                    _to_blocks(current[1], groups),
                    plan[source],
                    out,
                    lse,
                    scale,
                    context.fused,
                )
                if step + 1 < size:
                    _wait(works)
                    current = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.context, ctx.scale = context, scale
        return _from_blocks(out).to(q.dtype).reshape(s, b, hq * d)

    @staticmethod
    def _backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        context, scale = ctx.context, ctx.scale
        s, b, hq, d = q.shape
        groups = k.shape[2]
        plan = context.blocks(s, b)
        rank, size = context.cp_rank, context.cp_size
        qb = _to_blocks(q, groups)
        dout = _to_blocks(grad.reshape(s, b, hq, d), groups)
        delta = (dout * out).sum(dim=-1)
        dq = torch.zeros_like(qb)
        kv = torch.stack([k, v]).contiguous()

        def block_grads(source_kv: torch.Tensor, source: int) -> torch.Tensor:
            """This rank's contribution to the gradient of ``source``'s keys and values, fp32 [2, ...]."""
            kb, vb = _to_blocks(source_kv[0], groups), _to_blocks(source_kv[1], groups)
            dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
            _attend_backward(qb, kb, vb, dout, out, delta, lse, plan[source], dq, dk, dv, scale, context.fused)
            return torch.stack([_from_blocks(dk), _from_blocks(dv)])

        if size == 1:
            dkv = block_grads(kv, 0)
        elif context.comm_type == "all_gather":
            gathered = _all_gather_blocks(kv, context)
            contributions = torch.stack([block_grads(gathered[j], j) for j in range(size)]).contiguous()
            dkv = torch.empty_like(contributions[0])
            # gloo wants the concatenation along dim 0, not a stack
            _reduce_scatter_single(dkv, contributions.flatten(0, 1), group=context.cp_group)
        else:
            # Each key/value block goes round the ring again, followed by the gradient accumulated for
            # it so far; after a full turn the gradient arrives back at the block's owner.
            ring = _Ring(context)
            current, accumulated, pending = kv, None, []
            for step in range(size):
                source = (rank - step) % size
                if step + 1 < size:
                    incoming, works = ring.shift(current, _KV_TAG)
                contribution = block_grads(current, source)
                if accumulated is not None:
                    _wait(accumulated[1])
                    contribution += accumulated[0]
                accumulated = ring.shift(contribution, _GRAD_TAG)
                pending.append(contribution)  # keep send buffers alive until the exchange completed
                if step + 1 < size:
                    _wait(works)
                    current = incoming
            assert accumulated is not None  # the loop ran cp_size >= 2 times
            _wait(accumulated[1])
            dkv = accumulated[0]
        dk, dv = dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return _from_blocks(dq).to(q.dtype), dk, dv, None, None


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: AttentionContext, scale: Optional[float] = None
) -> torch.Tensor:
    """Causal attention of local queries ``q`` [s/C, b, heads, d] over the whole rows, whose keys and
    values ``k``, ``v`` [s/C, b, groups, d] are spread over the CP ranks. Returns [s/C, b, heads·d]."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads cannot be grouped over {k.shape[2]} key/value heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _ContextParallelAttention.apply(q, k, v, context, scale)


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: AttentionContext,
    dropout: float = 0.0,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of packed rows without context parallelism: each document on its own (fused
    SDPA per document), so nothing is computed or stored across documents. ``q`` [s, b, heads, d],
    ``k`` [s, b, groups, d], ``v`` [s, b, groups, dv] -> [s, b, heads·dv]; ``scale``: the softmax scale (None:
    1/sqrt(d))."""
    s, b, hq, _ = q.shape
    d = v.shape[-1]
    repeat = hq // k.shape[2]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    rows = []
    for row, docs in enumerate(context.documents(s)):
        parts = []
        for start, end in docs:
            qd, kd, vd = (t[start:end, row].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, len, d]
            parts.append(F.scaled_dot_product_attention(qd, kd, vd, dropout_p=dropout, is_causal=True, scale=scale))
        rows.append(torch.cat(parts, dim=2))  # [1, heads, s, d]
    return torch.cat(rows, dim=0).permute(2, 0, 1, 3).reshape(s, b, hq * d)
