"""Rank order of the layout and dropout under TP, on raw gloo process groups (generation under every
layout: test_generation_parallel.py)."""

import torch
from spawn_utils import run_ranks

from megatron_lite import GPTConfig, GPTModel, ParallelConfig, ParallelLayout


def _coords(rank, world_size, tp, pp):
    layout = ParallelLayout.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
    return {
        "tp": layout.tp_rank,
        "dp": layout.dp_rank,
        "pp": layout.pp_rank,
        "dp_size": layout.dp_size,
        "mp_group_size": torch.distributed.get_world_size(layout.group("mp")),
        "dp_cp_group_size": torch.distributed.get_world_size(layout.group("dp_cp")),
    }


def test_rank_order_is_tp_cp_ep_dp_pp():
    """8 ranks, tp=2, pp=2 -> dp=2; TP varies fastest, PP slowest (Megatron's default order)."""
    results = run_ranks(_coords, 8, 2, 2)
    for rank, c in enumerate(results):
        assert (c["tp"], c["dp"], c["pp"]) == (rank % 2, (rank // 2) % 2, rank // 4), (rank, c)
        assert c["dp_size"] == 2 and c["mp_group_size"] == 4 and c["dp_cp_group_size"] == 2


def _expert_groups(rank, world_size):
    out = {}
    for name, parallel in {
        "tp2-pp2-ep2-etp1": dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        ),
        "tp2-ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
        "cp2-tp2-ep2": dict(tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=2),
    }.items():
        layout = ParallelLayout.build(ParallelConfig(**parallel))
        ranks = {
            g: sorted(torch.distributed.get_process_group_ranks(layout.group(g)))
            if layout.group(g) is not None
            else [rank]
            for g in ("etp", "ep", "edp", "ep_etp", "tp_cp", "tp_dp_cp")
        }
        out[name] = (layout.etp_rank, layout.ep_rank, layout.coords["edp"], ranks)
        layout.destroy()
    return out


def _folded(rank, world_size, pp, etp, ep):
    """Megatron's expert rank generator: order tp-cp-ep-dp-pp with tp=ETP, cp=1, ep=EP, dp=EDP."""
    per_stage = world_size // pp
    stage, local = divmod(rank, per_stage)
    coords = (local % etp, (local // etp) % ep, local // (etp * ep))
    base = stage * per_stage

    def members(dim):
        sizes = (etp, ep, per_stage // (etp * ep))
        strides = (1, etp, etp * ep)
        fixed = local - coords[dim] * strides[dim]
        return [base + fixed + i * strides[dim] for i in range(sizes[dim])]

    both = sorted(base + local - coords[0] - coords[1] * etp + i for i in range(etp * ep))
    return coords, {"etp": members(0), "ep": members(1), "edp": members(2), "ep_etp": both}


def test_experts_fold_into_tp_cp_dp_in_megatron_order():
    """MoE parallel folding: the ranks of a pipeline stage read as ETP x EP x EDP (ETP fastest), whatever TP/CP/DP."""
    results = run_ranks(_expert_groups, 8)
    for rank, result in enumerate(results):
        for name, (pp, etp, ep) in {
            "tp2-pp2-ep2-etp1": (2, 1, 2),
            "tp2-ep2": (1, 2, 2),
            "cp2-tp2-ep2": (1, 2, 2),
        }.items():
            coords, groups = _folded(rank, 8, pp, etp, ep)
            got_etp, got_ep, got_edp, ranks = result[name]
            assert (got_etp, got_ep, got_edp) == coords, (name, rank)
            for g, members in groups.items():
                assert ranks[g] == sorted(members), (name, rank, g)
        # the router's groups: one sequence's ranks (TP x CP) and a whole stage
        assert result["cp2-tp2-ep2"][3]["tp_cp"] == [r for r in range(8) if r // 4 == rank // 4]
        assert result["tp2-pp2-ep2-etp1"][3]["tp_dp_cp"] == [r for r in range(8) if r // 4 == rank // 4]
        assert result["tp2-ep2"][3]["tp_dp_cp"] == list(range(8))


def _train_with_dropout(rank, world_size, sp):
    config = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        seq_length=8,
        make_vocab_size_divisible_by=8,
        hidden_dropout=0.3,
        attention_dropout=0.3,
        position_embedding_type="learned_absolute",
    )
    layout = ParallelLayout.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp))
    torch.manual_seed(1000 + rank)  # a different global RNG per rank: the model must not depend on it
    model = GPTModel(config, layout, seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
        from megatron_lite.core.parallel.data_parallel import finalize_model_grads

        finalize_model_grads(model, layout)
        opt.step()
        losses.append(loss.item())
    replicated = {n: p.detach().clone() for n, p in model.named_parameters() if getattr(p, "tp_shard", None) is None}
    return {"losses": losses, "replicated": replicated}


def test_dropout_keeps_tp_replicas_identical():
    """With dropout on and different global RNG states per rank, TP ranks still agree on the loss
    and on every replicated parameter (norms, position table) after training steps."""
    for sp in (False, True):
        r0, r1 = run_ranks(_train_with_dropout, 2, sp)
        assert r0["losses"] == r1["losses"]
        assert r0["losses"][0] != r0["losses"][1]
        for name, value in r0["replicated"].items():
            assert torch.equal(value, r1["replicated"][name]), (sp, name)


def _collective_without_a_peer(rank, world_size, flag):
    """Rank 0 all-reduces over its TP group while its TP peer (rank 1) never joins: it waits for rank 0 to
    have given up (a file), so the collective can only end by the group's timeout."""
    import time
    from datetime import timedelta
    from pathlib import Path

    layout = ParallelLayout.build(ParallelConfig(tensor_model_parallel_size=2), timeout=timedelta(seconds=2))
    cpu = torch.device("cpu")
    timeouts = {
        name: group._get_backend(cpu).options._timeout.total_seconds()
        for name, group in layout.groups.items()
        # the default group (a stage's every rank without PP) has the timeout the strategy initialised it with
        if group is not None and group is not torch.distributed.group.WORLD
    }
    error = None
    if rank == 0:
        try:
            torch.distributed.all_reduce(torch.ones(1), group=layout.group("tp"))
        except RuntimeError as failure:
            error = str(failure)
        Path(flag).touch()
    else:
        deadline = time.monotonic() + 30  # before the fix rank 0 would wait 30 minutes: stop it by leaving
        while not Path(flag).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"error": error, "timeouts": timeouts}


def test_the_layouts_groups_time_out_after_the_strategys_timeout(tmp_path):
    """tp=2 x dp=2: every group the layout made (the DeviceMesh's per-dimension subgroups and the flattened
    ones) waits the timeout it was given, not torch's 30 minutes: a collective whose peer never joins fails
    after 2 s."""
    results = run_ranks(_collective_without_a_peer, 4, str(tmp_path / "gave_up"))
    for rank, result in enumerate(results):
        assert set(result["timeouts"]) >= {"tp", "dp", "mp", "dp_cp"}, result
        assert all(seconds == 2.0 for seconds in result["timeouts"].values()), (rank, result["timeouts"])
    assert "Timed out waiting 2000ms" in results[0]["error"], results[0]["error"]
