#!/usr/bin/env python
"""Preprocessing throughput (``megatron-lite preprocess``) against a plain tokenizing loop, and random reads.

1. **Preprocess** (target: >= 1.8x the plain loop with 2 workers). The bundled Shakespeare corpus
   (``megatron_lite/data/corpora/shakespeare.jsonl.gz``, 42 works, ~5 MB of text) and the GPT-2 BPE tokenizer
   from ``tests/data/tokenizers/gpt2/``:

   * *plain loop*: read the gzipped JSON lines, ``json.loads`` each, ``tokenizer.tokenize(text) + [eod]``, and
     collect the ids as one uint16 array -- what a user would hand-write, in this process, one core;
   * *preprocess, N workers*: ``megatron_lite.data.preprocess.preprocess(...)`` with ``--append-eod``: the
     same reading and tokenizing, in a pool of N worker processes, plus writing the ``.bin``/``.idx`` pair
     (pool start-up and writing included in the time).

   Runs alternate (plain, 1 worker, 2 workers, plain, ...) for ``--repeats`` rounds so that drifts of a
   shared machine hit all of them; the median wall time of each is reported as tokens/s and as a ratio to
   the plain loop. The CPU seconds of all processes (main + finished workers) show what the pipeline costs
   beyond tokenizing: close to the plain loop's means the time lost at 2 workers went to waiting for a core
   (other jobs), not to work. Every run checks that its tokens equal the plain loop's, and that 1 and 2
   workers wrote byte-identical files.
   One end-to-end run of the command (``python -m megatron_lite preprocess``, interpreter start and
   imports included) is timed too.

2. **Random reads**: samples per second of ``GPTDataset[i]`` (``seq_length`` + 1 tokens, cut across
   documents) at random ``i`` over the preprocessed data, and ``IndexedDataset.get(doc, offset, length)``
   slices at random places, both memory-mapped, one process.

``TOKENIZERS_PARALLELISM=false`` everywhere, so one worker is one core. Timings are never asserted on; the
machine's CPU count and load average are recorded, since other jobs on a shared 2-core box skew them.

Run from the repository root: ``.venv/bin/python benchmarks/preprocess.py [--repeats 3 --reads 20000]``.
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before any tokenizer is loaded: one core per process

import argparse  # noqa: E402
import datetime  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from megatron_lite.data.indexed_dataset import IndexedDataset, optimal_dtype  # noqa: E402
from megatron_lite.data.preprocess import preprocess  # noqa: E402
from megatron_lite.tokenizers import build_tokenizer  # noqa: E402

CORPUS = REPO_ROOT / "megatron_lite" / "data" / "corpora" / "shakespeare.jsonl.gz"
GPT2_DIR = REPO_ROOT / "tests" / "data" / "tokenizers" / "gpt2"  # shipped with the tests (tests/data/README.md)
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "preprocess.json"
TARGET_RATIO = 1.8


def load_tokenizer() -> tuple[Any, dict[str, str]]:
    """GPT-2 BPE from tests/data; the tokenizer and the CLI arguments that build it."""
    args = {
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": str(GPT2_DIR / "vocab.json"),
        "merge_file": str(GPT2_DIR / "merges.txt"),
    }
    return build_tokenizer(**args), args


def _cpu_seconds() -> float:
    """CPU time of this process plus its finished children (the pool's workers, once joined)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def plain_loop(tokenizer: Any) -> tuple[float, float, np.ndarray]:
    """Read, parse and tokenize the corpus in a plain loop; (seconds, CPU seconds, ids with an EOD per document)."""
    start, cpu = time.perf_counter(), _cpu_seconds()
    parts = []
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            ids = tokenizer.tokenize(json.loads(line)["text"])
            if ids:
                parts.append(np.asarray(ids + [tokenizer.eod], dtype=optimal_dtype(tokenizer.vocab_size)))
    tokens = np.concatenate(parts)
    return time.perf_counter() - start, _cpu_seconds() - cpu, tokens


def run_preprocess(tokenizer: Any, workers: int, out_dir: str) -> tuple[float, float, str]:
    """One library run with ``workers`` processes; (seconds, CPU seconds of all processes, output prefix)."""
    start, cpu = time.perf_counter(), _cpu_seconds()
    result = preprocess(
        [str(CORPUS)], os.path.join(out_dir, f"w{workers}"), tokenizer, workers=workers, append_eod=True, progress=False
    )
    return time.perf_counter() - start, _cpu_seconds() - cpu, result.output_prefixes["text"]


def run_cli(tok_args: dict[str, str], workers: int, out_dir: str) -> float:
    """One end-to-end run of ``python -m megatron_lite preprocess`` (start-up and imports included)."""
    cmd = [
        sys.executable,
        "-m",
        "megatron_lite",
        "preprocess",
        "--input",
        str(CORPUS),
        "--append-eod",
        "--workers",
        str(workers),
        "--output-prefix",
        os.path.join(out_dir, "cli"),
    ]
    for key, value in tok_args.items():
        cmd += [f"--{key.replace('_', '-')}", value]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, capture_output=True)
    return time.perf_counter() - start


