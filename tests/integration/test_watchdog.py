"""Fault 5 (issue 13): one rank stuck inside a step. The hang watchdog fires within timeout + 10 s,
every rank's Python stacks reach the log, the exit code is non-zero, nothing hangs (torchrun, gloo,
a real Trainer). Also: the watchdog alone in a plain process, the alarm that makes a peer dump, and the
straggler report naming a slow rank.
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.callbacks import HangWatchdog, StragglerReport
from megatron_lite.core.watchdog import WATCHDOG_EXIT_CODE

HERE = Path(__file__).parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from reliability_record import record  # noqa: E402

TIMEOUT_S = 5.0


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    env.pop("MASTER_PORT", None)
    return env


def test_a_rank_stuck_in_a_step_ends_the_job_with_every_ranks_stacks(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "fault_script.py"),
        "hang",
        str(out),
        str(TIMEOUT_S),
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    progress = out / "progress"
    deadline = time.monotonic() + 240
    while not (progress.exists() and progress.read_text().strip() == "2"):  # rank 1 now sleeps in step 2
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the hang"
        time.sleep(0.02)
    hung = time.monotonic()
    log, _ = proc.communicate(timeout=TIMEOUT_S + 120)  # never waits forever: the test would fail here
    ended_s = time.monotonic() - hung
    assert proc.returncode != 0
    assert ended_s <= TIMEOUT_S + 10, f"the job ended {ended_s:.1f} s after the hang (timeout {TIMEOUT_S} s)"
    for rank in (0, 1):  # both ranks fired, said why, and dumped every thread's stack into the log
        assert f"megatron-lite watchdog: rank {rank} (pid" in log, log[-5000:]
        assert f"exitcode  : {WATCHDOG_EXIT_CODE}" in log
    assert "(most recent call first)" in log
    stacks = {r: (out / "stacks" / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert "in on_train_batch_start" in stacks[1] and "in on_train_batch_start" not in stacks[0]  # where rank 1 sleeps
    assert "in training_step" in stacks[0]  # the waiting rank: inside the step's collective
    assert "in training_step" not in stacks[1]
    record(
        "5-hang",
        "rank 1 of a TP2 run sleeps inside step 2 (torchrun, watchdog timeout 5 s)",
        f"both watchdogs fired; every rank's Python stacks in the log and in stacks/rank<r>.txt; every rank exited "
        f"{WATCHDOG_EXIT_CODE}, torchrun non-zero, {ended_s:.1f} s after the hang began (a launcher with restarts "
        f"would resume from the last checkpoint)",
        None,
        "none beyond the steps since the last checkpoint",
        None,
        ended_s=round(ended_s, 1),
    )


WATCHED = textwrap.dedent("""
    import sys, time
    from megatron_lite.core.watchdog import Watchdog
    dog = Watchdog(float(sys.argv[1]), rank=int(sys.argv[2]), dump_dir=sys.argv[3], run_id="t", linger_s=0.5)
    dog.start()
    dog.beat("in a step")
    def stuck_in_a_step():
        time.sleep(float(sys.argv[4]))
    stuck_in_a_step()
    print("not reached")
""")


def test_the_watchdog_in_a_plain_process_and_its_alarm_to_a_peer(tmp_path):
    """Rank 0 stalls past its 1 s timeout; rank 1 (timeout 60 s) dumps at once on rank 0's alarm."""
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    dump = tmp_path / "stacks"
    peer = subprocess.Popen(
        [sys.executable, str(script), "60", "1", str(dump), "120"], env=_env(), stderr=subprocess.PIPE, text=True
    )
    first = subprocess.run(
        [sys.executable, str(script), "1", "0", str(dump), "120"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    _, peer_err = peer.communicate(timeout=60)
    assert first.returncode == WATCHDOG_EXIT_CODE and peer.returncode == WATCHDOG_EXIT_CODE
    assert "no progress for 1 s (timeout 1 s) while in a step" in first.stderr
    assert "in stuck_in_a_step" in first.stderr and "not reached" not in first.stdout
    assert "rank 0's watchdog fired; this rank is in a step" in peer_err and "in stuck_in_a_step" in peer_err
    assert {p.name for p in dump.iterdir()} == {"ALARM-t", "rank0.txt", "rank1.txt"}


class SlowRank(ml.GPTModule):
    """Rank 1 computes 40 ms longer in every step (a slow device)."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1:
            end = time.thread_time() + 0.04
            while time.thread_time() < end:
                pass
        return super().training_step(batch, batch_idx)


def test_the_straggler_report_names_the_slow_rank(tmp_path):
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_steps=4,
        callbacks=[StragglerReport(interval=2)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)
    data = ml.data.MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=256)
    trainer.fit(SlowRank(config), data)
    metrics = trainer.callback_metrics
    assert int(metrics["straggler/slowest_rank"]) == 1
    assert float(metrics["straggler/work_max_over_median"]) > 1.0
    assert float(metrics["straggler/work_ms_max"]) >= 40.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(timeout_s=0), "timeout_s=0"),
        (dict(first_step_timeout_s=float("nan")), "first_step_timeout_s=nan"),
        (dict(exit_code=0), "non-zero exit status"),
        (dict(linger_s=-1), "linger_s=-1"),
    ],
)
def test_bad_watchdog_settings_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HangWatchdog(**kwargs)
