"""The examples run as a user runs them: as scripts, two ranks, tensor parallel."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, timeout: int = 600) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("script", ["subclass_gpt_module.py", "own_lightning_module.py"])
def test_extension_examples_train(script):
    out = _run(script, "--devices", "2", "--tp", "2", "--max-steps", "4")
    loss = float(re.search(r"final train/loss[^:]*: ([0-9.]+)", out).group(1))
    assert 4.0 < loss < 7.0  # ~ln(512) = 6.2 at the start


@pytest.mark.slow
def test_demo_trains_and_generates():
    # 25 steps: the mean loss of steps 16-25 is ~1.4 below that of steps 1-10 (40 steps: ~1.7); the warmup is 20
    out = _run("demo.py", "--max-steps", "25", "--new-tokens", "8")
    first, last = map(float, re.search(r"train loss: ([0-9.]+) .* -> ([0-9.]+)", out).groups())
    assert last < first - 0.5, out
    assert "--- greedy continuation ---" in out and "ROMEO:" in out
    assert "--- sampled continuation (temperature 0.8, top-p 0.9, seed 1) ---" in out
