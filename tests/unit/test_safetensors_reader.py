"""Our safetensors reader accepts exactly the files the `safetensors` library accepts: every crafted header the
library rejects (overlapping, out-of-order or gapped data offsets, bytes past the data or missing, unknown dtypes,
shapes that disagree with their byte length, malformed JSON, a non-string metadata value, ...) is refused by
both of our readers with one message naming the file and the problem, and the odd-but-valid files the library
reads (tensors listed out of offset order, unknown entry fields, null metadata, zero-size tensors) read the same.
The files are crafted byte by byte here."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from megatron_lite.core.checkpoint.format.safetensors_io import load_safetensors, read_safetensors_header

safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="safetensors is not installed (comes with transformers: pip install -e '.[dev]')"
)
from safetensors import SafetensorError  # noqa: E402


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _header(**entries) -> str:
    return json.dumps(entries)


A = _entry("F32", [2], 0, 8)
# (header JSON text, data bytes, what our message says); a header length of None is the header's own length
REJECTED = {
    "overlapping offsets": (
        _header(a=A, b=_entry("F32", [2], 4, 12)),
        12,
        r"tensor 'b' has data_offsets \[4, 12\] but its data must begin at byte 8",
    ),
    "two tensors on the same bytes": (
        _header(a=A, b=A),
        8,
        r"tensor 'b' has data_offsets \[0, 8\] but its data "
        r"must begin at byte 8",
    ),
    "a gap between tensors": (_header(a=A, b=_entry("F32", [2], 12, 20)), 20, r"'b'.*must begin at byte 8"),
    "data not starting at 0": (_header(a=_entry("F32", [2], 4, 12)), 12, r"'a'.*must begin at byte 0"),
    "end before begin": (
        _header(a=_entry("F32", [0], 0, 0), b=_entry("F32", [2], 8, 0)),
        8,
        r"'b' has data_offsets \[8, 0\]",
    ),
    "bytes after the data": (
        _header(a=A),
        12,
        r"the tensors' data take 8 bytes but the file holds 12 after its "
        r"header",
    ),
    "data cut short": (_header(a=A), 4, r"the tensors' data take 8 bytes but the file holds 4 after its header"),
    "an unknown dtype": (_header(a=_entry("F33", [2], 0, 8)), 8, r"tensor 'a' has unknown dtype 'F33'"),
    "a lower-case dtype": (_header(a=_entry("f32", [2], 0, 8)), 8, r"tensor 'a' has unknown dtype 'f32'"),
    "shape and byte length disagree": (
        _header(a=_entry("F32", [3], 0, 8)),
        8,
        r"tensor 'a': F32 of shape \[3\] is 12 bytes but its data_offsets \[0, 8\] "
        r"hold 8",
    ),
    "a sub-byte tensor ending mid-byte": (
        _header(a=_entry("F4", [3], 0, 2)),
        2,
        r"tensor 'a': F4 of shape \[3\] does not end on a byte boundary",
    ),
    "a shape overflowing 64 bits": (
        _header(a=_entry("F32", [2**32, 2**32, 0], 0, 0)),
        0,
        r"tensor 'a': shape .* overflows",
    ),
    "a negative dimension": (_header(a=_entry("F32", [-2], 0, 8)), 8, r"tensor 'a': shape \[-2\] is not a list"),
    "a float dimension": (_header(a=_entry("F32", [2.0], 0, 8)), 8, r"tensor 'a': shape \[2.0\] is not a list"),
    "a boolean dimension": (_header(a=_entry("F32", [True], 0, 4)), 4, r"tensor 'a': shape \[True\] is not"),
    "three data offsets": (
        '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}',
        8,
        r"tensor 'a': data_offsets \[0, 8, 8\] is not a pair",
    ),
    "an offset past 2**64": (
        _header(a=_entry("F32", [2], 0, 2**64)),
        8,
        r"data_offsets \[0, 18446744073709551616\] "
        r"is not a pair",
    ),
    "a float offset": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8e0]}}', 8, r"is not a pair"),
    "a missing field": ('{"a":{"dtype":"F32","data_offsets":[0,8]}}', 8, r"tensor 'a': shape None is not a list"),
    "an entry that is not an object": ('{"a":5}', 0, r"tensor 'a' is described by a number, not an object"),
    "a header that is a list": ("[1, 2]", 0, r"its header is a list, not a JSON object"),
    "a non-string metadata value": ('{"__metadata__":{"a":1}}', 0, r"__metadata__ must map strings to strings"),
    "metadata that is a list": ('{"__metadata__":[]}', 0, r"__metadata__ must map strings to strings"),
    "a NaN in the header": ('{"__metadata__":{"a":NaN}}', 0, r"its header is not valid JSON .*NaN"),
    "characters after the JSON": (_header(a=A) + "x", 8, r"its header is not valid JSON"),
    "a lone surrogate in a name": (
        '{"a\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
        8,
        r"its header is not valid JSON .*surrogate",
    ),
    "a byte-order mark": ("\ufeff" + _header(a=A), 8, r"its header is not valid JSON"),
    "nesting 100000 levels deep": (
        '{"a":' + "[" * 100_000 + "]" * 100_000 + "}",
        0,
        r"its header is not valid JSON \(nested too deeply\)",
    ),
}


def _write(path, header: str | bytes, data: int, length: int | None = None):
    raw = header.encode("utf-8") if isinstance(header, str) else header
    path.write_bytes(
        struct.pack("<Q", len(raw) if length is None else length)
        + raw
        + bytes(range(256)) * (data // 256)
        + bytes(range(data % 256))
    )
    return path


def _refused_by_both(path, message: str) -> None:
    with pytest.raises(SafetensorError):
        safetensors_torch.load_file(path)
    for read in (load_safetensors, read_safetensors_header):
        with pytest.raises(ValueError, match=message) as error:
            read(path)
        assert str(error.value).startswith(f"{path} is not a valid safetensors file: "), str(error.value)


@pytest.mark.parametrize("case", list(REJECTED))
def test_a_header_the_safetensors_library_rejects_is_refused(case, tmp_path):
    header, data, message = REJECTED[case]
    _refused_by_both(_write(tmp_path / "crafted.safetensors", header, data), message)


def test_header_lengths_that_do_not_fit_are_refused(tmp_path):
    _refused_by_both(
        _write(tmp_path / "huge.safetensors", "{}", 0, length=100_000_001),
        r"header length 100000001 is over the format's limit of 100000000 bytes",
    )
    _refused_by_both(
        _write(tmp_path / "past.safetensors", "{}", 0, length=100),
        r"header length 100 runs past the end of the file \(10 bytes\)",
    )
    (tmp_path / "tiny.safetensors").write_bytes(b"\0" * 4)
    _refused_by_both(tmp_path / "tiny.safetensors", r"4 bytes, shorter than the 8-byte length of its header")
    _refused_by_both(_write(tmp_path / "latin1.safetensors", b'{"\xe9":{}}', 0), r"its header is not UTF-8")


ACCEPTED = {  # odd but valid: the library reads them, and so do we
    "tensors listed out of offset order": _header(b=_entry("F32", [2], 8, 16), a=A),
    "an unknown field in an entry": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"note":1}}',
    "null metadata and whitespace around the JSON": ' {"__metadata__":null,"a":{"dtype":"F32","shape":[2],'
    '"data_offsets":[0,8]}} \t\n',
    "zero-size and scalar tensors": _header(
        e=_entry("I64", [0, 3], 0, 0),
        s=_entry("F32", [], 0, 4),
        z=_entry("BF16", [2, 0], 4, 4),
        a=_entry("U8", [4], 4, 8),
    ),
    "a repeated name (the last one counts)": '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
    '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "no tensors": "{}",
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_odd_but_valid_files_read_as_the_library_reads_them(case, tmp_path):
    header = ACCEPTED[case]
    spans = [e["data_offsets"][1] for e in json.loads(header).values() if isinstance(e, dict) and "data_offsets" in e]
    path = _write(tmp_path / "odd.safetensors", header, max(spans, default=0))
    theirs = safetensors_torch.load_file(path)
    ours, _ = load_safetensors(path)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    names, _ = read_safetensors_header(path)
    assert {n: (tuple(t.shape)) for n, t in theirs.items()} == {n: shape for n, (_, shape) in names.items()}
