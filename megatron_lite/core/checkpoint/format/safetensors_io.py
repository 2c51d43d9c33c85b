"""Read and write the safetensors file format with torch alone.

Tensors handed between processes (and any weights file a user may be given) are stored as safetensors:
an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"},
"__metadata__": {str: str}}`` and the raw little-endian bytes, so loading never unpickles anything.
This module writes exactly that format (files open with the ``safetensors`` package and vice versa)
without depending on it: the core must work from a bare install. Reading validates a header as strictly as
that package does (the same files are accepted, the same refused), with a message naming the file and
the problem.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import BinaryIO, Collection, NamedTuple, Optional

import torch

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",  # FP8: quantized exports
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}
# Every dtype the format knows, with its size in bits (the safetensors library's ``Dtype::bitsize``): a header
# naming another is malformed; one we cannot hold as a torch tensor is refused when read.
_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# The header length is a u64; the format caps the header at 100 MB against hostile files.
_MAX_HEADER = 100_000_000
_U64 = 2**64  # sizes and offsets are u64 (usize) in the format
_MAX_DIM = 2**63 - 1  # torch's sizes are i64


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: Optional[dict[str, str]] = None
) -> None:
    """Write ``tensors`` (CPU or not; copied to CPU) to ``path`` in the safetensors format, atomically
    (a temporary sibling renamed into place)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; writing them on a big-endian host is not supported")
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    blobs: list[bytes] = []
    offset = 0
    # Larger elements first (then by name), as the safetensors package does: every tensor's data then
    # starts at a multiple of its element size.
    for name in sorted(tensors, key=lambda n: (-tensors[n].element_size(), n)):
        tensor = tensors[name]
        if tensor.dtype not in _DTYPES:
            raise TypeError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store here; "
                f"convert it to one of {sorted(_BY_NAME)}"
            )
        data = tensor.detach().to("cpu").contiguous()
        blob = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        header[name] = {
            "dtype": _DTYPES[data.dtype],
            "shape": list(data.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header with spaces to align the data
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Entry(NamedTuple):
    """One tensor of a safetensors header, validated."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _json_kind(value: object) -> str:
    kinds = {
        dict: "a JSON object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return kinds.get(type(value), type(value).__name__)


def _is_u64(value: object) -> bool:
    return type(value) is int and 0 <= value < _U64  # bool is not a size


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _parse_header(path: Path, head: bytes, file_size: int) -> tuple[dict[str, _Entry], dict[str, str], int]:
    """({name: entry}, metadata, header length) from the first bytes of a safetensors file, accepting exactly the
    headers the ``safetensors`` library accepts (``Metadata::validate`` and ``read_metadata`` in its
    ``tensor.rs``): the header length within the 100 MB limit and the file; a UTF-8 JSON object; ``__metadata__``
    null or str -> str; each tensor a known dtype, a shape of sizes and a pair of offsets; the tensors' data back
    to back from byte 0 in offset order (no gap, no overlap), each exactly its shape's bytes, together exactly
    the rest of the file."""

    def bad(problem: str) -> ValueError:
        return ValueError(f"{path} is not a valid safetensors file: {problem}")

    if file_size < 8:
        raise bad(f"it is {file_size} bytes, shorter than the 8-byte length of its header")
    (length,) = struct.unpack("<Q", head[:8])
    if length > _MAX_HEADER:
        raise bad(f"its header length {length} is over the format's limit of {_MAX_HEADER} bytes")
    if 8 + length > file_size:
        raise bad(f"its header length {length} runs past the end of the file ({file_size} bytes)")
    try:
        text = head[8 : 8 + length].decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad(f"its header is not UTF-8 ({error})") from None
    try:
        header = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad("its header is not valid JSON (nested too deeply)") from None
    except ValueError as error:  # JSONDecodeError, or a NaN / Infinity
        raise bad(f"its header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise bad(f"its header is {_json_kind(header)}, not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad(f"__metadata__ must map strings to strings, got {json.dumps(metadata)[:200]}")
    strings = [*metadata, *metadata.values(), *header]
    for string in strings:
        try:
            string.encode("utf-8")
        except UnicodeEncodeError:  # Python's JSON reads a lone surrogate escape ("\ud800"); the format does not
            raise bad(f"its header is not valid JSON (the string {string!r} holds a lone surrogate)") from None
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r} is described by {_json_kind(info)}, not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _BITS:
            raise bad(f"tensor {name!r} has unknown dtype {dtype!r} (the format's dtypes: {', '.join(_BITS)})")
        if not isinstance(shape, list) or not all(_is_u64(s) for s in shape):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} is not a pair of byte offsets")
        entries[name] = _Entry(dtype, tuple(shape), offsets[0], offsets[1])
    expected = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != expected or entry.end < entry.begin:
            raise bad(
                f"tensor {name!r} has data_offsets [{entry.begin}, {entry.end}] but its data must begin at byte "
                f"{expected} (the tensors' data lie back to back from byte 0, in offset order, without gaps or "
                f"overlaps)"
            )
        expected = entry.end
        elements = 1
        for size in entry.shape:
            elements *= size
            if elements >= _U64:
                raise bad(f"tensor {name!r}: shape {list(entry.shape)} overflows 64 bits")
        bits = elements * _BITS[entry.dtype]
        if bits >= _U64:
            raise bad(f"tensor {name!r}: shape {list(entry.shape)} of {entry.dtype} overflows 64 bits")
        if bits % 8:
            raise bad(f"tensor {name!r}: {entry.dtype} of shape {list(entry.shape)} does not end on a byte boundary")
        if entry.end - entry.begin != bits // 8:
            raise bad(
                f"tensor {name!r}: {entry.dtype} of shape {list(entry.shape)} is {bits // 8} bytes but its "
                f"data_offsets [{entry.begin}, {entry.end}] hold {entry.end - entry.begin}"
            )
    if 8 + length + expected != file_size:
        raise bad(
            f"the tensors' data take {expected} bytes but the file holds {file_size - 8 - length} after its "
            f"header (truncated, or bytes appended)"
        )
    return entries, metadata, length


def _read_header(f: BinaryIO, path: Path) -> tuple[dict[str, _Entry], dict[str, str], int]:
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    head += f.read(min(length, _MAX_HEADER))
    return _parse_header(path, head, size)


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """({name: (dtype name, shape)}, metadata) of a safetensors file, reading only its header (validated in full
    against the file's size)."""
    path = Path(path)
    with open(path, "rb") as f:
        entries, metadata, _ = _read_header(f, path)
    return {name: (entry.dtype, entry.shape) for name, entry in entries.items()}, metadata


def load_safetensors(
    path: str | os.PathLike, names: Optional[Collection[str]] = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, whose header is validated as the ``safetensors`` library
    validates it; only the tensors in ``names`` (those the file has) if given."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        entries, metadata, length = _read_header(f, path)
        for name, entry in entries.items():
            if names is not None and name not in names:
                continue
            dtype = _BY_NAME.get(entry.dtype)
            if dtype is None:
                raise ValueError(
                    f"{path}: tensor {name!r} has dtype {entry.dtype!r}, which megatron-lite does not "
                    f"read (it reads {', '.join(sorted(_BY_NAME))})"
                )
            if any(size > _MAX_DIM for size in entry.shape):
                raise ValueError(f"{path}: tensor {name!r} has shape {list(entry.shape)}, larger than torch can hold")
            if entry.end == entry.begin:
                tensors[name] = torch.empty(entry.shape, dtype=dtype)
                continue
            # Its own buffer (aligned, writable, so torch.frombuffer takes it without a copy or a warning)
            data = bytearray(entry.end - entry.begin)
            f.seek(8 + length + entry.begin)
            if f.readinto(data) != len(data):
                raise ValueError(f"{path} changed while it was read (tensor {name!r} is cut short)")
            tensors[name] = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(entry.shape)
    return tensors, metadata
