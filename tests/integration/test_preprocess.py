"""``megatron-lite preprocess``: every input format, 1 vs 2 workers byte-identical, merging, and bad input."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_lite.cli.preprocess import main
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.preprocess import PreprocessError, preprocess, split_sentences
from megatron_lite.tokenizers import NullTokenizer, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
GPT2_DIR = REPO / "tests" / "data" / "tokenizers" / "gpt2"  # tests/data/README.md: origin and licence
SHAKESPEARE = REPO / "megatron_lite" / "data" / "corpora" / "shakespeare.jsonl.gz"

# null-tokenizer documents: the text is the ids; vocab 100, so eod = 99 and tokens are uint16
DOCS = ["1 2 3", "4 5", "6", "7 8 9 10 11"]
NULL_ARGS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def _write_jsonl(path: Path, rows: list[dict], gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def _pair_bytes(prefix: str) -> tuple[bytes, bytes]:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


def test_null_tokenizer_jsonl_via_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _write_jsonl(tmp_path / "c.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS)])
    assert (
        main(
            [
                "--input",
                str(src),
                "--json-key",
                "text",
                *NULL_ARGS,
                "--output-prefix",
                str(tmp_path / "out" / "c"),
                "--append-eod",
            ]
        )
        == 0
    )
    ds = IndexedDataset(str(tmp_path / "out" / "c_text_document"))
    assert ds.dtype == np.uint16
    assert [s.tolist() for s in ds[:]] == [[1, 2, 3, 99], [4, 5, 99], [6, 99], [7, 8, 9, 10, 11, 99]]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    out = capsys.readouterr().out
    assert "4 documents (0 empty skipped), 15 tokens" in out and "tokens/s" in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["c_text_document.bin", "c_text_document.idx"]


def test_every_input_format_gives_the_same_files(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": d, "other": "x"} for d in DOCS]
    sources = {
        "jsonl": _write_jsonl(tmp_path / "a.jsonl", rows),
        "gz": _write_jsonl(tmp_path / "a.jsonl.gz", rows, gz=True),
        "array": tmp_path / "a.json",
    }
    sources["array"].write_text(json.dumps(rows))
    sources["parquet"] = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(rows), sources["parquet"])
    sources["hf"] = tmp_path / "hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(sources["hf"]))
    sources["hf_dict"] = tmp_path / "hf_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(sources["hf_dict"]))
    tok = NullTokenizer(100)
    outputs = {}
    for name, src in sources.items():
        result = preprocess([str(src)], str(tmp_path / f"out_{name}"), tok, append_eod=True)
        outputs[name] = _pair_bytes(result.output_prefixes["text"])
    assert len(set(outputs.values())) == 1, "formats disagree"
    # a glob over two files concatenates them in sorted order
    result = preprocess([str(tmp_path / "a.jsonl*")], str(tmp_path / "glob"), tok)
    assert result.documents["text"] == 2 * len(DOCS)


def test_gpt2_one_and_two_workers_are_byte_identical(tmp_path: Path) -> None:
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_DIR / "vocab.json", merge_file=GPT2_DIR / "merges.txt")
    with gzip.open(SHAKESPEARE, "rt") as f:
        texts = [json.loads(line)["text"][:6000] for line in f][:24]
    texts.insert(3, "")  # an empty document: skipped and counted
    src = _write_jsonl(tmp_path / "s.jsonl.gz", [{"text": t} for t in texts], gz=True)
    results = [
        preprocess([str(src)], str(tmp_path / f"w{w}"), tok, workers=w, append_eod=True, chunk_size=3) for w in (1, 2)
    ]
    assert _pair_bytes(results[0].output_prefixes["text"]) == _pair_bytes(results[1].output_prefixes["text"])
    assert results[0].empty_documents["text"] == 1 and results[0].documents["text"] == 24
    ds = IndexedDataset(results[0].output_prefixes["text"])
    expected = [tok.tokenize(t) + [tok.eod] for t in texts if t]
    assert ds.dtype == np.uint16 and len(ds) == 24
    assert all(ds[i].tolist() == ids for i, ids in enumerate(expected))


def test_cli_subprocess_and_merge(tmp_path: Path) -> None:
    halves = [[{"text": "Hello world."}, {"text": "Good night, sweet prince."}], [{"text": "To be, or not to be."}]]
    prefixes = []
    for i, rows in enumerate(halves):
        src = _write_jsonl(tmp_path / f"p{i}.jsonl", rows)
        prefix = str(tmp_path / f"p{i}")
        if i == 0:  # once through the real entry point, once in-process
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "megatron_lite",
                    "preprocess",
                    "--input",
                    str(src),
                    "--tokenizer-type",
                    "GPT2BPETokenizer",
                    "--vocab-file",
                    str(GPT2_DIR / "vocab.json"),
                    "--merge-file",
                    str(GPT2_DIR / "merges.txt"),
                    "--output-prefix",
                    prefix,
                    "--workers",
                    "2",
                    "--append-eod",
                ],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=120,
            )
            assert proc.returncode == 0, proc.stderr
            assert "tokens/s" in proc.stdout
        else:
            main(
                [
                    "--input",
                    str(src),
                    "--tokenizer-type",
                    "gpt2",
                    "--vocab-file",
                    str(GPT2_DIR / "vocab.json"),
                    "--merge-file",
                    str(GPT2_DIR / "merges.txt"),
                    "--output-prefix",
                    prefix,
                    "--append-eod",
                ]
            )
        prefixes.append(prefix + "_text_document")
    assert main(["merge", "--input", *prefixes, "--output-prefix", str(tmp_path / "merged")]) == 0
    merged = IndexedDataset(str(tmp_path / "merged"))
    parts = [IndexedDataset(p) for p in prefixes]
    assert [s.tolist() for s in merged[:]] == [s.tolist() for p in parts for s in p[:]]
    assert merged.document_indices.tolist() == [0, 1, 2, 3]
    tok = build_tokenizer("gpt2", vocab_file=GPT2_DIR / "vocab.json", merge_file=GPT2_DIR / "merges.txt")
    assert tok.detokenize(merged[2].tolist()) == "To be, or not to be.<|endoftext|>"


def test_split_sentences_and_several_keys(tmp_path: Path) -> None:
    assert split_sentences('He said "Go." Then left!  Why?\n\nNew para') == [
        'He said "Go."',
        "Then left!",
        "Why?",
        "New para",
    ]
    rows = [{"a": "1 2. 3 4.", "b": "5"}, {"a": "6", "b": ["7 8", "9"]}]  # a list is pre-split sentences
    src = _write_jsonl(tmp_path / "k.jsonl", rows)

    class DotTokenizer(NullTokenizer):
        """Null tokenizer that ignores the sentence dots."""

        def tokenize(self, text: str) -> list[int]:
            return super().tokenize(text.replace(".", " "))

    result = preprocess(
        [str(src)], str(tmp_path / "k"), DotTokenizer(100), json_keys=["a", "b"], split_sentences=True, append_eod=True
    )
    assert set(result.output_prefixes.values()) == {str(tmp_path / "k_a_sentence"), str(tmp_path / "k_b_sentence")}
    a, b = IndexedDataset(str(tmp_path / "k_a_sentence")), IndexedDataset(str(tmp_path / "k_b_sentence"))
    assert [s.tolist() for s in a[:]] == [[1, 2], [3, 4, 99], [6, 99]] and a.document_indices.tolist() == [0, 2, 3]
    assert [s.tolist() for s in b[:]] == [[5, 99], [7, 8], [9, 99]] and b.document_indices.tolist() == [0, 1, 3]


# --- bad input: a clear error naming the file and the fix, and no output left behind ---------------------


def test_absent_key_names_file_line_and_keys(tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "x.jsonl", [{"text": "1"}, {"body": "2", "id": 3}])
    with pytest.raises(
        PreprocessError, match=r"x\.jsonl:2 has no key 'text' \(keys: \['body', 'id'\]\); pass --json-keys"
    ):
        preprocess([str(src)], str(tmp_path / "x"), NullTokenizer(10), workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]  # no half-written pair, no temp files


def test_absent_column_in_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"body": "1"}]), tmp_path / "x.parquet")
    with pytest.raises(PreprocessError, match=r"x\.parquet has no column 'text' \(columns: \['body'\]\)"):
        preprocess([str(tmp_path / "x.parquet")], str(tmp_path / "x"), NullTokenizer(10))


def test_empty_documents(tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": "1"}, {"text": "  "}, {"text": None}])
    result = preprocess([str(src)], str(tmp_path / "e"), NullTokenizer(10), append_eod=True)
    assert result.documents == {"text": 1} and result.empty_documents == {"text": 3}
    all_empty = _write_jsonl(tmp_path / "all.jsonl", [{"text": ""}, {"text": " "}])
    with pytest.raises(PreprocessError, match=r"all 2 documents under 'text' in .*all\.jsonl are empty"):
        preprocess([str(all_empty)], str(tmp_path / "all"), NullTokenizer(10))
    (tmp_path / "none.jsonl").write_text("\n\n")
    with pytest.raises(PreprocessError, match="no documents found"):
        preprocess([str(tmp_path / "none.jsonl")], str(tmp_path / "none"), NullTokenizer(10))
    assert not list(tmp_path.glob("all_*")) and not list(tmp_path.glob("none_*"))


def test_token_id_outside_the_vocabulary(tmp_path: Path) -> None:
    class LyingTokenizer(NullTokenizer):
        """Claims 10 ids but emits the raw numbers: a tokenizer whose files disagree."""

        def tokenize(self, text: str) -> list[int]:
            return [int(p) for p in text.split()]

    src = _write_jsonl(tmp_path / "v.jsonl", [{"text": "1 2"}, {"text": "3 12"}])
    with pytest.raises(
        PreprocessError,
        match=r"v\.jsonl:2: LyingTokenizer produced token id 12, outside its "
        r"vocabulary of 10.*--vocab-size",
    ):
        preprocess([str(src)], str(tmp_path / "v"), LyingTokenizer(10), workers=2)
    assert not list(tmp_path.glob("v_*"))


def test_bad_inputs_and_outputs_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "1"}\n{"text": \n')
    (tmp_path / "data.csv").write_text("text\n1\n")
    (tmp_path / "afile").write_text("")
    (tmp_path / "words.jsonl").write_text('{"text": "1 2"}\n{"text": "one two"}\n')
    whole = gzip.compress(("".join(json.dumps({"text": str(i)}) + "\n" for i in range(2000))).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "fake.parquet").write_text("not parquet")
    latin1 = '{"text": "caf\xe9"}\n'.encode("latin-1")  # "é" in Latin-1: not UTF-8
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "1"}\n' + latin1)  # in the first bytes, read to sniff
    (tmp_path / "deep.jsonl.gz").write_bytes(gzip.compress(b'{"text": "1 2"}\n' * 1499 + latin1))  # past a block
    (tmp_path / "array.json").write_bytes(b'[{"text": "1"},\n{"text": "2"},\n' + latin1[:-1] + b"]")
    not_utf8 = r"byte 14 of the line \(0xe9\) is not UTF-8 .*convert the file \(e\.g\. `iconv -f latin1 -t utf-8 "
    cases = [
        ([str(tmp_path / "latin1.jsonl")], "out", rf"latin1\.jsonl:2: {not_utf8}"),
        ([str(tmp_path / "deep.jsonl.gz")], "out", rf"deep\.jsonl\.gz:1500: {not_utf8}"),
        ([str(tmp_path / "array.json")], "out", rf"array\.json:3: {not_utf8}"),
        ([str(tmp_path / "missing.jsonl")], "out", r"missing\.jsonl: no such file"),
        ([str(tmp_path / "nomatch*.jsonl")], "out", r"nomatch\*\.jsonl: no such file"),
        ([str(tmp_path / "bad.jsonl")], "out", r"bad\.jsonl:2 is not valid JSON"),
        ([str(tmp_path / "data.csv")], "out", r"data\.csv: unsupported input format"),
        ([str(tmp_path)], "out", "not a `datasets` save_to_disk directory"),
        ([str(tmp_path / "bad.jsonl")], "afile/sub/out", r"cannot create output directory .*afile"),
        ([str(tmp_path / "words.jsonl")], "out", r"words\.jsonl:2: NullTokenizer cannot tokenize 'text'"),
        ([str(tmp_path / "cut.jsonl.gz")], "out", r"cut\.jsonl\.gz:\d+ cannot be read .*corrupt or truncated"),
        ([str(tmp_path / "fake.parquet")], "out", r"fake\.parquet is not a readable parquet file"),
    ]
    for inputs, out, message in cases:
        assert main(["--input", *inputs, *NULL_ARGS, "--output-prefix", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("megatron-lite preprocess: error:") and len(err.strip().splitlines()) == 1, err
        assert re.search(message, err), (message, err)
    assert main(["merge", "--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "m")]) == 2
    assert "missing" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob("*.tmp*"))


def test_failure_keeps_existing_outputs(tmp_path: Path) -> None:
    good = _write_jsonl(tmp_path / "g.jsonl", [{"text": "1 2"}])
    preprocess([str(good)], str(tmp_path / "o"), NullTokenizer(10))
    before = _pair_bytes(str(tmp_path / "o_text_document"))
    bad = _write_jsonl(tmp_path / "b.jsonl", [{"text": "3"}, {"nope": "4"}])
    with pytest.raises(PreprocessError):
        preprocess([str(bad)], str(tmp_path / "o"), NullTokenizer(10))
    assert _pair_bytes(str(tmp_path / "o_text_document")) == before
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
