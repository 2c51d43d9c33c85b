"""``megatron-lite checkpoint inspect PATH [--json]``: what a checkpoint holds and whether its files are intact.

Prints the step, consumed samples, the layout it was written with, the model/optimizer configs, size on
disk and the checksum verdict. Exit code 0 when the checkpoint is intact (or written before checksums
existed: "unverified"), 1 when a file is corrupted, missing or its metadata unreadable, 2 when PATH is not
a checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

from megatron_lite.cli.command import EXIT_FAILED, EXIT_OK, print_result, run_verb
from megatron_lite.core.checkpoint.format.inspect import describe_checkpoint, is_healthy
from megatron_lite.utils.local_path import local_or_object_path_argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-lite checkpoint", description="Look at megatron-lite checkpoints without loading them."
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    inspect = verbs.add_parser("inspect", help="step, consumed samples, layout, configs, size, checksum verdict")
    inspect.add_argument(
        "path",
        type=local_or_object_path_argument,
        help="a checkpoint directory (e.g. runs/ckpts/last.ckpt), or a directory of "
        "checkpoints (its latest_checkpoint.json is followed); a path or an s3:// URL",
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--no-checksums", action="store_true", help="skip reading every file to check it")
    return parser


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _config(value: Any) -> str:
    if not isinstance(value, dict):
        return str(value)
    name = str(value.get("__class__", "")).rsplit(".", 1)[-1]
    fields = ", ".join(f"{k}={v!r}" for k, v in value.items() if k != "__class__")
    return f"{name}({fields})" if name else fields


def format_text(info: dict[str, Any]) -> str:
    rows = [("checkpoint", info["path"])]
    if info.get("global_step") is not None:
        rows.append(("step", f"{info['global_step']} (epoch {info.get('epoch')})"))
    if info.get("consumed_samples") is not None:
        rows.append(("consumed", f"{info['consumed_samples']} samples ({info['consumed_samples_from']} state)"))
    layout = info.get("layout")
    if isinstance(layout, dict):
        short = {
            "tensor_model_parallel_size": "tp",
            "pipeline_model_parallel_size": "pp",
            "virtual_pipeline_model_parallel_size": "vpp",
            "world_size": "ranks",
            "context_parallel_size": "cp",
            "expert_model_parallel_size": "ep",
            "data_parallel_size": "dp",
        }
        rows.append(("layout", ", ".join(f"{short.get(k, k)}={v}" for k, v in layout.items())))
    hparams = info.get("hyper_parameters")
    if isinstance(hparams, dict):
        for key, value in hparams.items():
            rows.append((key, _config(value)))
    if info.get("datamodule_hyper_parameters"):
        rows.append(("data", _config(info["datamodule_hyper_parameters"])))
    size = f"{_size(info['size_bytes'])} in {info['files']} files"
    if "tensors" in info:
        size += f"; {info['tensors']} tensors, {info['model_parameters']:,} model parameters"
    rows.append(("size", size))
    if info.get("written_at"):
        rows.append(("written", info["written_at"]))
    rows.append(("metadata", info["meta_file"] or "-"))
    checks = info["checksums"]
    verdict = {
        "ok": f"ok ({checks.get('files_checked')} files, {_size(checks.get('bytes_checked', 0))} checked)",
        "unverified": "unverified (no manifest.json: written before checksums existed)",
        "skipped": "not checked (--no-checksums)",
        "corrupt": "CORRUPT",
    }[checks["status"]]
    rows.append(("checksums", verdict))
    lines = [f"{k:<12}{v}" for k, v in rows]
    lines += [f"  {p}" for p in checks["problems"]]
    for key in ("meta_error", "dcp_metadata_error"):
        if key in info:
            lines.append(f"{'error':<12}{info[key]}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-lite checkpoint inspect ...``: 0 intact, 1 damaged, 2 not a checkpoint (one line on stderr)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))

    def show(info: dict[str, Any]) -> int:
        print_result(info, args.json, format_text, indent=2)
        return EXIT_OK if is_healthy(info) else EXIT_FAILED

    return run_verb(
        "megatron-lite checkpoint",
        lambda: describe_checkpoint(args.path, checksums=not args.no_checksums),
        show,
        errors=(OSError, ValueError),
    )
