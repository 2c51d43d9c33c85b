"""Pipeline schedule orders: every microbatch's forward and backward once per chunk, forwards before
backwards, the memory bound of 1F1B, and an order that can run (simulated across ranks)."""

import pytest

from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.parallel.pipeline.schedules import schedule_order
from megatron_lite.core.parallel.pipeline_stages import (
    V_SHAPED_SCHEDULES,
    layers_per_virtual_stage,
    stage_chunks,
    stage_pp_rank,
    virtual_stage_of,
)


def _simulate(orders: list[list[tuple]], pp: int, vpp: int, v_shape: bool = False) -> int:
    """Run every rank's order with blocking receives and non-blocking sends; returns the number of
    rounds (fails on a deadlock)."""
    done: set = set()  # (kind, virtual stage, microbatch)
    pos = [0] * pp
    rounds = 0
    stages = pp * vpp
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            kind, chunk, mb = orders[r][pos[r]]
            vs = virtual_stage_of(chunk, r, pp, v_shape)
            if kind == "F":
                ready = vs == 0 or ("F", vs - 1, mb) in done
            elif kind == "W":
                ready = ("B", vs, mb) in done
            else:
                ready = ("F", vs, mb) in done and (vs == stages - 1 or ("B", vs + 1, mb) in done)
            if ready:
                done.add((kind, vs, mb))
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock at {[orders[r][pos[r]] if pos[r] < len(orders[r]) else None for r in range(pp)]}"
        rounds += 1
    return rounds


@pytest.mark.parametrize(
    "schedule, pp, vpp, m",
    [
        ("1f1b", 2, 1, 1),
        ("1f1b", 2, 1, 8),
        ("1f1b", 4, 1, 3),
        ("1f1b", 4, 1, 16),
        ("gpipe", 4, 1, 5),
        ("interleaved_1f1b", 2, 2, 2),
        ("interleaved_1f1b", 2, 2, 8),
        ("interleaved_1f1b", 4, 2, 8),
        ("interleaved_1f1b", 2, 3, 4),
        ("zb1p", 2, 1, 1),
        ("zb1p", 2, 1, 8),
        ("zb1p", 4, 1, 3),
        ("zb1p", 4, 1, 16),
        ("zbv", 2, 2, 1),
        ("zbv", 2, 2, 8),
        ("zbv", 4, 2, 5),
        ("zbv", 4, 2, 16),
        ("dualpipev", 2, 2, 4),
        ("dualpipev", 4, 2, 8),
        ("dualpipev", 3, 2, 11),
    ],
)
def test_orders_are_complete_and_run_without_deadlock(schedule, pp, vpp, m):
    orders = [schedule_order(schedule, m, pp, r, vpp) for r in range(pp)]
    kinds = "FBW" if schedule in ("zb1p", *V_SHAPED_SCHEDULES) else "FB"
    for order in orders:
        assert sorted(order) == sorted([(k, c, i) for k in kinds for c in range(vpp) for i in range(m)])
        for kind, chunk, mb in order:
            if kind == "B":
                assert order.index(("F", chunk, mb)) < order.index(("B", chunk, mb))
            if kind == "W":
                assert order.index(("B", chunk, mb)) < order.index(("W", chunk, mb))
    _simulate(orders, pp, vpp, schedule in V_SHAPED_SCHEDULES)
    forward_only = [schedule_order(schedule, m, pp, r, vpp, forward_only=True) for r in range(pp)]
    assert all(len(o) == m * vpp and all(k == "F" for k, _, _ in o) for o in forward_only)


def test_one_f_one_b_keeps_at_most_p_minus_rank_microbatches_alive():
    pp, m = 4, 12
    for rank in range(pp):
        alive, peak = 0, 0
        for kind, _, _ in schedule_order("1f1b", m, pp, rank, 1):
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        assert peak == pp - rank
    # GPipe keeps every microbatch
    assert max(sum(1 for k, _, _ in schedule_order("gpipe", m, pp, 0, 1)[:i] if k == "F") for i in range(2 * m)) == m


def test_zb1p_holds_at_most_the_first_stages_1f1b_microbatches_on_every_rank():
    """ZB-H1's memory bound (Qi et al. 2024, section 3): a microbatch is alive from its forward to its weight pass;
    no rank holds more than P, what 1F1B holds on its first stage, and the first stage holds exactly that."""
    for pp, m in ((2, 8), (4, 12), (4, 3)):
        for rank in range(pp):
            alive, peak = 0, 0
            for kind, _, _ in schedule_order("zb1p", m, pp, rank, 1):
                alive += {"F": 1, "B": 0, "W": -1}[kind]
                peak = max(peak, alive)
            assert peak <= min(pp, m) and (rank > 0 or peak == min(pp, m)), (pp, m, rank, peak)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 3), (3, 7)])
