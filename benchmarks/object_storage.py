#!/usr/bin/env python
"""Indexed datasets from object storage: samples/s read from a local S3 server against local disk, and the bytes
fetched against the bytes the samples need.

One synthetic corpus (``--documents`` documents of random uint16 tokens, lengths uniform in 1..2 x
``--mean-length``) is written locally with ``IndexedDatasetBuilder`` and uploaded to a moto S3 server started on
127.0.0.1 (tests/integration/s3_server.py; the server keeps objects in memory, so the figures are those of a
network round trip over loopback, not of a real store's latency). A rank's reads are replayed as a fit makes them: the
datamodule's loader (``ResumableDataLoader``, no workers) over ``GPTDataset`` with Megatron's sequential sampler, the
first ``--samples`` samples in global batches of ``--global-batch-size``, with ``--compute-ms`` of simulated step time
per sample of the rank's batch, read

- from local disk (memory-mapped ``.bin``);
- from the server without read-ahead (every read waits for its ranged GET);
- from the server with read-ahead (the sampler hands each next batch of the rank to the dataset, whose reads start
  in a background thread);
- the same at data-parallel size 2: rank 0 and rank 1, one after the other in this process, each with its own
  dataset (its own connections and counters) reading only its half of each global batch.

samples/s is the median of ``--repeats`` passes (each with a fresh dataset: nothing cached); ``bytes fetched`` is what
the ``.bin``'s reads received (``RemoteFile.bytes_fetched``), ``bytes needed`` the tokens of the samples the rank read,
and the ``.idx`` download is reported apart (once per ETag and size, then cached locally).

Nothing is asserted. Run from the repository root (needs ``megatron-lite[s3]`` and ``moto[s3,server]``):
``python benchmarks/object_storage.py [--documents 4000 --samples 2000 ...]``; JSON in
``benchmarks/results/object_storage.json``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported; see overhead.py

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT, REPO_ROOT / "tests" / "integration"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from s3_server import ENVIRONMENT, s3_server  # noqa: E402

from megatron_lite.data.datamodule import ResumableDataLoader  # noqa: E402
from megatron_lite.data.gpt_dataset import GPTDataset  # noqa: E402
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from megatron_lite.data.samplers import MegatronPretrainingSampler  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "object_storage.json"
BUCKET = "bench"


def write_corpus(prefix: str, documents: int, mean_length: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for length in rng.integers(1, 2 * mean_length, size=documents):
        builder.add_document(rng.integers(0, 50000, size=int(length), dtype=np.uint16), [int(length)])
    builder.finalize(prefix + ".idx")


def one_pass(prefix: str, args: argparse.Namespace, read_ahead: bool, dp: int, rank: int, cache: str) -> dict:
    """Open the dataset (nothing cached in memory) and read rank ``rank``'s batches of the first ``args.samples``."""
    data = IndexedDataset(prefix)
    dataset = GPTDataset(
        data, prefix, np.arange(len(data)), args.samples, args.seq_length, 1234, "train", cache_dir=cache
    )
    sampler_args = (args.samples, 0, args.global_batch_size, dp, rank)
    sampler = MegatronPretrainingSampler(*sampler_args)
    loader = ResumableDataLoader(dataset, batch_size=args.global_batch_size // dp, sampler=sampler, drop_last=True)
    if not read_ahead:
        sampler.read_ahead = None  # the hook the loader set: every read then waits for its GET
    indices = [i for batch in MegatronPretrainingSampler(*sampler_args).iter_batches() for i in batch]
    read = 0
    start = time.perf_counter()
    for batch in loader:
        read += len(batch["tokens"])
        time.sleep(args.compute_ms / 1e3 * len(batch["tokens"]))  # the step's compute, which read-ahead overlaps
    seconds = time.perf_counter() - start
    assert read == len(indices)
    needed = sum(length for i in indices for _, _, length in dataset.reads(i)) * data.index.itemsize
    remote = data.remote
    row = {"seconds": seconds, "samples_per_s": len(indices) / seconds, "bytes_needed": needed}
    if remote is not None:
        row.update(bytes_fetched=remote.bytes_fetched, requests=remote.requests, bin_bytes=remote.size)
        remote.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--documents", type=int, default=4000, help="documents in the corpus")
    p.add_argument("--mean-length", type=int, default=800, help="mean document length, tokens")
    p.add_argument("--samples", type=int, default=1000, help="samples one pass reads")
    p.add_argument("--seq-length", type=int, default=1024, help="sample length")
    p.add_argument("--global-batch-size", type=int, default=16, help="samples per step over the DP ranks")
    p.add_argument("--compute-ms", type=float, default=2.0, help="simulated compute per sample")
    p.add_argument("--repeats", type=int, default=3, help="passes per reader (median)")
    p.add_argument("--out", default=str(DEFAULT_OUT.relative_to(REPO_ROOT)), help="JSON results file")
    args = p.parse_args()

    load_before = os.getloadavg()
    readers = {  # name: (on the server, read-ahead, DP size, rank)
        "local disk": (False, True, 1, 0),
        "s3, no read-ahead": (True, False, 1, 0),
        "s3, read-ahead": (True, True, 1, 0),
        "s3, read-ahead, DP2 rank 0": (True, True, 2, 0),
        "s3, read-ahead, DP2 rank 1": (True, True, 2, 1),
    }
    rows: dict[str, list[dict]] = {name: [] for name in readers}
    with tempfile.TemporaryDirectory() as tmp, s3_server() as endpoint:
        os.environ.update({**ENVIRONMENT, "AWS_ENDPOINT_URL": endpoint, "XDG_CACHE_HOME": os.path.join(tmp, "xdg")})
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(BUCKET)
        local = os.path.join(tmp, "corpus")
        write_corpus(local, args.documents, args.mean_length, seed=0)
        url = f"s3://{BUCKET}/corpus"
        for suffix in (".bin", ".idx"):
            fs.put_file(local + suffix, url + suffix)
        start = time.perf_counter()
        IndexedDataset(url)  # the .idx downloaded once into the local cache
        idx_seconds = time.perf_counter() - start
        for _ in range(args.repeats):
            for name, (remote, read_ahead, dp, rank) in readers.items():
                cache = os.path.join(tmp, f"indices-{name}")
                rows[name].append(one_pass(url if remote else local, args, read_ahead, dp, rank, cache))
    load_after = os.getloadavg()

    summary = []
    for name, passes in rows.items():
        median = statistics.median(r["samples_per_s"] for r in passes)
        last = passes[-1]
        summary.append({"reader": name, "samples_per_s": median, **{k: v for k, v in last.items() if "bytes" in k}})
        summary[-1]["requests"] = last.get("requests")
    print(
        f"corpus: {args.documents} documents, {rows['s3, read-ahead'][0]['bin_bytes']:,} bytes of .bin; "
        f"{args.samples} samples of {args.seq_length} tokens in global batches of {args.global_batch_size}, "
        f"{args.compute_ms} ms compute each; "
        f".idx download {idx_seconds * 1e3:.0f} ms (once); cpus {os.cpu_count()}, load {load_before[0]:.2f}/"
        f"{load_after[0]:.2f}"
    )
    print(f"{'reader':<28}{'samples/s':>11}{'bytes needed':>15}{'bytes fetched':>15}{'fetched/needed':>16}{'GETs':>7}")
    for row in summary:
        fetched = row.get("bytes_fetched")
        ratio = f"{fetched / row['bytes_needed']:.3f}" if fetched is not None else "-"
        print(
            f"{row['reader']:<28}{row['samples_per_s']:>11,.0f}{row['bytes_needed']:>15,}"
            f"{fetched if fetched is not None else '-':>15}{ratio:>16}{row['requests'] or '-':>7}"
        )
    result = {
        "benchmark": "object_storage",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        "settings": vars(args),
        "idx_download_s": idx_seconds,
        "summary": summary,
        "passes": rows,
    }
    out = REPO_ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
