"""Which checkpoint ``ckpt_path="last"`` resumes, on real checkpoint directories (one process): the newest
finished one that passes its checksums; damaged and unfinished ones are skipped with their file and
reason; a replace interrupted between its renames is put back first; "last" becomes the run directory
when it holds a finished checkpoint and None (start from the beginning) when it holds none. And the one
private Lightning API this uses (ModelCheckpoint's directory without a dirpath) against Lightning itself."""

import logging
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta, save_sharded
from megatron_lite.core.checkpoint.resume.auto_resume import (
    finished_checkpoints,
    has_finished_checkpoint,
    newest_valid_checkpoint,
    unfinished_checkpoints,
)
from megatron_lite.strategies._lightning_private import checkpoint_callback_dir
from megatron_lite.strategies.auto_resume import replace_last


def _save(directory, name: str, step: int):
    state = {"model": {"weight": torch.full((16, 8), float(step))}}
    return save_sharded(state, directory / name, extra={"global_step": step}, latest=True)  # as a run saves


def _flip_byte(path, name: str = "__0_0.distcp") -> None:
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0x40
    (path / name).write_bytes(bytes(data))


def _step(path) -> int:
    return read_checkpoint_meta(path)["global_step"]


def test_the_newest_valid_checkpoint_is_chosen_and_the_damaged_ones_are_named(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, f"epoch=0-step={step}.ckpt", step)
    last = _save(tmp_path, "last.ckpt", 6)
    assert [p.name for p in finished_checkpoints([tmp_path])] == [
        "last.ckpt",
        "epoch=0-step=6.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=0-step=2.ckpt",
    ]
    _flip_byte(last)  # a bit flipped on storage: still "finished" (sizes), caught by its checksum
    six = tmp_path / "epoch=0-step=6.ckpt"
    (six / "__0_0.distcp").write_bytes((six / "__0_0.distcp").read_bytes()[:100])  # cut short: not finished

    choice = newest_valid_checkpoint([tmp_path])
    assert choice.checkpoint == tmp_path / "epoch=0-step=4.ckpt" and choice.verified
    assert _step(choice.checkpoint) == 4
    reasons = {os.path.basename(s.path): s.reason for s in choice.skipped}
    assert set(reasons) == {"last.ckpt", "epoch=0-step=6.ckpt"}
    assert "__0_0.distcp: checksum mismatch" in reasons["last.ckpt"]
    assert "__0_0.distcp" in reasons["epoch=0-step=6.ckpt"] and "bytes on disk" in reasons["epoch=0-step=6.ckpt"]
    # nothing was removed or changed: a damaged checkpoint stays for a person to look at
    assert (tmp_path / "last.ckpt").is_dir() and six.is_dir()


def test_a_killed_save_is_named_and_never_chosen(tmp_path):
    _save(tmp_path, "epoch=0-step=2.ckpt", 2)
    killed = _save(tmp_path, "epoch=0-step=4.ckpt", 4)
    # what a kill during the DCP write leaves: the hidden temporary with a shard and no manifest
    leftover = tmp_path / ".epoch=0-step=4.ckpt.tmp-0123abcd"
    killed.rename(leftover)
    (leftover / "manifest.json").unlink()
    assert [s.path for s in unfinished_checkpoints([tmp_path])] == [str(leftover)]
    choice = newest_valid_checkpoint([tmp_path])
    assert choice.checkpoint == tmp_path / "epoch=0-step=2.ckpt"
    assert len(choice.skipped) == 1 and "killed before it was committed" in choice.skipped[0].reason
    assert not leftover.exists()  # removed by the clean-up before the choice


def test_an_interrupted_replace_counts_and_is_put_back(tmp_path):
    # a file system without an atomic exchange, killed between the two renames: no last.ckpt, its old copy hidden
    _save(tmp_path, "last.ckpt", 3).rename(tmp_path / ".last.ckpt.old-0123abcd")
    assert finished_checkpoints([tmp_path]) == []
    assert has_finished_checkpoint([tmp_path])
    choice = newest_valid_checkpoint([tmp_path])
    assert choice.checkpoint == tmp_path / "last.ckpt" and _step(choice.checkpoint) == 3


def test_links_and_unrelated_directories_are_not_candidates(tmp_path):
    target = _save(tmp_path, "epoch=0-step=5.ckpt", 5)
    os.symlink(target, tmp_path / "last.ckpt")  # ModelCheckpoint(save_last="link")
    (tmp_path / "notes").mkdir()
    assert finished_checkpoints([tmp_path]) == [target]
    assert unfinished_checkpoints([tmp_path]) == []


def test_when_every_checkpoint_is_damaged_there_is_no_choice(tmp_path):
    _flip_byte(_save(tmp_path, "last.ckpt", 2))
    choice = newest_valid_checkpoint([tmp_path])
    assert choice.checkpoint is None and [os.path.basename(s.path) for s in choice.skipped] == ["last.ckpt"]


MODULE, DATA = object(), object()


def _fit_args(ckpt_path):
    # the positional arguments of Lightning's _fit_impl: model, train/val dataloaders, datamodule, ckpt_path,
    # weights_only
    return (MODULE, None, None, DATA, ckpt_path, None)


def test_last_becomes_the_run_directory_or_none(tmp_path, caplog):
    run_dir = tmp_path / "ckpts"
    trainer = L.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=run_dir)], enable_progress_bar=False)
    args, resume = replace_last(_fit_args("last"), trainer, fitting=True)
    assert args == _fit_args(None) and resume is None  # nothing there yet: from the beginning

    leftover = run_dir / ".last.ckpt.tmp-0123abcd"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="megatron_lite"):
        args, resume = replace_last(_fit_args("last"), trainer, fitting=True)
    assert args == _fit_args(None) and resume is None
    assert "no finished checkpoint" in caplog.text and f"{leftover}: a save of last.ckpt that was killed" in caplog.text

    _save(run_dir, "epoch=0-step=2.ckpt", 2)  # not named last*: Lightning's own "last" would not see it
    args, resume = replace_last(_fit_args("last"), trainer, fitting=True)
    assert args == _fit_args(str(run_dir)) and resume.requested == str(run_dir)
    assert resume.directories == (str(run_dir),)
    assert replace_last(_fit_args("some/path"), trainer, fitting=True) == (_fit_args("some/path"), None)
    bare = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert replace_last(_fit_args("last"), bare, fitting=True) == (_fit_args("last"), None)


@pytest.mark.parametrize("with_logger", [False, True])
def test_the_directory_of_a_model_checkpoint_without_dirpath_is_lightnings(tmp_path, with_logger):
    logger = CSVLogger(tmp_path / "logs", name="run") if with_logger else False
    trainer = L.Trainer(logger=logger, default_root_dir=tmp_path, enable_progress_bar=False)
    callback = trainer.checkpoint_callback
    assert callback.dirpath is None
    ours = checkpoint_callback_dir(callback, trainer)
    callback.setup(trainer, None, stage="fit")  # where Lightning decides it saves
    assert ours == str(callback.dirpath)
    assert checkpoint_callback_dir(callback, trainer) == str(callback.dirpath)
