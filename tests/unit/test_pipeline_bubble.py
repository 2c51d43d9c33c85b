"""The measured bubble and its theory on hand-made events (no processes: the arithmetic alone)."""
import pytest

from megatron_lite.core.parallel.pipeline.schedules import PipelineEvent
from megatron_lite.pipeline_timeline import TimelineError, measured_bubble, theoretical_bubble

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
    with pytest.raises(ValueError, match="no bubble formula"):
        theoretical_bubble("zbv", 2, 4)


def test_a_step_without_backwards_is_refused():
    with pytest.raises(TimelineError, match="forwards and backwards"):
        measured_bubble({0: _events(("F", 0, 0, 1))})
