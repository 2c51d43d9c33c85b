"""The measured bubble and its theory on hand-made events (no processes: the arithmetic alone)."""

import pytest

from megatron_lite.core.parallel.pipeline.schedules import PipelineEvent, schedule_order
from megatron_lite.core.parallel.pipeline.timeline import TimelineError, measured_bubble, theoretical_bubble
from megatron_lite.core.parallel.pipeline_stages import V_SHAPED_SCHEDULES, virtual_stage_of

T0 = 1_700_000_000.0  # wall-clock seconds, as time.time() gives them: the arithmetic must not depend on the origin


def _events(*spans):
    return [PipelineEvent(kind, 0, 0, mb, T0 + start, T0 + end) for kind, mb, start, end in spans]


def test_ideal_1f1b_bubble_equals_the_formula():
    """P=2, M=2, forward 1 s and backward 2 s on both stages, no transfer time: the step spans 9 s, each stage
    works 6 s, so both stages idle 1/3 of it, which is (P-1)/(M+P-1)."""
    stages = {
        0: _events(("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 4, 6), ("B", 1, 7, 9)),
        1: _events(("F", 0, 1, 2), ("B", 0, 2, 4), ("F", 1, 4, 5), ("B", 1, 5, 7)),
    }
    bubble = measured_bubble(stages)
    assert bubble.span_s == 9.0
    assert bubble.busy_s == {0: 6.0, 1: 6.0}
    assert bubble.per_stage == {0: pytest.approx(1 / 3, abs=1e-12), 1: pytest.approx(1 / 3, abs=1e-12)}
    assert bubble.mean == pytest.approx(1 / 3, abs=1e-12)
    assert bubble.mean == pytest.approx(theoretical_bubble("1f1b", 2, 2), abs=1e-12)


def test_uneven_stages_are_reported_per_stage_and_averaged():
    # the span runs from the first forward's start (stage 0 at 0) to the last backward's end (stage 0 at 10)
    stages = {0: _events(("F", 0, 0, 2), ("B", 0, 6, 10)), 1: _events(("F", 0, 2, 3), ("B", 0, 3, 6))}
    bubble = measured_bubble(stages)
    assert bubble.span_s == 10.0
    assert bubble.per_stage == {0: pytest.approx(0.4, abs=1e-12), 1: pytest.approx(0.6, abs=1e-12)}
    assert bubble.mean == pytest.approx(0.5, abs=1e-12)


def test_theory():
    assert theoretical_bubble("1f1b", 4, 8) == 3 / 11
    assert theoretical_bubble("gpipe", 2, 2) == 1 / 3
    assert theoretical_bubble("interleaved_1f1b", 2, 4, 2) == 1 / 9  # (P-1)/(V*M+P-1)
    assert theoretical_bubble("zb1p", 4, 8) == 3 / 27  # (P-1)/(3M+P-1): 1F1B's 3/11 over (nearly) three
    assert theoretical_bubble("zbv", 4, 16, 2) == 3 / 99  # (P-1)/(6M+P-1): the warm-up's first chunk-forwards
    with pytest.raises(ValueError, match="no bubble formula"):
        theoretical_bubble("bogus", 2, 4)


def test_a_step_without_backwards_is_refused():
    with pytest.raises(TimelineError, match="forwards and backwards"):
        measured_bubble({0: _events(("F", 0, 0, 1))})


def _simulate(schedule: str, P: int, M: int, V: int, forward: float = 1.0, backward: float = 2.0) -> dict:
    """Every rank runs the engine's action order for ``schedule``; an action starts when its rank is free
    and its input exists (the previous virtual stage's forward, the next one's backward), and lasts
    ``forward / V`` or ``backward / V``: equal stages, free communication."""
    orders = {r: schedule_order(schedule, M, P, r, V) for r in range(P)}
    split = any(kind == "W" for order in orders.values() for kind, _, _ in order)
    done, position, free = {}, dict.fromkeys(range(P), 0), dict.fromkeys(range(P), T0)
    events = {r: [] for r in range(P)}
    last = P * V - 1
    while any(position[r] < len(orders[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while position[r] < len(orders[r]):
                kind, chunk, mb = orders[r][position[r]]
                stage = virtual_stage_of(chunk, r, P, schedule in V_SHAPED_SCHEDULES)
                if kind == "F":
                    needs = ("F", stage - 1, mb) if stage > 0 else None
                elif kind == "W":
                    needs = ("B", stage, mb)
                else:
                    needs = ("B", stage + 1, mb) if stage < last else ("F", stage, mb)
                if needs is not None and needs not in done:
                    break
                start = max(free[r], done[needs] if needs else T0)
                # a split backward: its input-gradient and weight-gradient passes take half the whole's time each
                duration = forward if kind == "F" else backward / 2 if split else backward
                free[r] = done[(kind, stage, mb)] = start + duration / V
                events[r].append(PipelineEvent(kind, chunk, stage, mb, start, free[r]))
                position[r] += 1
                moved = True
        assert moved, "the orders deadlock"
    return events


@pytest.mark.parametrize(
    "schedule, P, M, V",
    [
        ("1f1b", 2, 2, 1),
        ("1f1b", 2, 8, 1),
        ("1f1b", 4, 16, 1),
        ("gpipe", 4, 8, 1),
        ("interleaved_1f1b", 2, 2, 2),
        ("interleaved_1f1b", 2, 8, 2),
        ("interleaved_1f1b", 4, 16, 2),
        ("interleaved_1f1b", 2, 6, 3),
        ("zb1p", 2, 4, 1),
        ("zb1p", 4, 8, 1),
        ("zb1p", 4, 16, 1),
        ("zbv", 2, 4, 2),
        ("zbv", 4, 16, 2),
        ("dualpipev", 2, 8, 2),
        ("dualpipev", 4, 8, 2),
    ],
)
def test_the_engine_schedules_reach_the_theory_with_equal_stages(schedule, P, M, V):
    """The schedule orders the engine runs, played with equal stage times and free communication, idle exactly
    the formula's fraction: what the benchmark measures on real ranks departs from theory only through real
    costs (unequal stages, transfers, other processes)."""
    bubble = measured_bubble(_simulate(schedule, P, M, V))
    assert bubble.mean == pytest.approx(theoretical_bubble(schedule, P, M, V), abs=1e-9)
