"""Checkpoints on disk: per-file checksums of the bytes written, checked before anything is loaded (a flipped
byte, a truncated or missing shard is named, and nothing is loaded); an existing checkpoint is replaced
atomically; a replace interrupted between its two renames is recovered; leftovers of killed saves are
removed at the next save; latest_checkpoint.json names the newest save; files a checkpoint carries (its
tokenizer) are in its manifest. Real files, one process."""

import json
import logging
import os
import zlib

import pytest
import torch

from megatron_lite.core.checkpoint.errors import CorruptCheckpointError
from megatron_lite.core.checkpoint.format.commit import LATEST, commit, remove_checkpoint, sibling
from megatron_lite.core.checkpoint.format.integrity import is_complete, read_manifest, record_file, verify_checkpoint
from megatron_lite.core.checkpoint.format.sharded import (
    EMBEDDED_FILES,
    load_sharded,
    read_checkpoint_meta,
    save_sharded,
)


def _state(value: float) -> dict:
    return {
        "model": {"embedding.weight": torch.full((64, 32), value), "norm.weight": torch.full((32,), -value)},
        "step": torch.tensor(7),
    }


def _zeros() -> dict:
    return {"model": {"embedding.weight": torch.zeros(64, 32), "norm.weight": torch.zeros(32)}, "step": torch.tensor(0)}


def _hidden(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_the_manifest_records_every_file_as_written(tmp_path):
    path = save_sharded(_state(1.5), tmp_path / "ckpt", extra={"global_step": 7}, latest=True)
    manifest = read_manifest(path)
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest.files) == on_disk == {".metadata", "__0_0.distcp", "meta.json"}
    for name, record in manifest.files.items():
        assert record_file(path / name) == record, name
    assert verify_checkpoint(path).status == "ok"
    assert json.loads((tmp_path / LATEST).read_text())["name"] == "ckpt"
    assert _hidden(tmp_path) == []


