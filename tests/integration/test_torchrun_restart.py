"""Fault 1 (issue 13): SIGKILL one rank of a 4-rank TP2 x DP2 run under torchrun, at three points -- mid-step,
mid-save, right after a save. torchrun restarts the job, the restarted ranks resume with ``ckpt_path="last"``
from the newest finished checkpoint (never the save the kill interrupted), train the same losses as an
uninterrupted run from there, and the final parameters equal the uninterrupted run's bit for bit. Real
processes (torchrun, gloo), a real Trainer with Lightning's ModelCheckpoint; the kill is the script killing
its own rank (tests/integration/restart_script.py).

The three kills are three attempts of one ``torchrun --max-restarts 3`` job (one job instead of three saves two
launches and a third of the steps): attempt 0 is killed mid-step, attempt 1 mid-save, attempt 2 right after a
save, attempt 3 finishes. Each resume is checked on its own (its start step and the losses of the steps it
trained), the final parameters for all of them together. torchrun runs as preloaded_torchrun.py: its workers are
forked from the agent with Lightning imported (``--run-path --start-method fork``), not 16 fresh interpreters
that spent ~5 s of CPU each importing it (~20 s of wall time for the job instead of ~70 s on 2 cores).

torchrun is run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch 2.13's default shares the launcher's store
across restarts without separating the attempts, so the restarted ranks read the killed attempt's addresses
and hang or fail in init_process_group (pytorch/pytorch#135712; a plain gloo script restarts in ~1 of 7 tries).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests" / "distributed"))
sys.path.insert(0, str(HERE))
from parity_utils import run  # noqa: E402
from reliability_record import record  # noqa: E402
from restart_script import GBS, MBS, STEPS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("torchrun_restart")]

# One attempt each, in this order: (kill point, rank killed, steps done when it is armed, the step the next
# attempt must resume from; None: the save before the one the kill interrupted, read from the log)
POINTS = [("mid-step", 1, 5, 4), ("mid-save", 0, 6, None), ("after-save", 3, 6, 6)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("reference"), devices=4, tp=2, steps=STEPS, gbs=GBS, mbs=MBS)


def test_killed_ranks_restart_the_job_which_resumes_bit_for_bit(tmp_path, reference):
    out = tmp_path / "run"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO),
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        KILLS=",".join(f"{p}:{r}:{s}" for p, r, s, _ in POINTS),
    )
    env.pop("MASTER_PORT", None)
    cmd = [
        sys.executable,
        str(HERE / "preloaded_torchrun.py"),  # torchrun, its workers forked with Lightning imported
        "--standalone",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        str(len(POINTS)),
        "--monitor-interval",
        "0.2",
        str(HERE / "restart_script.py"),
        str(out),
    ]
    with open(tmp_path / "log.txt", "w") as log_file:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=500)
    log = (tmp_path / "log.txt").read_text()
    assert proc.returncode == 0, log[-5000:]  # torchrun exits 0 only when the last attempt finished

    first, _ = (out / "start0.txt").read_text().split()
    assert int(first) == 0 and not (out / f"start{len(POINTS) + 1}.txt").exists()  # one restart per kill
    records = []
    for attempt, (point, rank, step, resume_step) in enumerate(POINTS):
        killed = (out / f"killed{attempt}.txt").read_text()
        assert killed.startswith(point), killed
        started = int((out / f"start{attempt}.txt").read_text().split()[0])
        resumed, resumed_at = (out / f"start{attempt + 1}.txt").read_text().split()
        if resume_step is None:  # mid-save: the interrupted save was named and skipped, the one before it resumed
            interrupted = re.search(
                r"(\.epoch=0-step=(\d+)\.ckpt\.tmp-[0-9a-f]{8}): a save of .* killed before it "
                r"was committed",
                log,
            )
            assert interrupted, log[-5000:]
            assert interrupted.group(1) in killed  # the very save the kill interrupted
            resume_step = int(interrupted.group(2)) - 2
        assert int(resumed) == resume_step > 0
        assert f"(global step {resume_step})" in log
        # the steps this attempt finished are the uninterrupted run's (the ones before the kill, as resumed)
        losses = {int(s): loss for s, loss in json.loads((out / f"losses{attempt}.json").read_text()).items()}
        assert sorted(losses) == list(range(started + 1, max(losses) + 1)) and max(losses) >= step, losses
        assert all(loss == reference["losses"][s - 1] for s, loss in losses.items()), (losses, reference["losses"])

        armed_at = json.loads((out / f"armed{attempt}.json").read_text())["armed_at"]
        lost = {"mid-step": step + 1 - resume_step, "mid-save": step - resume_step, "after-save": 0}[point]
        records.append(
            (
                f"1-sigkill-{point}",
                f"SIGKILL of rank {rank} of a TP2xDP2 run (4 ranks, torchrun --max-restarts {len(POINTS)}, checkpoints "
                f"every 2 steps; attempt {attempt} of one job): {killed}",
                f"torchrun restarted the job; ckpt_path='last' resumed step {resume_step}"
                + (" (the interrupted save skipped, never loaded)" if point == "mid-save" else "")
                + "; the steps trained again and the final parameters equal the uninterrupted run's bit for bit",
                0,
                f"none ({lost} step(s) since the last checkpoint trained again)",
                float(resumed_at) - armed_at,
            )
        )

    result = torch.load(out / "result.pt", weights_only=True)
    assert result["global_step"] == STEPS
    assert result["losses"] == reference["losses"][POINTS[-1][3] :]
    assert result["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        assert torch.equal(result["params"][name], value), name
    for entry in records:  # what was seen, once every assertion held
        record(*entry)
