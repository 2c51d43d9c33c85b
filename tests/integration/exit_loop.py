"""Fault 8 (issue 13): many short 2-rank TP2 runs, each rank a process that exits the normal way
(interpreter finalisation, atexit handlers, the C++ destructors of the process groups) as under torchrun.

    python exit_loop.py RUNS OUT_DIR     # prints one JSON line: {"runs", "clean", "failures": [...]}

Starting 2 x RUNS interpreters that each import Lightning would take ~10 s a run, so this process imports
everything once and forks the two ranks of every run; each rank is then set up exactly as torchrun sets
up its workers (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, ... in the environment: Lightning's
TorchElasticEnvironment, no launcher of ours), trains 2 steps with the tensor-parallel layers, and
leaves through ``sys.exit(0)``: the exit path that aborted about 1 run in 5 ("terminate called without an
active exception"). A run is clean when both ranks exit 0, print no abort and no traceback, and no rank
process is left behind.
"""

import gc
import json
import os
import socket
import sys
import time
from pathlib import Path

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule

ABORT_MARKERS = ("terminate called", "Traceback", "core dumped", "Aborted")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, log: Path) -> None:
    """A rank of one run, in a forked child; never returns."""
    fd = os.open(str(log), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID="exit-loop",
    )
    try:
        torch.set_num_threads(1)
        trainer = L.Trainer(
            strategy=ml.MegatronStrategy(tensor_model_parallel_size=2),
            accelerator="cpu",
            devices=2,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
        )
        config = ml.GPTConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            vocab_size=128,
            seq_length=16,
            make_vocab_size_divisible_by=64,
        )
        trainer.fit(
            ml.GPTModule(config, ml.OptimizerConfig(lr=1e-3)),
            MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=128),
        )
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    raise SystemExit(0)  # through interpreter finalisation, like a script that ends after fit


def main() -> None:
    runs, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    gc.freeze()  # before the forks, as the fork launcher does (strategies/_lightning_private.py)
    failures = []
    start = time.monotonic()
    for run in range(runs):
        port = _free_port()
        pids = {}
        for rank in range(2):
            log = out / f"run{run}-rank{rank}.log"
            pid = os.fork()
            if pid == 0:
                _rank(rank, port, log)
            pids[rank] = (pid, log)
        for rank, (pid, log) in pids.items():
            deadline = time.monotonic() + 120
            status = None
            while status is None and time.monotonic() < deadline:
                done, raw = os.waitpid(pid, os.WNOHANG)
                status = raw if done else None
                time.sleep(0.01) if status is None else None
            if status is None:  # a rank that does not exit is a failure too: never leave it behind
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                failures.append({"run": run, "rank": rank, "problem": "did not exit within 120 s"})
                continue
            text = log.read_text(errors="replace")
            code = os.waitstatus_to_exitcode(status)
            marks = [m for m in ABORT_MARKERS if m in text]
            if code != 0 or marks:
                failures.append(
                    {"run": run, "rank": rank, "exit_code": code, "markers": marks, "log_tail": text[-600:]}
                )
            else:
                log.unlink()
    print(
        json.dumps(
            {
                "runs": runs,
                "clean": runs - len({f["run"] for f in failures}),
                "failures": failures,
                "seconds": round(time.monotonic() - start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
