"""A run saving asynchronously (MegatronStrategy(async_save=True), ModelCheckpoint every step, top-1,
save_last) is killed with SIGKILL -- its whole process group, the forked ranks and their background
writer threads -- while a background write is under way (a shard written, no manifest yet), and at random
times (fault 3 of issue 13, asynchronous saves). After every kill each visible checkpoint passes its
checksums, the newest finished save is never older than before, and the next run with ckpt_path="last"
starts from exactly that checkpoint's step: the unfinished write is never loaded. A last run that is not killed
resumes, finishes its saves and leaves no leftovers."""

import multiprocessing
import os
import random
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from reliability_record import record
from test_checkpoint_kill import LEFTOVER, StartStep, _check_checkpoints, run_until_killed, tiny_config

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule


def _train(ckpt_dir: str, start_file: str, max_steps: int, ckpt_path) -> None:
    os.setpgid(0, 0)  # its own process group: the test kills the group, this process and its forked ranks
    torch.set_num_threads(1)
    config = tiny_config()
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", log_metrics=False, async_save=True),
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[
            ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_last=True),
            StartStep(Path(start_file)),
        ],
    )
    data = MockGPTDataModule(
        seq_length=config.seq_length, micro_batch_size=2, global_batch_size=8, vocab_size=config.vocab_size, seed=7
    )
    trainer.fit(ml.GPTModule(config, seed=1), data, ckpt_path=ckpt_path)


def test_sigkill_during_async_writes_keeps_the_previous_checkpoint(tmp_path):
    random.seed(1)
    ckpt_dir = tmp_path / "ckpts"
    start_file = tmp_path / "start_step"
    context = multiprocessing.get_context("fork")
    last_step, killed_mid_write, recover_s, killed_at = 0, 0, [], None
    modes = ["writing", "writing", "random", "writing"]
    for i, mode in enumerate(modes):
        killed = run_until_killed(_train, ckpt_dir, start_file, mode, resume=i > 0)
        if killed_at is not None:  # from the previous kill to this run training again
            recover_s.append(start_file.stat().st_mtime - killed_at)
        killed_at = killed
        unfinished = [p for p in ckpt_dir.iterdir() if LEFTOVER.match(p.name) and not (p / "manifest.json").exists()]
        killed_mid_write += bool(unfinished)
        # it started from the newest finished checkpoint as it was when it launched (never from step 0 after
        # the first run)
        assert int(start_file.read_text()) == last_step and (last_step > 0 or i == 0)
        step = _check_checkpoints(ckpt_dir)
        assert step >= last_step, f"the newest checkpoint went back from step {last_step} to {step} ({mode!r})"
        last_step = step
    assert killed_mid_write >= 3, "the kills did not land while a background write was unfinished"

    start_file.unlink(missing_ok=True)
    process = context.Process(target=_train, args=(str(ckpt_dir), str(start_file), last_step + 2, "last"))
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 0
    assert int(start_file.read_text()) == last_step > 0
    assert _check_checkpoints(ckpt_dir) == last_step + 2  # the end of fit waited for the last save
    assert not [p.name for p in ckpt_dir.iterdir() if LEFTOVER.match(p.name)]
    record(
        "3b-kill-mid-async-save",
        f"SIGKILL of a 2-rank run saving asynchronously every step, {len(modes)} times "
        f"({killed_mid_write} while a background write was unfinished)",
        "after every kill each visible checkpoint passed its checksums and ckpt_path='last' resumed the newest "
        "finished one; the unfinished background writes were never loaded",
        0,
        "none (the steps after the last finished save are trained again)",
        max(recover_s),
        kills=len(modes),
    )
