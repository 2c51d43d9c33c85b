"""A 2-rank training script for the fault tests, run under torchrun (or the script launcher).

    python -m torch.distributed.run --nproc-per-node 2 fault_script.py signal OUT   # TP2, slow steps, ckpt in OUT/ckpt
    python -m torch.distributed.run --nproc-per-node 2 fault_script.py hang OUT T   # rank 1 stalls; watchdog T s
    python fault_script.py clean OUT                            # a short TP2 run (script launcher)

Every rank writes OUT/pid<rank> when training starts and OUT/rank<rank>.json when ``fit`` returns; rank 0
writes the number of steps done to OUT/progress after every step.
"""

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.callbacks import GracefulExit, HangWatchdog
from megatron_lite.data import MockGPTDataModule

# the same run as tests/distributed/parity_utils.run(tp=2, gbs=4, mbs=2) with this config, so that a forked
# run in the test process is its uninterrupted reference
CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=4,
    vocab_size=1000,
    seq_length=32,
    make_vocab_size_divisible_by=32,
)
OPTIMIZER = dict(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4)
STEPS = 12


class Progress(L.Callback):
    def __init__(self, out: Path, step_sleep_s: float = 0.0, hang_rank: int = -1, hang_step: int = -1):
        self.out, self.step_sleep_s = out, step_sleep_s
        self.hang_rank, self.hang_step = hang_rank, hang_step
        self.losses = []

    def on_train_start(self, trainer, pl_module):
        (self.out / f"pid{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.hang_rank and trainer.global_step == self.hang_step:
            time.sleep(3600)  # a rank stuck inside a step; its peer waits in the step's collectives

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        time.sleep(self.step_sleep_s)  # slow steps: time for the test to signal mid-run
        if trainer.global_rank == 0:
            tmp = self.out / "progress.tmp"
            tmp.write_text(str(trainer.global_step))
            tmp.replace(self.out / "progress")


def main() -> None:
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    callbacks: list = []
    strategy = dict(tensor_model_parallel_size=2)
    if mode == "signal":
        progress = Progress(out, step_sleep_s=0.5)
        callbacks += [progress, ModelCheckpoint(dirpath=out / "ckpt", save_top_k=0)]
    elif mode == "hang":
        progress = Progress(out, hang_rank=1, hang_step=2)
        callbacks += [progress, HangWatchdog(timeout_s=float(sys.argv[3]), dump_dir=str(out / "stacks"), linger_s=2.0)]
    else:
        progress = Progress(out)
        callbacks += [progress]
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(**strategy),
        accelerator="cpu",
        devices=2,
        max_steps=2 if mode == "clean" else STEPS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=mode == "signal",
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=1000, seed=7)
    trainer.fit(ml.GPTModule(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(**OPTIMIZER), seed=1234), data)
    stop = next((c for c in trainer.callbacks if isinstance(c, GracefulExit)), None)
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "global_step": trainer.global_step,
                "losses": progress.losses,
                "stop_reason": stop.stop_reason if stop else None,
                "checkpoint": stop.checkpoint_path if stop else None,
            }
        )
    )


if __name__ == "__main__":
    main()
