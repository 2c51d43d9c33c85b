"""Read and write the safetensors file format with torch alone.

Tensors handed between processes (and any weights file a user may be given) are stored as safetensors:
an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape", "data_offsets"},
"__metadata__": {str: str}}`` and the raw little-endian bytes, so loading never unpickles anything.
This module writes exactly that format (files open with the ``safetensors`` package and vice versa)
without depending on it: the core must work from a bare install.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Optional

import torch

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",  # FP8: quantized exports
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}
# The header length is a u64; the format caps the header at 100 MB against hostile files.
_MAX_HEADER = 100_000_000


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: Optional[dict[str, str]] = None) -> None:
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
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store here; "
                            f"convert it to one of {sorted(_BY_NAME)}")
        data = tensor.detach().to("cpu").contiguous()
        blob = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        header[name] = {"dtype": _DTYPES[data.dtype], "shape": list(data.shape),
                        "data_offsets": [offset, offset + len(blob)]}
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


def _parse_header(path: Path, head: bytes, file_size: int) -> tuple[dict, int]:
    """(JSON header, its length) from the first bytes of a safetensors file."""
    if file_size < 8:
        raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
    (length,) = struct.unpack("<Q", head[:8])
    if length > _MAX_HEADER or 8 + length > file_size:
        raise ValueError(f"{path} is not a safetensors file (header length {length} does not fit the file)")
    try:
        header = json.loads(head[8:8 + length].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a safetensors file (its header is not JSON: {error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
    return header, length


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """({name: (dtype name, shape)}, metadata) of a safetensors file, reading only its header."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        head += f.read(min(length, _MAX_HEADER))
    header, _ = _parse_header(path, head, size)
    metadata = header.pop("__metadata__", None) or {}
    return {name: (entry.get("dtype"), tuple(int(s) for s in entry.get("shape", ())))
            for name, entry in header.items()}, dict(metadata)


def load_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; every offset is checked against the file."""
    path = Path(path)
    raw = bytearray(path.stat().st_size)  # writable, so torch.frombuffer takes it without a warning
    with open(path, "rb") as f:
        f.readinto(raw)
    length = struct.unpack("<Q", bytes(raw[:8]))[0] if len(raw) >= 8 else 0
    header, length = _parse_header(path, bytes(raw[:8 + min(length, _MAX_HEADER)]), len(raw))
    metadata = header.pop("__metadata__", None) or {}
    buffer = memoryview(raw)[8 + length:]
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        dtype = _BY_NAME.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        shape = [int(s) for s in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= len(buffer) or end - begin != numel * itemsize:
            raise ValueError(f"{path}: tensor {name!r} has data offsets {begin}..{end} that do not match its "
                             f"shape {shape} ({numel * itemsize} bytes) inside {len(buffer)} bytes of data")
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            # A copy (aligned, owning its memory) of the bytes, viewed as the tensor's dtype.
            data = torch.frombuffer(buffer, dtype=torch.uint8, count=end - begin, offset=begin).clone()
            tensors[name] = data.view(dtype).reshape(shape)
    return tensors, dict(metadata)
