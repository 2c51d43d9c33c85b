"""CollectiveBytes counts what each rank hands to the others in real gloo collectives, by hand-computed numbers
(the reference the token dispatchers' ``sent_bytes`` is checked against)."""

import torch
import torch.distributed as dist
from spawn_utils import run_ranks

from megatron_lite.core.parallel.collective_bytes import CollectiveBytes


def _collectives(rank, world):
    pair = dist.new_group([0, 1])  # a named group besides the default one
    x = torch.ones(3, 4)  # 48 bytes
    with CollectiveBytes() as sent:
        dist.all_gather_into_tensor(torch.empty(3 * world, 4), x)
        dist.all_gather([torch.empty(3, 4) for _ in range(world)], x)
        dist.reduce_scatter_tensor(torch.empty(3, 4), torch.ones(3 * world, 4))
        splits = [1, 2] if rank == 0 else [3, 1]  # rows to rank 0, rank 1; receives the transpose
        received = [1, 3] if rank == 0 else [2, 1]
        dist.all_to_all_single(torch.empty(sum(received), 4), torch.ones(sum(splits), 4), received, splits, group=pair)
        dist.all_reduce(torch.ones(10, dtype=torch.float64))
        dist.broadcast(torch.ones(5), src=1)
        dist.barrier()
    groups = {r.group for r in sent.records}
    return dict(
        sent=[r.sent_bytes for r in sent.records],
        ops=[r.op for r in sent.records],
        unknown=sent.unknown,
        pair_only=sent.total({pair.group_name}),
        total=sent.total(),
        groups=len(groups),
    )


def test_counts_each_collective_by_hand():
    results = run_ranks(_collectives, 2)
    for rank, result in enumerate(results):
        assert result["ops"] == [
            "_allgather_base_",
            "allgather_",
            "_reduce_scatter_base_",
            "alltoall_base_",
            "allreduce_",
            "broadcast_",
        ]
        a2a = 2 * 16 if rank == 0 else 3 * 16  # the rows of the other rank's split, 16 bytes each
        expected = [48, 48, 48, a2a, 80, 20 if rank == 1 else 0]  # all-reduce: a ring's 2 (n-1)/n of 80 bytes
        assert result["sent"] == expected
        assert result["unknown"] == []
        assert result["pair_only"] == a2a and result["total"] == sum(expected) and result["groups"] == 2