def random_reads(prefix: str, n: int, seq_length: int, cache_dir: str) -> dict[str, Any]:
    """Reads per second of random GPTDataset samples (if the module imports) and random IndexedDataset slices."""
    ds = IndexedDataset(prefix)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"seq_length": seq_length, "reads": n}
    docs = rng.integers(0, len(ds), size=n)
    offsets = (rng.random(n) * np.maximum(ds.sequence_lengths[docs] - seq_length - 1, 1)).astype(np.int64)
    lengths = np.minimum(ds.sequence_lengths[docs] - offsets, seq_length + 1)
    start = time.perf_counter()
    for d, o, length in zip(docs.tolist(), offsets.tolist(), lengths.tolist()):
        ds.get(d, o, length)
    out["indexed_dataset_get_per_s"] = n / (time.perf_counter() - start)
    try:
        from megatron_lite.data.gpt_dataset import GPTDataset

        gpt = GPTDataset(ds, prefix, np.arange(len(ds), dtype=np.int32), None, seq_length, 1234, cache_dir=cache_dir)
        samples = rng.integers(0, len(gpt), size=n).tolist()
        start = time.perf_counter()
        for i in samples:
            gpt[i]
        out["gpt_dataset_samples_per_s"] = n / (time.perf_counter() - start)
        out["gpt_dataset_len"] = len(gpt)
    except Exception as err:  # noqa: BLE001 - another engineer's module may not be ready; report, don't crash
        out["gpt_dataset_error"] = f"{type(err).__name__}: {err}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=5, help="rounds of (plain, 1 worker, 2 workers)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to measure")
    p.add_argument("--reads", type=int, default=20000, help="random reads per reader")
    p.add_argument("--seq-length", type=int, default=1024, help="sample length of the random reads")
    p.add_argument("--skip-cli", action="store_true", help="skip the end-to-end command run")
    p.add_argument("--out", default=str(DEFAULT_OUT.relative_to(REPO_ROOT)), help="JSON results file")
    args = p.parse_args()

    tokenizer, tok_args = load_tokenizer()
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {"plain": [], **{f"workers_{w}": [] for w in args.workers}}
    cpu: dict[str, list[float]] = {name: [] for name in times}
    with tempfile.TemporaryDirectory() as tmp:
        _, _, reference = plain_loop(tokenizer)  # warm-up: page cache, tokenizer caches
        prefixes: dict[int, str] = {}
        for _ in range(args.repeats):
            seconds, cpu_seconds, tokens = plain_loop(tokenizer)
            times["plain"].append(seconds)
            cpu["plain"].append(cpu_seconds)
            assert np.array_equal(tokens, reference)
            for w in args.workers:
                seconds, cpu_seconds, prefixes[w] = run_preprocess(tokenizer, w, tmp)
                times[f"workers_{w}"].append(seconds)
                cpu[f"workers_{w}"].append(cpu_seconds)
                written = np.concatenate(IndexedDataset(prefixes[w])[:])
                if not np.array_equal(written, reference):
                    sys.exit(f"preprocess with {w} workers wrote different tokens than the plain loop")
        identical = (
            len(
                {
                    Path(prefixes[w] + ".bin").read_bytes() + Path(prefixes[w] + ".idx").read_bytes()
                    for w in args.workers
                }
            )
            == 1
        )
        cli_seconds = None if args.skip_cli else run_cli(tok_args, max(args.workers), tmp)
        reads = random_reads(prefixes[args.workers[0]], args.reads, args.seq_length, os.path.join(tmp, "cache"))
    load_after = os.getloadavg()

    n_tokens = int(reference.size)
    plain = statistics.median(times["plain"])
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append(
            {
                "method": "plain loop" if name == "plain" else f"preprocess --workers {name.split('_')[1]}",
                "median_s": median,
                "min_s": min(values),
                "max_s": max(values),
                "median_cpu_s": statistics.median(cpu[name]),
                "tokens_per_s": n_tokens / median,
                "vs_plain": plain / median,
            }
        )
    print(
        f"corpus: {CORPUS.name} ({n_tokens:,} tokens with EOD), tokenizer: {tok_args['tokenizer_type']}, "
        f"cpus: {os.cpu_count()}, load average before/after: {load_before[0]:.2f}/{load_after[0]:.2f}"
    )
    print(f"{'method':<24}{'median s':>10}{'min s':>8}{'max s':>8}{'CPU s':>8}{'tokens/s':>12}{'vs plain':>10}")
    for r in rows:
        print(
            f"{r['method']:<24}{r['median_s']:>10.2f}{r['min_s']:>8.2f}{r['max_s']:>8.2f}{r['median_cpu_s']:>8.2f}"
            f"{r['tokens_per_s']:>12,.0f}{r['vs_plain']:>9.2f}x"
        )
    print(f"1 and {max(args.workers)} workers byte-identical: {identical}; target at 2 workers: >= {TARGET_RATIO}x")
    if cli_seconds is not None:
        print(
            f"end to end `python -m megatron_lite preprocess --workers {max(args.workers)}`: "
            f"{cli_seconds:.2f} s ({n_tokens / cli_seconds:,.0f} tokens/s incl. interpreter start and imports)"
        )
    print(
        f"random reads, seq_length {args.seq_length}: IndexedDataset.get {reads['indexed_dataset_get_per_s']:,.0f}/s"
        + (
            f", GPTDataset[i] {reads['gpt_dataset_samples_per_s']:,.0f}/s ({reads['gpt_dataset_len']:,} samples)"
            if "gpt_dataset_samples_per_s" in reads
            else f", GPTDataset not measured ({reads['gpt_dataset_error']})"
        )
    )

    result = {
        "benchmark": "preprocess",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        "corpus": str(CORPUS.relative_to(REPO_ROOT)),
        "tokens": n_tokens,
        "tokenizer": tok_args["tokenizer_type"],
        "repeats": args.repeats,
        "times_s": times,
        "cpu_s": cpu,
        "rows": rows,
        "target_ratio_at_2_workers": TARGET_RATIO,
        "workers_byte_identical": identical,
        "cli_end_to_end_s": cli_seconds,
        "random_reads": reads,
    }
    out = REPO_ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
