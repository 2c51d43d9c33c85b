"""A TP2 x DP2 training run (4 ranks) under ``torchrun --max-restarts 3`` that SIGKILLs one of its ranks in
each of its first attempts, each time at another point, for fault 1 of issue 13::

    KILLS=mid-step:1:5,mid-save:0:6,after-save:3:6 \\
        python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 3 restart_script.py OUT

(the test runs it as ``python preloaded_torchrun.py ... /abs/path/restart_script.py OUT``: the same torchrun, its
workers forked from the agent with Lightning imported)

KILLS holds one ``point:rank:step`` per attempt: attempt k (torchrun's TORCHELASTIC_RESTART_COUNT) kills
global rank ``rank`` at ``point`` after ``step`` steps; the attempts past the list train to the end.

- ``mid-step``: rank ``rank`` dies in the forward of the second microbatch of step ``step`` + 1 (after the
  first microbatch's forward and backward), while its peers wait in that step's collectives;
- ``mid-save``: rank ``rank`` dies during the first top-1 save after step ``step``, once a shard of it is
  written and before it is committed (a thread of that rank watches the checkpoint directory while the rank
  is inside the save);
- ``after-save``: rank ``rank`` dies at the start of step ``step`` + 1, right after step ``step``'s
  checkpoints were committed.

What the test reads, per attempt k: OUT/armed<k>.json (written when the kill is armed), OUT/killed<k>.txt
(where the rank died), OUT/start<k>.txt (rank 0: the step training starts from) and OUT/losses<k>.json
(rank 0: the loss of every step it finished); the rank 0 that finishes writes OUT/result.pt
(parity_utils.Recorder: the losses of its steps, the final full parameters). The run is
parity_utils.run(devices=4, tp=2, steps=STEPS) plus a ModelCheckpoint every 2 steps (top-1 and last.ckpt),
resumed with ckpt_path="last": the test's uninterrupted reference.
"""

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "distributed"))
from parity_utils import Recorder, tiny_config  # noqa: E402

import megatron_lite as ml  # noqa: E402
from megatron_lite.data import MockGPTDataModule  # noqa: E402

STEPS, SAVE_EVERY, GBS, MBS = 8, 2, 8, 2
_TOP1_SAVE = re.compile(r"^\.epoch=\d+-step=(?P<step>\d+)\.ckpt\.tmp-[0-9a-f]{8}$")


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _die(out: Path, what: str) -> None:
    (out / f"killed{_attempt()}.txt").write_text(what)  # evidence for the test (armed<k>.json came before)
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
    """SIGKILLs global rank ``rank`` at ``point`` after ``step`` steps, once (point None: kills nothing).
    Rank 0 also writes where the attempt started and the loss of every step it finished."""

    def __init__(self, out: Path, point: Optional[str], rank: int, step: int):
        self.out, self.point, self.rank, self.step = out, point, rank, step
        self.ckpt = out / "ckpt"
        self.armed = False
        self.losses: dict[int, float] = {}

    def _arm(self, trainer) -> bool:
        if self.armed or trainer.global_rank != self.rank or trainer.global_step != self.step:
            return False
        self.armed = True
        (self.out / f"armed{_attempt()}.json").write_text(
            json.dumps(
                {"point": self.point, "rank": self.rank, "step": self.step, "armed_at": time.time(), "pid": os.getpid()}
            )
        )
        return True

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            (self.out / f"start{_attempt()}.txt").write_text(f"{trainer.global_step} {time.time()!r}")

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
        if trainer.global_rank == 0:  # before the save of this step (and a kill in it)
            self.losses[trainer.global_step] = float(outputs["loss"])
            (self.out / f"losses{_attempt()}.json").write_text(json.dumps(self.losses))
        # before ModelCheckpoint's on_train_batch_end (Lightning runs checkpoint callbacks last), which saves
        if self.point == "mid-save" and self._arm(trainer):
            threading.Thread(target=_watch_saves, args=(self.out, self.ckpt), daemon=True).start()


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    kills = [spec.split(":") for spec in os.environ["KILLS"].split(",")]
    point, rank, step = kills[_attempt()] if _attempt() < len(kills) else (None, "-1", "-1")
    kill = KillOnce(out, point, int(rank), int(step))
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=2),
        accelerator="cpu",
        devices=4,
        max_steps=STEPS,
        callbacks=[
            Recorder(out),
            kill,
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=SAVE_EVERY, save_last=True),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = MockGPTDataModule(
        seq_length=config.seq_length, micro_batch_size=MBS, global_batch_size=GBS, vocab_size=config.vocab_size, seed=7
    )
    optimizer = ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4)
    trainer.fit(ml.GPTModule(config, optimizer=optimizer, seed=1234), data, ckpt_path="last")


if __name__ == "__main__":
    main()
