"""A TP2 x DP2 training run (4 ranks) under ``torchrun --max-restarts 1`` that SIGKILLs one of its ranks once,
at a chosen point, for fault 1 of issue 13::

    KILL_POINT=mid-step KILL_RANK=1 KILL_STEP=5 \\
        python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 1 restart_script.py OUT

- ``mid-step``: rank KILL_RANK dies in the forward of the second microbatch of step KILL_STEP + 1 (after the
  first microbatch's forward and backward), while its peers wait in that step's collectives;
- ``mid-save``: rank KILL_RANK dies during the first top-1 save after step KILL_STEP, once a shard of it is
  written and before it is committed (a thread of that rank watches the checkpoint directory while the rank
  is inside the save);
- ``after-save``: rank KILL_RANK dies at the start of step KILL_STEP + 1, right after step KILL_STEP's
  checkpoints were committed.

OUT/armed.json is the marker: written before the kill is armed, it tells the restarted ranks not to kill
again. Every incarnation's rank 0 writes OUT/start<restart>.txt (the step training starts from) and the rank
0 that finishes writes OUT/result.pt (parity_utils.Recorder: the losses of its steps, the final full
parameters). The run is parity_utils.run(devices=4, tp=2, steps=STEPS) plus a ModelCheckpoint every 2 steps
(top-1 and last.ckpt), resumed with ckpt_path="last": the test's uninterrupted reference.
"""
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "distributed"))
import megatron_lite as ml  # noqa: E402
from megatron_lite.data import MockGPTDataModule  # noqa: E402
from parity_utils import Recorder, tiny_config  # noqa: E402

STEPS, SAVE_EVERY, GBS, MBS = 8, 2, 8, 2
_TOP1_SAVE = re.compile(r"^\.epoch=\d+-step=(?P<step>\d+)\.ckpt\.tmp-[0-9a-f]{8}$")


def _die(out: Path, what: str) -> None:
    (out / "killed.txt").write_text(what)  # evidence for the test (the marker was written before arming)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_saves(out: Path, ckpt: Path) -> None:
    """Kill this process once a top-1 save is under way: its hidden temporary holds a shard and no manifest.
    This rank is then inside the save (every rank takes part until the commit), so nothing is committed."""
    while True:
        for entry in os.scandir(ckpt) if ckpt.is_dir() else ():
            match = _TOP1_SAVE.match(entry.name)
            if match is None:
                continue
            try:
                files = os.listdir(entry.path)
            except FileNotFoundError:
                continue  # committed (renamed) meanwhile
            if "manifest.json" not in files and any(f.endswith(".distcp") for f in files):
                _die(out, f"mid-save {entry.name} {sorted(files)}")
        time.sleep(0.0005)


class KillOnce(L.Callback):
    """SIGKILLs global rank ``rank`` at ``point`` after ``step`` steps, unless the marker says it was armed before."""

    def __init__(self, out: Path, point: str, rank: int, step: int):
        self.out, self.point, self.rank, self.step = out, point, rank, step
        self.ckpt = out / "ckpt"

    def _arm(self, trainer) -> bool:
        if trainer.global_rank != self.rank or trainer.global_step != self.step or (self.out / "armed.json").exists():
            return False
        (self.out / "armed.json").write_text(json.dumps({"point": self.point, "rank": self.rank, "step": self.step,
                                                         "armed_at": time.time(), "pid": os.getpid()}))
        return True

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            (self.out / f"start{restart}.txt").write_text(f"{trainer.global_step} {time.time()!r}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.point == "after-save" and self._arm(trainer):
            _die(self.out, f"after-save at the start of step {trainer.global_step + 1}")
        if self.point == "mid-step" and self._arm(trainer):
            calls = [0]

            def second_microbatch(module, args, output):
                calls[0] += 1
                if calls[0] == 2:
                    _die(self.out, f"mid-step in step {trainer.global_step + 1}, microbatch 2's forward")
            pl_module.model.register_forward_hook(second_microbatch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # before ModelCheckpoint's on_train_batch_end (Lightning runs checkpoint callbacks last), which saves
        if self.point == "mid-save" and self._arm(trainer):
            threading.Thread(target=_watch_saves, args=(self.out, self.ckpt), daemon=True).start()


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    kill = KillOnce(out, os.environ["KILL_POINT"], int(os.environ["KILL_RANK"]), int(os.environ["KILL_STEP"]))
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=2), accelerator="cpu", devices=4, max_steps=STEPS,
        callbacks=[Recorder(out), kill,
                   ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=SAVE_EVERY, save_last=True)],
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    data = MockGPTDataModule(seq_length=config.seq_length, micro_batch_size=MBS, global_batch_size=GBS,
                             vocab_size=config.vocab_size, seed=7)
    optimizer = ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4)
    trainer.fit(ml.GPTModule(config, optimizer=optimizer, seed=1234), data, ckpt_path="last")


if __name__ == "__main__":
    main()
