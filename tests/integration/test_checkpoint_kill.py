"""A training run that checkpoints every step (ModelCheckpoint: a checkpoint per step, top-1 removal,
save_last=True replacing last.ckpt) is killed with SIGKILL -- its whole process group, the two forked
ranks included -- at random points: while DCP writes, when a finished save is about to replace last.ckpt,
right after it did (while the old one is removed), while the previous top-1 checkpoint is removed, and at
random times (fault 3 of issue 13). After every kill each visible checkpoint passes its checksums, the newest
finished save is never older than before, and the next run with ckpt_path="last" resumes from exactly it
(step > 0): nothing partial is loaded. Leftovers of the killed saves are gone once the next run has saved."""

import multiprocessing
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.core.checkpoint.format.integrity import verify_checkpoint
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta
from megatron_lite.core.checkpoint.resume.auto_resume import finished_checkpoints
from megatron_lite.data import MockGPTDataModule

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from parity_utils import run, tiny_config  # noqa: E402
from reliability_record import record  # noqa: E402

LEFTOVER = re.compile(r"^\..+\.(tmp|old|del)-[0-9a-f]{8}$")


class StartStep(L.Callback):
    """Writes the step training starts from (after a resume: the checkpoint's)."""

    def __init__(self, out: Path):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(str(trainer.global_step))


def _train(ckpt_dir: str, start_file: str, max_steps: int, ckpt_path) -> None:
    os.setpgid(0, 0)  # its own process group: the test kills the group, this process and its forked ranks
    torch.set_num_threads(1)
    config = tiny_config()
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", log_metrics=False),
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