def test_zb1p_orders_equal_torch_pipelinings_zero_bubble_schedule(pp, m):
    """torch.distributed.pipelining's ScheduleInterleavedZeroBubble with one stage per rank is ZB-H1: its per-rank
    action lists (idle slots dropped; its "I" is our "B") are our orders."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import (
        BACKWARD_INPUT,
        BACKWARD_WEIGHT,
        FORWARD,
        ScheduleInterleavedZeroBubble,
    )

    kinds = {FORWARD: "F", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}
    state = SimpleNamespace(n_local_stages=1, microbatches_per_round=pp, pp_group_size=pp, _n_microbatches=m)
    for rank in range(pp):
        theirs = ScheduleInterleavedZeroBubble._calculate_single_rank_operations(state, rank)  # type: ignore[arg-type]
        theirs = [(kinds[a.computation_type], 0, a.microbatch_index) for a in theirs if a is not None]
        assert schedule_order("zb1p", m, pp, rank, 1) == theirs


def _torch_orders(schedule: str, pp: int, m: int) -> list[list[tuple]]:
    """torch.distributed.pipelining's per-rank action lists for its ZBV / DualPipeV schedules, idle slots dropped, in
    our terms: its stage index turned into our chunk (V placement), "I" into "B", a full backward into "B" then "W",
    an overlapped forward-and-backward pair into the forward then the backward."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as torch_schedules

    cls = {"zbv": torch_schedules.ScheduleZBVZeroBubble, "dualpipev": torch_schedules.ScheduleDualPipeV}[schedule]
    kinds = {torch_schedules.FORWARD: "F", torch_schedules.BACKWARD_INPUT: "B", torch_schedules.BACKWARD_WEIGHT: "W"}
    state = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
    orders = []
    for rank in range(pp):
        order = []
        for action in cls._calculate_single_rank_operations(state, rank):  # type: ignore[arg-type]
            if action is None:
                continue
            overlapped = action.computation_type == torch_schedules.OVERLAP_F_B
            for sub in action.sub_actions if overlapped else [action]:
                chunk = 0 if sub.stage_index == rank else 1
                if sub.computation_type == torch_schedules.FULL_BACKWARD:
                    order += [("B", chunk, sub.microbatch_index), ("W", chunk, sub.microbatch_index)]
                else:
                    order.append((kinds[sub.computation_type], chunk, sub.microbatch_index))
        orders.append(order)
    return orders


@pytest.mark.parametrize(
    "schedule, pp, m",
    [("zbv", 2, 2), ("zbv", 2, 8), ("zbv", 4, 5), ("zbv", 4, 16), ("dualpipev", 2, 4), ("dualpipev", 4, 9)],
)
def test_v_shaped_orders_equal_torch_pipelinings(schedule, pp, m):
    assert [schedule_order(schedule, m, pp, rank, 2) for rank in range(pp)] == _torch_orders(schedule, pp, m)


def test_v_placement_puts_the_first_and_last_stage_on_rank_zero():
    """Chunk 0 of rank r is stage r, chunk 1 is stage 2P-1-r (torch's 'v' style); the layers follow the stages."""
    pp = 4
    for rank in range(pp):
        chunks = stage_chunks(16, pp, rank, 2, v_shape=True)
        assert [c.virtual_stage for c in chunks] == [rank, 2 * pp - 1 - rank]
        assert [list(c.layers) for c in chunks] == [[2 * rank, 2 * rank + 1], [14 - 2 * rank, 15 - 2 * rank]]
        assert all(stage_pp_rank(c.virtual_stage, pp, v_shape=True) == rank for c in chunks)
    first, last = stage_chunks(16, pp, 0, 2, v_shape=True)
    assert first.pre_process and last.post_process
    assert (
        ParallelConfig(
            pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, pipeline_schedule="zbv"
        ).last_stage_pp_rank
        == 0
    )