def test_files_a_checkpoint_carries_are_checksummed_with_it(tmp_path):
    source = tmp_path / "cache" / "sp.model"
    source.parent.mkdir()
    source.write_bytes(os.urandom(3000))
    files = {EMBEDDED_FILES: {"tokenizer/tokenizer.model": str(source)}}
    path = save_sharded(_state(1.5), tmp_path / "ckpt", extra={"global_step": 7, **files})
    assert (path / "tokenizer" / "tokenizer.model").read_bytes() == source.read_bytes()
    assert read_manifest(path).files["tokenizer/tokenizer.model"] == record_file(source)
    assert EMBEDDED_FILES not in read_checkpoint_meta(path)  # copied, not recorded
    assert verify_checkpoint(path).files == 4
    copy = path / "tokenizer" / "tokenizer.model"
    copy.write_bytes(b"x" + copy.read_bytes()[1:])
    with pytest.raises(CorruptCheckpointError, match=r"tokenizer/tokenizer.model: checksum mismatch"):
        verify_checkpoint(path)
    # refused before a byte is written: a source that is not there, a path outside a folder of its own
    for bad, error in (
        (
            {"tokenizer/tokenizer.model": str(tmp_path / "gone.model")},
            "gone.model, a file the checkpoint .* is to carry",
        ),
        ({"../escape.model": str(source)}, "not a '<folder>/<file>' path"),
        ({"tokenizer.model": str(source)}, "not a '<folder>/<file>' path"),
    ):
        with pytest.raises((FileNotFoundError, ValueError), match=error):
            save_sharded(_state(1.0), tmp_path / "bad", extra={EMBEDDED_FILES: bad})
        assert not (tmp_path / "bad").exists() and _hidden(tmp_path) == []


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip", r"__0_0.distcp: checksum mismatch"),
        ("truncate", r"__0_0.distcp: \d+ bytes on disk, \d+ were written"),
        ("delete", r"__0_0.distcp: missing"),
        ("flip_metadata", r"\.metadata: checksum mismatch"),
        ("flip_meta", r"meta.json: checksum mismatch"),
    ],
)
def test_damage_is_named_and_nothing_is_loaded(tmp_path, damage, message):
    path = save_sharded(_state(1.5), tmp_path / "ckpt", extra={"global_step": 7})
    name = {"flip_metadata": ".metadata", "flip_meta": "meta.json"}.get(damage, "__0_0.distcp")
    target = path / name
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        target.unlink()
    else:
        # the byte in the middle of the embedding's data: a flip there once loaded silently as 4e36
        data[len(data) // 2] ^= 0x40
        target.write_bytes(data)
    state = _zeros()
    with pytest.raises(CorruptCheckpointError, match=message) as error:
        load_sharded(state, path)
    assert str(path) in str(error.value) and "nothing was loaded" in str(error.value)
    assert all(not t.any() for t in (*state["model"].values(), state["step"]))


def test_a_checkpoint_without_its_manifest_is_incomplete(tmp_path):
    path = save_sharded(_state(1.5), tmp_path / "ckpt")
    (path / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"has no manifest.json: the save did not finish"):
        load_sharded(_zeros(), path)
    (path / "manifest.json").write_text(
        '{"format": "megatron-lite-manifest/1", "checksum": "crc32", "files": {"../x": {}}}'
    )
    with pytest.raises(CorruptCheckpointError, match=r"manifest.json is damaged.*'../x' is not a file inside"):
        load_sharded(_zeros(), path)
    (path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # past the JSON parser's recursion limit
    with pytest.raises(CorruptCheckpointError, match=r"manifest.json is damaged \(maximum recursion depth"):
        load_sharded(_zeros(), path)
    assert not is_complete(path)


def test_what_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "file.ckpt").write_bytes(b"not a directory")
    (tmp_path / "empty").mkdir()
    for path, message in [
        (tmp_path / "missing.ckpt", r"no checkpoint at .*missing.ckpt\.$"),
        (tmp_path / "file.ckpt", r"file.ckpt is a file, not a megatron-lite checkpoint"),
        (tmp_path / "empty", r"empty is a directory without DCP .metadata, not a megatron-lite"),
    ]:
        with pytest.raises(FileNotFoundError, match=message):
            load_sharded(_zeros(), path)


@pytest.mark.parametrize("use_exchange", [True, False])
def test_replacing_a_checkpoint(tmp_path, use_exchange):
    first = save_sharded(_state(1.0), tmp_path / "last.ckpt", extra={"global_step": 1})
    second = save_sharded(_state(2.0), tmp_path / "pending", extra={"global_step": 2})
    tmp = sibling(first, "tmp")
    second.rename(tmp)
    commit(tmp, first, use_exchange=use_exchange)
    state = _zeros()
    assert load_sharded(state, first)["global_step"] == 2
    assert torch.equal(state["model"]["norm.weight"], torch.full((32,), -2.0))
    assert _hidden(tmp_path) == []
    # and through save_sharded, which exchanges when the file system can
    save_sharded(_state(3.0), first, extra={"global_step": 3})
    assert load_sharded(_zeros(), first)["global_step"] == 3 and _hidden(tmp_path) == []


def test_a_replace_interrupted_between_its_renames_is_recovered(tmp_path, caplog):
    """Without an atomic exchange, a kill between "last.ckpt -> .last.ckpt.old-*" and ".tmp-* -> last.ckpt"
    leaves no last.ckpt: the newest complete sibling is put back (here the new one; then the old one)."""
    last = tmp_path / "last.ckpt"
    save_sharded(_state(1.0), last, extra={"global_step": 1})
    save_sharded(_state(2.0), tmp_path / "new", extra={"global_step": 2})
    old = tmp_path / ".last.ckpt.old-0123abcd"
    last.rename(old)
    (tmp_path / "new").rename(tmp_path / ".last.ckpt.tmp-4567cdef")
    with caplog.at_level(logging.WARNING):
        assert load_sharded(_zeros(), last)["global_step"] == 2
    assert "recovered the complete checkpoint left at .last.ckpt.tmp-4567cdef" in caplog.text
    last.rename(tmp_path / ".last.ckpt.del-89abcdef")  # a removal killed half way: never a candidate
    (tmp_path / ".last.ckpt.del-89abcdef" / "manifest.json").unlink()
    assert load_sharded(_zeros(), last)["global_step"] == 1 and not old.exists()


def test_an_unfinished_save_is_not_loaded(tmp_path):
    save_sharded(_state(1.0), tmp_path / "done", extra={"global_step": 1})
    (tmp_path / "done").rename(tmp_path / ".last.ckpt.tmp-0123abcd")
    (tmp_path / ".last.ckpt.tmp-0123abcd" / "manifest.json").unlink()  # killed before the manifest
    with pytest.raises(
        FileNotFoundError,
        match=r"no checkpoint at .*last.ckpt. Only the unfinished save\(s\) "
        r"\.last\.ckpt\.tmp-0123abcd are there",
    ):
        load_sharded(_zeros(), tmp_path / "last.ckpt")


def test_leftovers_of_killed_saves_are_removed_at_the_next_save(tmp_path):
    save_sharded(_state(1.0), tmp_path / "last.ckpt")
    killed = tmp_path / ".epoch=0-step=3.ckpt.tmp-0badc0de"  # killed while DCP wrote: no manifest
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(os.urandom(1000))
    (killed / ".metadata.tmp").write_bytes(b"")
    (killed / "tokenizer").mkdir()  # a file the checkpoint carries, copied when the save began
    (killed / "tokenizer" / "tokenizer.model").write_bytes(b"sp")
    empty = tmp_path / ".x.ckpt.tmp-00c0ffee"  # killed right after creating it
    empty.mkdir()
    superseded = tmp_path / ".last.ckpt.old-11111111"  # killed before removing the replaced one
    save_sharded(_state(0.5), tmp_path / "elsewhere").rename(superseded)
    half_removed = tmp_path / ".a.ckpt.del-22222222"
    half_removed.mkdir()
    (half_removed / "__1_0.distcp").write_bytes(b"x")
    not_ours = tmp_path / ".notes.tmp-33333333"  # our name pattern, but a user's files: kept
    not_ours.mkdir()
    (not_ours / "notes.txt").write_text("mine")
    link_target = save_sharded(_state(4.0), tmp_path / "epoch=0-step=4.ckpt")
    (tmp_path / "link.ckpt").symlink_to(link_target.name)

    save_sharded(_state(2.0), tmp_path / "last.ckpt")
    assert _hidden(tmp_path) == [".notes.tmp-33333333"]
    remove_checkpoint(tmp_path / "link.ckpt")  # a symbolic link goes, what it points to stays
    assert not os.path.lexists(tmp_path / "link.ckpt") and verify_checkpoint(link_target).status == "ok"
    remove_checkpoint(link_target)
    assert not link_target.exists() and _hidden(tmp_path) == [".notes.tmp-33333333"]


def test_latest_names_the_newest_save(tmp_path):
    save_sharded(_state(1.0), tmp_path / "epoch=0-step=1.ckpt", extra={"global_step": 1}, latest=True)
    save_sharded(_state(2.0), tmp_path / "epoch=0-step=2.ckpt", extra={"global_step": 2}, latest=True)
    state = _zeros()
    assert load_sharded(state, tmp_path)["global_step"] == 2  # the directory of checkpoints: its latest
    assert json.loads((tmp_path / LATEST).read_text())["global_step"] == 2
    assert read_checkpoint_meta(tmp_path / "epoch=0-step=1.ckpt")["global_step"] == 1
    remove_checkpoint(tmp_path / "epoch=0-step=2.ckpt")  # the record names a checkpoint that is gone
    assert load_sharded(_zeros(), tmp_path)["global_step"] == 1  # the newest complete one


def test_checksums_are_crc32_of_the_bytes(tmp_path):
    path = save_sharded(_state(1.0), tmp_path / "ckpt")
    raw = json.loads((path / "manifest.json").read_text())
    assert raw["checksum"] == "crc32"
    data = (path / "__0_0.distcp").read_bytes()
    assert raw["files"]["__0_0.distcp"] == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
