"""Fault 8 (issue 13): consecutive short 2-rank TP2 runs start and exit cleanly -- exit code 0 on both
ranks, no "terminate called without an active exception", no traceback, no process left behind.

Each rank leaves through interpreter finalisation as under torchrun (see exit_loop.py). The default is
a short loop; ``MEGATRON_LITE_EXIT_RUNS=200`` runs the issue's 200 (10-20 minutes on 2 cores: past
pytest's 600 s per-test timeout, so add ``-o timeout=0``, as ``make reliability`` does).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from reliability_record import record  # noqa: E402

RUNS = int(os.environ.get("MEGATRON_LITE_EXIT_RUNS", "10"))


@pytest.mark.slow
def test_short_two_rank_runs_exit_cleanly(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(HERE / "exit_loop.py"), str(RUNS), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60 + 30 * RUNS,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["failures"] == [], json.dumps(summary["failures"][:3], indent=1)
    assert summary["clean"] == RUNS
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert leftovers == [], leftovers  # a clean rank's log is removed: nothing else was written
    record(
        "8-clean-exit",
        f"{RUNS} consecutive short 2-rank TP2 runs (ranks exit through interpreter finalisation)",
        f"{summary['clean']} of {RUNS} runs: both ranks exited 0, no abort, no traceback, no process left",
        None,
        "none",
        None,
        wall_s=round(time.monotonic() - start, 1),
    )
