"""Checkpoint safety across ranks (gloo, forked): every rank records the checksums of the files it writes
and rank 0 writes them into one manifest; a damaged file -- whichever rank checks it -- fails the load on
every rank with the same error naming it (no rank waits in a collective); a value rank 0 refuses to write
fails the save on every rank before any file exists; a save replacing an existing checkpoint leaves only
the new one."""

from pathlib import Path

import torch
from spawn_utils import run_ranks

from megatron_lite.core.checkpoint.format.integrity import _share, read_manifest
from megatron_lite.core.checkpoint.format.sharded import load_sharded, save_sharded


def _state(rank: int, value: float) -> dict:
    # per-rank keys: each rank writes its own __<rank>_0.distcp; the shared key is written once
    return {f"rank{rank}.weight": torch.full((256, 64), value + rank), "shared.bias": torch.full((64,), value)}


def _save_damage_load(rank: int, world_size: int, directory: str, damaged: str) -> dict:
    path = Path(directory) / "ckpt"
    save_sharded(_state(rank, 1.0), path, extra={"global_step": 3}, latest=True)
    records = {name: record.size for name, record in read_manifest(path).files.items()}
    save_sharded(_state(rank, 2.0), path, extra={"global_step": 4}, latest=True)  # replaces it
    clean = _state(rank, 0.0)
    meta = load_sharded(clean, path)
    entries = sorted(p.name for p in Path(directory).iterdir())
    torch.distributed.barrier()
    if rank == 0:
        data = bytearray((path / damaged).read_bytes())
        data[len(data) // 2] ^= 0x01
        (path / damaged).write_bytes(data)
    torch.distributed.barrier()
    target = {k: torch.zeros_like(v) for k, v in _state(rank, 0.0).items()}
    try:
        load_sharded(target, path)
        error = None
    except ValueError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {
        "records": records,
        "step": meta["global_step"],
        "entries": entries,
        "loaded": float(clean[f"rank{rank}.weight"][0, 0]),
        "error": error,
        "untouched": not any(t.any() for t in target.values()),
    }


def test_a_damaged_shard_fails_every_rank_and_names_the_file(tmp_path):
    checked_by = set()
    for damaged in ("__1_0.distcp", "__0_0.distcp"):
        directory = tmp_path / damaged
        directory.mkdir()
        results = run_ranks(_save_damage_load, 2, str(directory), damaged)
        assert results[0]["records"].keys() == {".metadata", "meta.json", "__0_0.distcp", "__1_0.distcp"}
        assert all(r["step"] == 4 for r in results) and [r["loaded"] for r in results] == [2.0, 3.0]
        assert results[0]["entries"] == ["ckpt", "latest_checkpoint.json"]  # the replaced one is gone
        for r in results:
            assert r["error"] is not None and r["error"].startswith("CorruptCheckpointError")
            assert f"{damaged}: checksum mismatch" in r["error"] and r["untouched"]
        assert results[0]["error"] == results[1]["error"]
        manifest = read_manifest(directory / "ckpt")
        checked_by |= {rank for rank in (0, 1) if damaged in _share(manifest.files, 2, rank)}
    assert checked_by == {0, 1}  # one damaged file was found by rank 0, the other by rank 1


def _refused_save(rank: int, world_size: int, directory: str) -> str:
    try:
        save_sharded(_state(rank, 1.0), Path(directory) / "ckpt", extra={"hyper_parameters": {"tokenizer": object()}})
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_value_refused_on_rank0_fails_the_save_on_every_rank(tmp_path):
    errors = run_ranks(_refused_save, 2, str(tmp_path))
    assert all(
        e.startswith("CheckpointMetaError: checkpoint.hyper_parameters.tokenizer is a builtins.object") for e in errors
    )
    assert errors[1].endswith("(raised on rank 0)")
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