def _entries(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []


def _files(directory: Path) -> set[str]:
    try:
        return set(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _kill_point(mode: str, ckpt_dir: Path, start_file: Path):
    """A function that is true when the run should be killed now: once it trains (start_file) and has
    saved last.ckpt, at a point of a save that is new (not a leftover of the previous kill)."""
    before = {p.name for p in _entries(ckpt_dir)}

    def saving(pattern: str, has_manifest: bool | None = None):
        for p in _entries(ckpt_dir):
            if p.name in before or not re.match(pattern, p.name):
                continue
            files = _files(p)
            if has_manifest is None or (
                ("manifest.json" in files) == has_manifest and any(n.endswith(".distcp") for n in files)
            ):
                return True
        return False

    def ready():
        return start_file.exists() and (ckpt_dir / "last.ckpt").is_dir()

    if mode == "random":
        at = [None]

        def due():
            if at[0] is None and ready():
                at[0] = time.monotonic() + random.uniform(0.0, 0.5)
            return at[0] is not None and time.monotonic() >= at[0]

        return due
    if mode == "committing":  # a finished save of last.ckpt: exchanged with the old one, which is then removed
        return lambda: ready() and saving(r"^\.last\.ckpt\.tmp-", has_manifest=True)
    if mode == "replaced":  # right after a new last.ckpt took the old one's place (the old one is being removed)
        inode = [None]

        def swapped():
            if not ready():
                return False
            current = os.stat(ckpt_dir / "last.ckpt").st_ino
            inode[0] = inode[0] or current
            return current != inode[0]

        return swapped
    if mode == "writing":  # DCP has written a shard, the manifest is not there yet
        return lambda: ready() and saving(r"^\..*\.tmp-", has_manifest=False)
    if mode == "removing":  # ModelCheckpoint removing the previous top-1 checkpoint
        return lambda: ready() and saving(r"^\..*\.del-")
    raise ValueError(mode)


def _check_checkpoints(ckpt_dir: Path) -> int:
    """Every visible checkpoint is intact; returns the step of the newest finished one (what ckpt_path="last"
    resumes: last.ckpt, or a newer top-1 checkpoint when the kill came before last.ckpt's save of that step)."""
    visible = [p for p in ckpt_dir.iterdir() if p.name.endswith(".ckpt")]
    assert any(p.name == "last.ckpt" for p in visible), sorted(p.name for p in ckpt_dir.iterdir())
    for path in visible:
        assert verify_checkpoint(path).status == "ok", path
    return read_checkpoint_meta(finished_checkpoints([ckpt_dir])[0])["global_step"]


def run_until_killed(train, ckpt_dir: Path, start_file: Path, mode: str, resume: bool) -> float:
    """Start ``train`` in a forked process (from ``ckpt_path="last"`` if ``resume``), SIGKILL its process
    group at the kill point ``mode`` and return the time of the kill."""
    start_file.unlink(missing_ok=True)
    process = multiprocessing.get_context("fork").Process(
        target=train, args=(str(ckpt_dir), str(start_file), 10_000, "last" if resume else None)
    )
    process.start()
    kill_now = _kill_point(mode, ckpt_dir, start_file)
    deadline = time.monotonic() + 60
    while not kill_now():
        assert process.is_alive(), f"the run ended before the kill point {mode!r} (exit code {process.exitcode})"
        assert time.monotonic() < deadline, f"kill point {mode!r} not reached in 60 s"
    os.killpg(process.pid, signal.SIGKILL)
    killed_at = time.time()
    process.join()
    return killed_at


def test_sigkill_during_saves_leaves_a_checkpoint_that_resumes(tmp_path):
    random.seed(0)
    ckpt_dir = tmp_path / "ckpts"
    start_file = tmp_path / "start_step"
    last_step, leftovers_seen, recover_s, killed_at = 0, set(), [], None
    modes = ["writing", "committing", "replaced", "random", "removing", "replaced", "committing", "random"]
    for i, mode in enumerate(modes):
        killed = run_until_killed(_train, ckpt_dir, start_file, mode, resume=i > 0)
        if killed_at is not None:  # from the previous kill to this run training again
            recover_s.append(start_file.stat().st_mtime - killed_at)
        killed_at = killed
        # it started from the newest finished checkpoint as it was when it launched (never from step 0 after
        # the first run)
        assert int(start_file.read_text()) == last_step and (last_step > 0 or i == 0)
        step = _check_checkpoints(ckpt_dir)
        assert step >= last_step, f"the newest checkpoint went back from step {last_step} to {step} ({mode!r})"
        last_step = step
        leftovers_seen |= {p.name for p in ckpt_dir.iterdir() if LEFTOVER.match(p.name)}

    assert leftovers_seen, "no kill left a temporary behind: the kill points were not reached"

    # a run that is not killed resumes from last.ckpt and its saves clean up what the killed ones left
    start_file.unlink(missing_ok=True)
    process = multiprocessing.get_context("fork").Process(
        target=_train, args=(str(ckpt_dir), str(start_file), last_step + 2, "last")
    )
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 0
    assert int(start_file.read_text()) == last_step > 0
    assert _check_checkpoints(ckpt_dir) == last_step + 2
    assert not [p.name for p in ckpt_dir.iterdir() if LEFTOVER.match(p.name)]
    record(
        "3-kill-mid-save",
        f"SIGKILL of a 2-rank run (all processes) saving every step, {len(modes)} times: while "
        f"DCP writes, while a finished save replaces last.ckpt, right after, while the old "
        f"top-1 is removed, at random",
        f"after every kill each visible checkpoint passed its checksums and ckpt_path='last' resumed the newest "
        f"finished one (unfinished saves skipped: {len(leftovers_seen)} leftovers seen, never loaded, removed "
        f"by the next save)",
        0,
        "none (the step in flight is trained again)",
        max(recover_s),
        kills=len(modes),
    )


def test_last_is_recovered_before_the_ranks_look_for_it(tmp_path):
    """On a file system without an atomic exchange, a kill between the two renames of a replace leaves no
    last.ckpt, only .last.ckpt.old-* (the previous one): the launching process puts it back before any rank
    resolves ckpt_path="last", so the run resumes from it instead of starting again at step 0."""
    ckpt_dir = tmp_path / "ckpts"
    run(
        tmp_path / "first",
        devices=2,
        steps=3,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_last=True)],
    )
    (ckpt_dir / "last.ckpt").rename(ckpt_dir / ".last.ckpt.old-0123abcd")
    resumed = run(
        tmp_path / "resumed",
        devices=2,
        steps=5,
        ckpt_path="last",
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_last=True)],
    )
    assert resumed["global_step"] == 5 and len(resumed["losses"]) == 2  # steps 4 and 5 only
    assert read_checkpoint_meta(ckpt_dir / "last.ckpt")["global_step"] == 5
    assert not [p.name for p in ckpt_dir.iterdir() if LEFTOVER.match(p.name)]
