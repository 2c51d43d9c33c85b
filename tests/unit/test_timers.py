"""Megatron's timers: accumulate/reset semantics against an outer clock, log levels, the report text,
and min/max across real ranks (gloo) over the world and over a subgroup."""

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_lite.core.timers import DummyTimer, Timer, TimerReport, Timers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from spawn_utils import run_ranks  # noqa: E402


def _timed_sleep(timer, seconds: float) -> tuple[float, float]:
    """Sleep ``seconds`` inside ``timer``; returns (lower bound, upper bound) of the true interval."""
    outer = time.perf_counter()
    timer.start()
    time.sleep(seconds)
    timer.stop()
    return seconds, time.perf_counter() - outer


def test_timer_accumulates_between_resets_within_an_outer_clock():
    timer = Timers(log_level=0)("step", log_level=0)
    low1, high1 = _timed_sleep(timer, 0.02)
    low2, high2 = _timed_sleep(timer, 0.01)
    total = timer.elapsed(reset=False)
    assert low1 + low2 <= total <= high1 + high2
    assert timer.elapsed(reset=True) == total  # reading without reset did not reset
    assert timer.elapsed() == 0.0  # the previous read reset it
    assert timer.active_time() == total  # the lifetime total survives resets


def test_elapsed_of_a_running_timer_counts_the_open_interval_and_keeps_running():
    timer = Timer("t")
    outer = time.perf_counter()
    timer.start()
    time.sleep(0.02)
    before_read = time.perf_counter()
    first = timer.elapsed(reset=True)
    assert 0.02 <= first <= time.perf_counter() - outer
    assert timer.started
    time.sleep(0.01)
    timer.stop()
    # only the time since the read (the timer restarted inside elapsed)
    assert 0.01 <= timer.elapsed() <= time.perf_counter() - before_read


def test_misuse_is_an_error_that_says_what_to_do():
    timer = Timer("t")
    with pytest.raises(RuntimeError, match="not started; start"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="already been started; stop"):
        timer.start()
    with pytest.raises(ValueError, match="log_level must be an integer in 0..2"):
        Timers(log_level=3)
    with pytest.raises(ValueError, match="log_option must be one of"):
        Timers(log_option="median")
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        Timers().log(normalizer=0)


def test_log_levels_above_the_configured_one_are_no_ops():
    timers = Timers(log_level=1)
    assert isinstance(timers("coarse", log_level=0), Timer)
    assert isinstance(timers("phase", log_level=1), Timer)
    fine = timers("fine", log_level=2)
    assert isinstance(fine, DummyTimer)
    assert isinstance(timers("unspecified"), DummyTimer)  # default level is the finest, like Megatron
    fine.start()
    fine.stop()  # no-ops, no error
    with pytest.raises(RuntimeError, match="disabled by the log level"):
        fine.elapsed()
    assert timers.names == ["coarse", "phase"]
    assert timers("coarse") is timers("coarse", log_level=0)
    with pytest.raises(ValueError, match="one level per timer name"):
        timers("coarse", log_level=1)


def test_cuda_is_synchronized_only_for_a_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("checks that a CPU-only torch is never asked to synchronize CUDA")
    Timers(device="cpu")("t", 0).start()  # never touches CUDA
    with pytest.raises((AssertionError, RuntimeError)):
        Timers(device="cuda")("t", 0).start()  # tries to synchronize the CUDA device


def test_log_without_a_process_group_reports_this_rank_normalized():
    timers = Timers(log_level=2)
    _timed_sleep(timers("forward-backward", 1), 0.01)
    _timed_sleep(timers("optimizer", 1), 0.005)
    expected = timers.elapsed_ms(["forward-backward", "optimizer"], reset=False)
    report = timers.log(normalizer=4)
    assert report.per_rank_ms == [[expected[0] / 4, expected[1] / 4]]
    assert report.min_max_ms == {"forward-backward": (expected[0] / 4,) * 2, "optimizer": (expected[1] / 4,) * 2}
    assert timers.elapsed_ms(["forward-backward"]) == [0.0]  # log reset the timers
    assert report.metrics() == {"timers/forward-backward": expected[0] / 4, "timers/optimizer": expected[1] / 4}


def test_report_text_is_megatrons_format():
    report = TimerReport(
        names=["forward-backward", "optimizer", "unused"],
        per_rank_ms=[[10.0, 2.5, 0.0], [12.25, 0.0, 0.0]],
        log_option="minmax",
    )
    assert report.text == (
        "(min, max) time across ranks (ms):\n"
        "    forward-backward ...............................: (10.00, 12.25)\n"
        "    optimizer ......................................: (2.50, 2.50)"
    )
    report.log_option = "max"
    assert report.text.splitlines()[0] == "max time across ranks (ms):"
    assert report.text.splitlines()[1].endswith(": 12.25")
    report.log_option = "all"
    assert report.text == (
        "times across ranks (ms):\n  forward-backward:\n     rank  0: 10.00\n"
        "     rank  1: 12.25\n  optimizer:\n     rank  0: 2.50"
    )
    assert str(TimerReport(names=["x"], per_rank_ms=[[0.0]])) == ""


def _rank_timings(rank: int, world_size: int):
    torch.set_num_threads(1)
    timers = Timers(log_level=2)
    # Ranks take different times; "only-rank-1" exists only on rank 1 (zeros elsewhere must be ignored).
    _timed_sleep(timers("forward-backward", 1), 0.01 * (rank + 1))
    if rank == 1:
        _timed_sleep(timers("only-rank-1", 2), 0.005)
    names = ["forward-backward", "only-rank-1"]
    local = timers.elapsed_ms(names, reset=False)
    world = timers.log(names, normalizer=2.0, reset=False)
    subgroup = dist.new_group([0, 2])  # every rank must create it, only members use it
    sub = timers.log(names, normalizer=1.0, group=subgroup) if rank in (0, 2) else None
    return local, world, sub


def test_min_max_across_ranks_and_over_a_subgroup():
    results = run_ranks(_rank_timings, 3)
    local = [r[0] for r in results]
    world = results[0][1]
    assert all(r[1].per_rank_ms == world.per_rank_ms for r in results)  # every rank sees the same gather
    assert world.per_rank_ms == [[ms / 2.0 for ms in row] for row in local]
    fb = [row[0] / 2.0 for row in local]
    assert world.min_max_ms["forward-backward"] == (min(fb), max(fb))
    assert min(fb) < max(fb)  # ranks slept 10, 20, 30 ms: min and max come from different ranks
    assert world.min_max_ms["only-rank-1"] == (local[1][1] / 2.0, local[1][1] / 2.0)
    sub = results[0][2]
    assert results[2][2].per_rank_ms == sub.per_rank_ms
    assert sub.per_rank_ms == [local[0], local[2]]  # group ranks 0 and 1 are global ranks 0 and 2
    assert "only-rank-1" not in sub.min_max_ms
    assert "(min, max) time across ranks (ms):" in sub.text
