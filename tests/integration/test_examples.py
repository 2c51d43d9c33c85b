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


def test_lora_example_fine_tunes_an_imported_model_and_generates(tmp_path):
    """examples/lora.py at small step counts: the imported base trains its adapters only, the held-out SFT loss
    falls, and it replies with and without the adapters."""
    out = _run(
        "lora.py",
        *("--out", str(tmp_path), "--base-steps", "20", "--steps", "10", "--conversations", "500"),
        *("--new-tokens", "4"),
    )
    trainable, total = (
        int(n.replace(",", "")) for n in re.search(r"trainable parameters: ([\d,]+) of ([\d,]+)", out).groups()
    )
    assert 0 < trainable < total / 10
    before, after = map(float, re.search(r"held-out SFT loss: ([0-9.]+) \(base\) -> ([0-9.]+)", out).groups())
    assert after < before
    assert "--- with the adapters ---" in out and "--- the base alone ---" in out