@pytest.mark.parametrize("schedule, extra", [("zbv", 0), ("dualpipev", 1)])
def test_v_shaped_schedules_hold_one_f_one_b_first_stage_memory(schedule, extra):
    """ZB-V's bound (Qi et al. 2024, section 6): 2P chunk-microbatches of half the layers alive (forward done, W not
    yet) on every rank, the activations of P whole microbatches: 1F1B's first stage. DualPipeV holds one more."""
    for pp, m in ((2, 8), (4, 8), (4, 16), (3, 12)):
        for rank in range(pp):
            alive, peak = 0, 0
            for kind, _, _ in schedule_order(schedule, m, pp, rank, 2):
                alive += {"F": 1, "B": 0, "W": -1}[kind]
                peak = max(peak, alive)
            assert peak == 2 * pp + extra, (pp, m, rank, peak)


def test_interleaving_shrinks_the_simulated_bubble():
    pp, m = 2, 8
    plain = _simulate([schedule_order("1f1b", m, pp, r, 1) for r in range(pp)], pp, 1)
    # With V chunks each action is 1/V of the work: compare rounds normalised by the work per action.
    interleaved = _simulate([schedule_order("interleaved_1f1b", m, pp, r, 2) for r in range(pp)], pp, 2) / 2
    assert interleaved < plain


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (dict(virtual_pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size > 1"),
        (dict(pipeline_model_parallel_size=2, pipeline_schedule="bogus"), "pipeline_schedule must be one of"),
        (
            dict(pipeline_model_parallel_size=2, pipeline_schedule="interleaved_1f1b"),
            "needs virtual_pipeline_model_parallel_size > 1",
        ),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_schedule="1f1b"),
            "use pipeline_schedule='interleaved_1f1b'",
        ),
        (dict(pipeline_model_parallel_size=2, pipeline_schedule="zbv"), "set virtual_pipeline_model_parallel_size=2"),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3, pipeline_schedule="dualpipev"),
            "two model chunks per rank in a V",
        ),
        (dict(pipeline_schedule="gpipe"), "needs pipeline_model_parallel_size > 1"),
        (dict(pipeline_schedule="zb1p"), "needs pipeline_model_parallel_size > 1"),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_schedule="zb1p"),
            "runs one model chunk per rank",
        ),
    ],
)
def test_pipeline_config_errors_name_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        ParallelConfig(**kwargs)


def test_layer_cuts():
    assert layers_per_virtual_stage(8, 2) == [4, 4]
    assert layers_per_virtual_stage(8, 2, 2) == [2, 2, 2, 2]
    assert layers_per_virtual_stage(8, 4, first=1, last=1) == [1, 3, 3, 1]
    assert layers_per_virtual_stage(5, 2, first=2) == [2, 3]
    with pytest.raises(ValueError, match="must be divisible by pipeline_model_parallel_size x virtual"):
        layers_per_virtual_stage(6, 2, 2)
    with pytest.raises(ValueError, match="must split evenly over the 2 other pipeline stage"):
        layers_per_virtual_stage(8, 4, first=1, last=2)
    with pytest.raises(ValueError, match="without virtual pipeline stages only"):
        layers_per_virtual_stage(8, 2, 2, first=1)
    assert layers_per_virtual_stage(4, 2, 2, layout_counts=(0, 2, 2, 0)) == [0, 2, 2, 0]
    with pytest.raises(ValueError, match=r"holds 4 transformer layers \('t'\), but num_layers is 5; make them equal"):
        layers_per_virtual_stage(5, 2, 2, layout_counts=(0, 2, 2, 0))


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (dict(pipeline_model_parallel_layout="Et|tL"), "layout needs pipeline_model_parallel_size > 1"),
        (
            dict(
                pipeline_model_parallel_size=2,
                pipeline_model_parallel_layout="Et|tL",
                num_layers_in_first_pipeline_stage=1,
            ),
            "replaces num_layers_in_first/last_pipeline_stage",
        ),
        (
            dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="E|tt|tt|L"),
            r"has 4 virtual stage\(s\).* 2 x 1 = 2; set virtual_pipeline_model_parallel_size=2",
        ),
        (
            dict(pipeline_model_parallel_size=3, pipeline_model_parallel_layout="Et|tL"),
            r"give it a multiple of pipeline_model_parallel_size \(3\) stages",
        ),
        (
            dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Etm|tL"),
            "multi-token prediction layers .* away from the loss",
        ),
        (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tx"), "'x' is not part of the"),
        (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="(Et|)tL"), "'\\(' is not part of"),
        (
            dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout=[["embedding", "t"], ["loss"]]),
            "'t' is not a layer name",
        ),
        (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout=4), "must be a string such as"),
        (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="tE|tL"), "'E' must open the first"),
        (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|LtL"), "'L' must close the last"),
    ],
)
def test_pipeline_layout_errors_name_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        ParallelConfig(**kwargs)
