"""What a checkpoint holds and whether its files are intact, read without loading it or changing anything.

Used by ``megatron-lite checkpoint inspect``. Nothing is unpickled and no class named by the checkpoint is
built: configs come back as plain dicts (with their class name under ``"__class__"``).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from pathlib import Path
from typing import Any, Optional

from megatron_lite.core.checkpoint.errors import CorruptCheckpointError
from megatron_lite.core.checkpoint.format import meta_json, object_commit
from megatron_lite.core.checkpoint.format.commit import incomplete_leftovers, read_latest
from megatron_lite.core.checkpoint.format.integrity import LEGACY_META, META, read_manifest, verify_checkpoint
from megatron_lite.core.checkpoint.format.safe_reader import read_dcp_metadata
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta
from megatron_lite.core.object_staging import objects_under
from megatron_lite.core.object_store import Location, is_file, is_remote, join, location, read_bytes


def locate(path: str | os.PathLike) -> Location:
    """The checkpoint directory ``path`` names (itself, or the latest one of a directory of checkpoints; at a URL,
    the prefix of the files its commit marker names); FileNotFoundError with what is there instead."""
    if is_remote(path):
        return object_commit.resolve(str(location(path)))
    path = Path(path)
    if path.is_dir() and not (path / ".metadata").is_file():
        name = read_latest(path)
        if name is not None and (path / name / ".metadata").is_file():
            return path / name
    if (path / ".metadata").is_file():
        return path
    if not os.path.lexists(path):
        leftovers = incomplete_leftovers(path)
        hint = (
            f"; the interrupted save(s) {', '.join(p.name for p in leftovers)} are beside it (loading the path "
            f"recovers a complete one)"
            if leftovers
            else ""
        )
        raise FileNotFoundError(f"no checkpoint at {path}{hint}")
    raise FileNotFoundError(
        f"{path} is not a megatron-lite checkpoint (no DCP .metadata inside); pass the directory "
        f"that trainer.save_checkpoint() or ModelCheckpoint wrote"
    )


def _read_meta(path: Location) -> tuple[Optional[dict], str, Optional[str]]:
    """(metadata or None, its file, the error that kept it from being read)."""
    meta = join(path, META)
    if is_file(meta):
        try:
            return meta_json.loads(read_bytes(meta), allowed=None, unknown_classes="dict", source=str(meta)), META, None
        except ValueError as error:
            return None, META, str(error)
    if isinstance(path, Path) and (path / LEGACY_META).is_file():  # only ever written on disk
        try:
            return read_checkpoint_meta(path), LEGACY_META, None
        except ValueError as error:
            return None, LEGACY_META, str(error)
    return None, "", "no meta.json or meta.pt"


def _consumed_samples(meta: dict) -> tuple[Optional[int], Optional[str]]:
    for key, value in meta.items():
        if isinstance(value, dict) and isinstance(value.get("consumed_samples"), int):
            return value["consumed_samples"], key
    return None, None


def _plain(value: Any) -> Any:
    """JSON-ready: tensors as lists, tuples as lists, non-finite floats as strings."""
    import torch

    if torch.is_tensor(value):
        return value.tolist() if value.numel() > 1 else _plain(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a legacy meta.pt's configs
        return {
            "__class__": meta_json.class_name(type(value)),
            **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def describe_checkpoint(path: str | os.PathLike, checksums: bool = True) -> dict[str, Any]:
    """Step, consumed samples, layout, configs, size on disk and the checksum verdict of a checkpoint.

    ``"checksums"`` is ``{"status": "ok" | "corrupt" | "unverified" | "skipped", "problems": [...]}``;
    a checkpoint that is not one raises FileNotFoundError.
    """
    path = locate(path)
    # with the folders it carries (tokenizer/)
    sizes = (
        [size for size, _ in objects_under(path).values()]
        if isinstance(path, str)
        else [p.stat().st_size for p in path.rglob("*") if p.is_file()]
    )
    info: dict[str, Any] = {"path": str(path), "size_bytes": sum(sizes), "files": len(sizes)}
    if checksums:
        try:
            verdict = verify_checkpoint(path)
            info["checksums"] = {
                "status": verdict.status,
                "problems": [],
                "files_checked": verdict.files,
                "bytes_checked": verdict.bytes,
            }
        except CorruptCheckpointError as error:
            problems = [line.strip() for line in str(error).splitlines()[1:-1]]
            info["checksums"] = {"status": "corrupt", "problems": problems}
    else:
        info["checksums"] = {"status": "skipped", "problems": []}
    try:
        manifest = read_manifest(path)
    except CorruptCheckpointError:
        manifest = None
    if manifest is not None:
        info["written_at"] = datetime.datetime.fromtimestamp(manifest.written_at).isoformat(timespec="seconds")
    try:
        metadata = read_dcp_metadata(join(path, ".metadata"))
        tensors = {k: m for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
        info["tensors"] = len(tensors)
        info["model_parameters"] = sum(math.prod(m.size) for k, m in tensors.items() if k.startswith("model."))
    except (OSError, ValueError) as error:
        info["dcp_metadata_error"] = str(error)
    meta, source, meta_error = _read_meta(path)
    info["meta_file"] = source
    if meta_error is not None:
        info["meta_error"] = meta_error
    if meta is not None:
        consumed, owner = _consumed_samples(meta)
        info.update(
            global_step=meta.get("global_step"),
            epoch=meta.get("epoch"),
            consumed_samples=consumed,
            consumed_samples_from=owner,
            layout=_plain(meta.get("megatron_lite_layout")),
            hyper_parameters=_plain(meta.get("hyper_parameters")),
            datamodule_hyper_parameters=_plain(meta.get("datamodule_hyper_parameters")),
            lightning_version=meta.get("pytorch-lightning_version"),
        )
    return info


def is_healthy(info: dict[str, Any]) -> bool:
    """Whether a :func:`describe_checkpoint` result shows a checkpoint that loads: checksums not failed and
    metadata readable."""
    return info["checksums"]["status"] != "corrupt" and "meta_error" not in info and "dcp_metadata_error" not in info
