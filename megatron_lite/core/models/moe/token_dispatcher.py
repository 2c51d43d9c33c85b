"""Token dispatchers: move each token to the ranks of the experts it was routed to, and its weighted expert outputs
back (Megatron's MoE token dispatchers). The MoE layer calls ``dispatch`` then the experts then ``combine``.

Every rank of a pipeline stage holds distinct tokens (sequence parallelism splits them over TP, CP over the
sequence, DP over samples). The experts' ranks are the ETP x EP group; an expert's ETP ranks each hold a slice of
its weights and compute a partial output for every token routed to it, which ``combine`` sums.

- ``allgather``: every rank of the ETP x EP group gathers all their tokens, keeps those routed to its local experts,
  and a reduce-scatter returns each token's sum over experts (and ETP partials) to its rank. Simple; sends
  (EP x ETP - 1) x T x H per rank per direction whatever the routing (plus each token's routing, E wide).
- ``alltoall``: each token goes only to the EP rank of its expert (an all-to-all over EP, then an all-gather over
  ETP); the reverse on the way back. Sends top-k x T x H x (EP - 1) / EP per rank and direction under uniform
  routing (what a rank sends back is what it received: it differs from what it sent when the routing is not
  balanced), less than allgather once EP > top-k.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import (
    all_gather_into_tensor,
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def _size(group: Optional[dist.ProcessGroup]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class TokenDispatcher:
    """The interface: ``dispatch`` returns the local experts' input (rows sorted by local expert) and how many rows
    each local expert has; ``combine`` takes the experts' (partial) outputs and returns ``[T, H]`` for this rank's
    tokens, each the sum of its experts' outputs weighted by the routing probabilities. ``sent_bytes`` counts what
    this rank sent to other ranks in the last dispatch + combine, tokens and routing metadata (the forward's; the
    backward sends the same token bytes again, and no routing map or counts), for the MoE benchmark's traffic table."""

    def __init__(self, num_experts: int, layout: ParallelLayout):
        self.num_experts = num_experts
        self.num_local_experts = num_experts // layout.ep_size
        self.local_start = layout.ep_rank * self.num_local_experts
        self.sent_bytes = 0

    def dispatch(
        self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        raise NotImplementedError

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def sort_by_expert(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token index, expert index) of every routed pair, ordered by expert then token."""
    experts, tokens = routing_map.t().nonzero(as_tuple=True)
    return tokens, experts


def weighted_sum_back(
    rows: torch.Tensor, weights: torch.Tensor, token_index: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """``[num_tokens, H]``: each row times its routing weight, added into the row of its token."""
    weighted = (rows.float() * weights.unsqueeze(-1)).to(rows.dtype)
    return rows.new_zeros((num_tokens, rows.shape[-1])).index_add(0, token_index, weighted)


class AllGatherDispatcher(TokenDispatcher):
    """Megatron's MoEAllGatherTokenDispatcher over the ETP x EP group."""

    def __init__(self, num_experts: int, layout: ParallelLayout):
        super().__init__(num_experts, layout)
        self.group = layout.group("ep_etp")

    def dispatch(self, hidden, probs, routing_map):
        group, n = self.group, _size(self.group)
        # differentiable gathers: a token's gradient comes back summed over the ranks that used it
        all_hidden = gather_from_sequence_parallel_region(hidden, group, grad_is_partial=True)
        all_probs = gather_from_sequence_parallel_region(probs, group, grad_is_partial=True)
        # as bytes: gloo gathers no bool tensors
        all_map = gather_from_sequence_parallel_region(routing_map.to(torch.uint8), group).bool()
        local = all_map[:, self.local_start : self.local_start + self.num_local_experts]
        tokens, experts = sort_by_expert(local)
        self.token_index, self.num_tokens = tokens, all_hidden.shape[0]
        self.weights = all_probs[tokens, experts + self.local_start]
        # to each of the n - 1 others: this rank's tokens and their routing (a bool map is sent as bytes)
        self.sent_bytes = (n - 1) * (_nbytes(hidden) + _nbytes(probs) + routing_map.numel())
        counts = local.sum(0).tolist()  # host sync: the experts' GEMMs need their row counts
        return all_hidden[tokens], [int(c) for c in counts]

    def combine(self, expert_output):
        summed = weighted_sum_back(expert_output, self.weights, self.token_index, self.num_tokens)
        n = _size(self.group)
        self.sent_bytes += _nbytes(summed) * (n - 1) // n  # every rank's share but this rank's own
        return reduce_scatter_to_sequence_parallel_region(summed, self.group)


class AllToAllDispatcher(TokenDispatcher):
    """Megatron's MoEAlltoAllTokenDispatcher: all-to-all over EP, all-gather over ETP (and back)."""

    def __init__(self, num_experts: int, layout: ParallelLayout):
        super().__init__(num_experts, layout)
        self.ep_group, self.etp_group = layout.group("ep"), layout.group("etp")
        self.ep, self.etp = _size(self.ep_group), _size(self.etp_group)

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``[etp, ep, local experts]``: how many rows each (ETP rank, EP rank) sends to each of our local experts."""
        per_rank = counts.reshape(self.ep, self.num_local_experts)
        received = all_to_all(per_rank, self.ep_group, [1] * self.ep, [1] * self.ep) if self.ep > 1 else per_rank
        if self.etp == 1:
            return received.unsqueeze(0)
        gathered = received.new_empty((self.etp * self.ep, self.num_local_experts))
        all_gather_into_tensor(gathered, received.contiguous(), group=self.etp_group)
        return gathered.reshape(self.etp, self.ep, self.num_local_experts)

    def dispatch(self, hidden, probs, routing_map):
        tokens, experts = sort_by_expert(routing_map)
        self.token_index, self.num_tokens = tokens, hidden.shape[0]
        self.weights = probs[tokens, experts]
        counts = routing_map.sum(0).to(torch.int64)  # [E], rows this rank sends to each expert
        matrix = self._exchange_counts(counts).cpu()  # host sync: the exchanges need their split sizes
        self.input_splits = counts.reshape(self.ep, -1).sum(1).tolist()
        self.output_splits = matrix[0 if self.etp == 1 else dist.get_rank(self.etp_group)].sum(1).tolist()
        rows = all_to_all(hidden[tokens], self.ep_group, self.output_splits, self.input_splits)
        # every ETP rank of our experts computes on every row any of them received
        self.etp_sizes = matrix.sum((1, 2)).tolist()
        mine = self.etp_sizes[dist.get_rank(self.etp_group)] if self.etp > 1 else rows.shape[0]
        if self.etp > 1:
            rows = all_to_all(rows.repeat(self.etp, 1), self.etp_group, self.etp_sizes, [mine] * self.etp)
        # rows arrive ordered (ETP rank, EP rank, local expert): sort them by local expert
        self.order = order = _by_expert(matrix)
        self.ep_rank = dist.get_rank(self.ep_group) if self.ep > 1 else 0
        # the token counts (to the other EP ranks, then all of them to the other ETP ranks), then the rows
        counts_bytes = counts.element_size() * self.num_local_experts * ((self.ep - 1) + self.ep * (self.etp - 1))
        to_others = sum(self.input_splits) - self.input_splits[self.ep_rank] + mine * (self.etp - 1)
        self.sent_bytes = counts_bytes + to_others * hidden.shape[-1] * hidden.element_size()
        return rows[order], [int(c) for c in matrix.sum((0, 1)).tolist()]

    def combine(self, expert_output):
        rows = torch.empty_like(expert_output).index_copy(0, self.order, expert_output)
        # the way back sends what the way there received: per rank it differs from what dispatch sent
        back = sum(self.output_splits) - self.output_splits[self.ep_rank]
        if self.etp > 1:
            # each ETP rank gets back its own rows, summed over the ETP partials
            rank = dist.get_rank(self.etp_group)
            mine = self.etp_sizes[rank]
            pieces = all_to_all(rows, self.etp_group, [mine] * self.etp, self.etp_sizes)
            rows = pieces.reshape(self.etp, mine, pieces.shape[-1]).sum(0)  # -1 is ambiguous for 0 rows
            back += sum(self.etp_sizes) - mine
        self.sent_bytes += back * expert_output.shape[-1] * expert_output.element_size()
        rows = all_to_all(rows, self.ep_group, self.input_splits, self.output_splits)
        return weighted_sum_back(rows, self.weights, self.token_index, self.num_tokens)


def _by_expert(matrix: torch.Tensor) -> torch.Tensor:
    """The permutation that orders rows laid out as ``matrix``'s (ETP rank, EP rank, local expert) blocks by local
    expert (then by their position), i.e. Megatron's sort_chunks_by_idxs."""
    sizes = matrix.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes
    etp, ep, local = matrix.shape
    pieces = []
    for expert in range(local):
        for source in range(etp * ep):
            block = source * local + expert
            pieces.append(torch.arange(int(starts[block]), int(starts[block] + sizes[block])))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def build_dispatcher(kind: str, num_experts: int, layout: ParallelLayout) -> TokenDispatcher:
    """The dispatcher ``moe_token_dispatcher_type`` names ('flex', DeepEP's, is refused by the config checks)."""
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, layout)
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, layout)
    raise ValueError(f"moe_token_dispatcher_type={kind!r} has no dispatcher here; use 'allgather' or 'alltoall'")
