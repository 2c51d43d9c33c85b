"""Pipeline schedule orders: every microbatch's forward and backward once per chunk, forwards before
backwards, the memory bound of 1F1B, and an order that can run (simulated across ranks)."""

import pytest

from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.parallel.pipeline.schedules import schedule_order
from megatron_lite.core.parallel.pipeline_stages import layers_per_virtual_stage


def _simulate(orders: list[list[tuple]], pp: int, vpp: int) -> int:
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
            vs = chunk * pp + r
            if kind == "F":
                ready = vs == 0 or ("F", vs - 1, mb) in done
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
    ],
)
def test_orders_are_complete_and_run_without_deadlock(schedule, pp, vpp, m):
    orders = [schedule_order(schedule, m, pp, r, vpp) for r in range(pp)]
    for order in orders:
        assert sorted(order) == sorted([(k, c, i) for k in "FB" for c in range(vpp) for i in range(m)])
        for kind, chunk, mb in order:
            if kind == "B":
                assert order.index(("F", chunk, mb)) < order.index(("B", chunk, mb))
    _simulate(orders, pp, vpp)
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
        (dict(pipeline_model_parallel_size=2, pipeline_schedule="zbv"), "not offered yet"),
        (dict(pipeline_schedule="gpipe"), "needs pipeline_model_parallel_size > 1"),
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
        (dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tmL"), "multi-token prediction"),
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
