"""A checkpoint save that fills its disk: a real, size-limited file system (a 1 MiB tmpfs mounted in a mount
namespace of a forked process, so nothing is mounted outside it), real saves of a real state.

- The error names the condition (ENOSPC), the checkpoint, the bytes its tensors need and the bytes free, on
  every rank the same -- not torch's "[enforce fail at inline_container.cc] unexpected pos".
- The previous checkpoint at the same path stays intact (it loads, to the same values) and stays the latest;
  the unfinished save is removed, giving its space back.
- The same through the asynchronous writer: its error is raised by the next save.

Mounting needs root or unprivileged user namespaces; without either the tests skip, saying which.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from spawn_utils import run_ranks

from megatron_lite.core.checkpoint.errors import AsyncCheckpointError, CheckpointDiskFullError
from megatron_lite.core.checkpoint.format.async_save import AsyncCheckpointWriter
from megatron_lite.core.checkpoint.format.sharded import load_sharded, save_sharded

_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
DISK = "1m"  # the tmpfs size: the first state's checkpoint fits, the second one (4 MiB of tensors) does not


def _mount_tiny_disk(target: Path) -> None:
    """In this (forked, single-threaded) process only: a new mount namespace (and, unless root, a user
    namespace mapping this user to root) with a tmpfs of ``DISK`` bytes at ``target``."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()

    def check(result: int, what: str) -> None:
        if result != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")

    check(
        libc.unshare(_CLONE_NEWNS if uid == 0 else _CLONE_NEWNS | _CLONE_NEWUSER),
        "unshare(CLONE_NEWNS" + (")" if uid == 0 else " | CLONE_NEWUSER)"),
    )
    if uid != 0:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    # Private first: the tmpfs must not propagate to the namespace the tests run in.
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    check(libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", 0, f"size={DISK}".encode()), f"mount tmpfs {target}")


def _child(fn, disk: str, result: str) -> None:
    try:
        try:
            _mount_tiny_disk(Path(disk))
        except OSError as error:
            who = "as root" if os.getuid() == 0 else f"as uid {os.getuid()} (unprivileged user namespaces refused?)"
            Path(result).write_text(
                json.dumps(
                    {
                        "skip": f"cannot mount a size-limited tmpfs in a mount namespace "
                        f"{who}: {error}; these tests need root or user namespaces"
                    }
                )
            )
            return
        Path(result).write_text(json.dumps({"value": fn(Path(disk))}))
    except BaseException:  # noqa: BLE001 - reported to the test process
        Path(result).write_text(json.dumps({"error": traceback.format_exc()}))


def on_tiny_disk(tmp_path: Path, fn):
    """``fn(directory)`` in a forked process where ``directory`` is a ``DISK``-sized tmpfs; its JSON result."""
    disk, result = tmp_path / "disk", tmp_path / "result.json"
    disk.mkdir()
    process = mp.get_context("fork").Process(target=_child, args=(fn, str(disk), str(result)))
    process.start()
    process.join(120)
    if process.is_alive():
        process.kill()
        pytest.fail("the save on the tiny disk did not finish in 120 s")
    outcome = json.loads(result.read_text())
    if "skip" in outcome:
        pytest.skip(outcome["skip"])
    assert "error" not in outcome, outcome.get("error")
    return outcome["value"]


def _state(value: float, rows: int) -> dict:
    return {"model": {"weight": torch.full((rows, 256), value), "bias": torch.full((256,), -value)}}


SMALL, LARGE = 8, 4096  # rows of 256 fp32: 8 KiB of weights, then 4 MiB


def _check_disk_full(message: str, path: Path) -> None:
    assert "no space left on device (ENOSPC)" in message and str(path) in message, message
    assert "unexpected pos" not in message and "enforce fail" not in message, message
    needed = re.search(r"needs about ([\d.]+) MiB", message)
    free = re.search(r"and ([\d.]+) (KiB|MiB) are free there", message)
    assert needed and float(needed[1]) == pytest.approx((LARGE * 256 + 256) * 4 / 2**20, abs=0.01), message
    assert free and float(free[1]) * (1 if free[2] == "KiB" else 1024) < 1024, message  # at most the 1 MiB disk
    assert f"the previous checkpoint at {path} is unchanged" in message, message


def _intact(path: Path, value: float) -> bool:
    """The previous checkpoint loads, to its values, and is still the latest; no unfinished save is left."""
    state = _state(0.0, SMALL)
    load_sharded(state, path.parent)  # the directory: loads what latest_checkpoint.json names
    hidden = [p.name for p in path.parent.iterdir() if p.name.startswith(".")]
    return torch.equal(state["model"]["weight"], torch.full((SMALL, 256), value)) and not hidden


def _sync_save_alone(disk: Path) -> dict:
    path = disk / "ckpt"
    save_sharded(_state(1.5, SMALL), path, extra={"global_step": 1}, latest=True)
    try:
        save_sharded(_state(2.5, LARGE), path, extra={"global_step": 2}, latest=True)
    except CheckpointDiskFullError as error:
        return {"message": str(error), "errno": error.errno, "intact": _intact(path, 1.5)}
    return {"message": None}


def test_a_full_disk_is_named_with_the_bytes_and_the_previous_checkpoint_is_intact(tmp_path):
    out = on_tiny_disk(tmp_path, _sync_save_alone)
    assert out["message"] is not None, "the second save fitted on the tiny disk"
    _check_disk_full(out["message"], tmp_path / "disk" / "ckpt")
    assert out["errno"] == errno.ENOSPC and out["intact"]


def _rank_saves(rank: int, world_size: int, disk: str) -> dict:
    """Each rank writes half of the large state (its own keys); synchronously, then in the background."""
    path = Path(disk) / "ckpt"
    mine = lambda value, rows: {f"rank{rank}": _state(value, rows)["model"]}  # noqa: E731
    save_sharded(mine(1.5, SMALL), path, extra={"global_step": 1}, latest=True)
    out = {}
    try:
        save_sharded(mine(2.5, LARGE // 2), path, extra={"global_step": 2}, latest=True)
    except CheckpointDiskFullError as error:
        out["sync"] = str(error)
    writer = AsyncCheckpointWriter()
    try:
        writer.save(mine(3.5, LARGE // 2), path, extra={"global_step": 3}, latest=True)  # returns once staged
        try:
            writer.save(mine(4.5, SMALL), path, extra={"global_step": 4}, latest=True)  # raises the previous error
        except AsyncCheckpointError as error:
            out["async"] = str(error)
    finally:
        writer.close(raise_error=False)
    state = mine(0.0, SMALL)
    load_sharded(state, path)
    out["intact"] = torch.equal(state[f"rank{rank}"]["weight"], torch.full((SMALL, 256), 1.5))
    out["hidden"] = [p.name for p in Path(disk).iterdir() if p.name.startswith(".")]
    return out


def _two_ranks(disk: Path) -> list:
    return run_ranks(_rank_saves, 2, str(disk))


def test_every_rank_gets_the_same_error_and_so_does_the_next_async_save(tmp_path):
    path = tmp_path / "disk" / "ckpt"
    ranks = on_tiny_disk(tmp_path, _two_ranks)
    for kind in ("sync", "async"):
        messages = [r.get(kind) for r in ranks]
        assert messages[0] is not None and messages[0] == messages[1], (kind, messages)
        _check_disk_full(messages[0], path)
    assert ranks[0]["async"].startswith(f"the checkpoint {path} could not be written in the background")
    assert all(r["intact"] and not r["hidden"] for r in ranks), ranks
