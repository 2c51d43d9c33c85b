"""Indexed datasets in an object store (issue 28), against a real S3 server (moto's, in a subprocess on loopback):
``megatron-lite preprocess --output-prefix s3://...`` uploads the same .bin/.idx it writes locally; a GPTDataset over
the URL gives the local dataset's samples, fetching exactly their bytes by ranged reads (the .idx once, cached
locally by ETag and size); a TP2 fit reading from the bucket has the local fit's losses; a read while the server
restarts is retried until it is back, a server that stays down and a truncated object are one error naming the
object."""

import contextlib
import gzip
import json
import multiprocessing
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lite.cli import main as cli
from megatron_lite.core.object_store import ObjectStoreError
from megatron_lite.data import PretrainDataModule, TextCorpusDataModule
from megatron_lite.data.blended import BlendedDataset
from megatron_lite.data.calibration import calibration_batches
from megatron_lite.data.datamodule import ResumableDataLoader
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.preference import PreferenceDataModule
from megatron_lite.data.preprocess import merge
from megatron_lite.data.rl_prompts import RLPromptDataModule
from megatron_lite.data.samplers import MegatronPretrainingSampler
from megatron_lite.data.sft import SFTDataModule
from megatron_lite.tokenizers import build_tokenizer

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "distributed"))
sys.path.insert(0, str(HERE))
from parity_utils import run, tiny_config  # noqa: E402
from s3_server import TcpProxy, free_port, make_bucket, s3_environment, s3_server, skip_without_s3_tools  # noqa: E402

BUCKET = "data"
VOCAB = 1000
SEQ = 32


@pytest.fixture(scope="module")
def server():
    """One server for the module, the AWS environment pointed at it, and a bucket. Yields the server's endpoint."""
    skip_without_s3_tools()
    with s3_server() as endpoint, s3_environment(endpoint):
        make_bucket(BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def corpus(server, tmp_path_factory):
    """One corpus preprocessed twice through the CLI: to local disk and to the bucket. Yields (local prefix, URL
    prefix)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    documents = [[rng.randrange(VOCAB) for _ in range(rng.randrange(5, 60))] for _ in range(80)]
    lines = [json.dumps({"text": " ".join(map(str, tokens))}) for tokens in documents]
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    for prefix in (str(root / "shk"), f"s3://{BUCKET}/shk"):
        arguments = ["--input", str(root / "corpus.jsonl"), "--output-prefix", prefix]
        with pytest.raises(SystemExit) as done:
            cli(["preprocess", *arguments, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)])
        assert done.value.code == 0
    return str(root / "shk_text_document"), f"s3://{BUCKET}/shk_text_document"


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def test_preprocess_uploads_the_pair_it_writes_locally(corpus):
    local, url = corpus
    for suffix in (".bin", ".idx"):
        assert _fs().cat_file(url + suffix) == Path(local + suffix).read_bytes()


def test_a_dataset_in_the_bucket_gives_the_local_samples_fetching_exactly_their_bytes(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    local, url = corpus
    on_disk, in_bucket = _datasets(local, url, tmp_path)
    assert len(in_bucket) == len(on_disk) > 8
    for index in range(len(on_disk)):
        np.testing.assert_array_equal(in_bucket.tokens(index), on_disk.tokens(index))
    needed = sum(length for i in range(len(in_bucket)) for _, _, length in in_bucket.reads(i)) * 2  # uint16 tokens
    remote = in_bucket.dataset.remote
    assert remote is not None and remote.bytes_fetched == needed and remote.size > needed / 2
    # the .idx was downloaded once, into the local cache, named by the object's ETag and size
    (copy,) = (tmp_path / "cache" / "megatron-lite" / "object-store").glob("*.idx")
    assert copy.read_bytes() == Path(local + ".idx").read_bytes()
    IndexedDataset(url)
    assert len(list(copy.parent.glob("*.idx"))) == 1


def _datasets(local: str, url: str, cache: Path) -> list[GPTDataset]:
    datasets = []
    for prefix in (local, url):
        data = IndexedDataset(prefix)
        docs = np.arange(len(data), dtype=np.int64)
        datasets.append(GPTDataset(data, prefix, docs, None, SEQ, 1234, "train", cache_dir=str(cache / prefix[-5:])))
    return datasets


def test_dataloader_workers_forked_after_a_read_read_the_bucket_too(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    on_disk, in_bucket = _datasets(*corpus, tmp_path)
    in_bucket.tokens(0)  # this process's connections and read-ahead thread exist when the workers fork
    loader = torch.utils.data.DataLoader(
        in_bucket, batch_size=len(in_bucket), num_workers=1, multiprocessing_context="fork", timeout=60
    )
    (batch,) = list(loader)
    expected = np.stack([on_disk.tokens(i) for i in range(len(on_disk))])
    np.testing.assert_array_equal(batch["tokens"].numpy(), expected)


def _rank_dataset(prefix: str, cache: Path, blended: bool):
    """One GPTDataset over ``prefix`` (its own IndexedDataset, so its own RemoteFile), or a blend of two."""
    datasets = []
    for seed in (1234, 99) if blended else (1234,):
        data = IndexedDataset(prefix)
        docs = np.arange(len(data), dtype=np.int64)
        datasets.append(GPTDataset(data, prefix, docs, None, SEQ, seed, "train", cache_dir=str(cache)))
    if not blended:
        return datasets[0]
    return BlendedDataset(datasets, [0.5, 0.5], min(len(d) for d in datasets))


def _bytes_needed(dataset, indices) -> dict:
    """Bytes of the samples ``indices`` of ``dataset`` per RemoteFile (a blend's samples are its datasets')."""
    if isinstance(dataset, BlendedDataset):
        parts = [(dataset.datasets[dataset.dataset_index[n]], int(dataset.dataset_sample_index[n])) for n in indices]
    else:
        parts = [(dataset, n) for n in indices]
    needed = {gpt.dataset.remote: 0 for gpt in getattr(dataset, "datasets", [dataset])}
    for gpt, i in parts:
        needed[gpt.dataset.remote] += sum(length for _, _, length in gpt.reads(i)) * 2  # uint16 tokens
    return needed


@pytest.mark.parametrize("blended", [False, True], ids=["one-prefix", "blended"])
def test_under_dp2_each_rank_fetches_exactly_its_samples_and_reads_its_next_batch_ahead(
    corpus, tmp_path, monkeypatch, blended
):
    """Each DP rank's loader (the datamodule's loader class and Megatron's sampler, no workers) fetches the bytes of
    its own samples and no others, gives the local dataset's samples, and has the next batch fetched (by the
    read-ahead thread) once the first batch is read."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    local, url = corpus
    gbs, dp = 4, 2
    for rank in range(dp):
        on_disk = _rank_dataset(local, tmp_path / "local", blended)
        in_bucket = _rank_dataset(url, tmp_path / "bucket", blended)
        batches = list(MegatronPretrainingSampler(len(in_bucket), 0, gbs, dp, rank).iter_batches())
        assert len(batches) > 4
        sampler = MegatronPretrainingSampler(len(in_bucket), 0, gbs, dp, rank)
        loader = iter(ResumableDataLoader(in_bucket, batch_size=gbs // dp, sampler=sampler, drop_last=True))
        got = [next(loader)]

        # the read-ahead: once batch 0 is read, batch 1's bytes arrive without being asked for (and nothing else)
        ahead = _bytes_needed(in_bucket, batches[0] + batches[1])
        deadline = time.monotonic() + 60
        while any(remote.bytes_fetched < n for remote, n in ahead.items()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {remote: remote.bytes_fetched for remote in ahead} == ahead

        got += list(loader)
        assert len(got) == len(batches)
        for batch, indices in zip(got, batches):
            expected = torch.stack([on_disk[i]["tokens"] for i in indices])
            torch.testing.assert_close(batch["tokens"], expected, rtol=0, atol=0)
        needed = _bytes_needed(in_bucket, [i for indices in batches for i in indices])
        assert {remote: remote.bytes_fetched for remote in needed} == needed
        assert all(n > 0 for n in needed.values())


def test_with_worker_processes_the_main_process_fetches_nothing(corpus, tmp_path, monkeypatch):
    """With workers the sampler (main process) cannot reach the dataset copies that read: it announces nothing, so the
    main process's copy fetches no bytes, and the workers give the rank's samples (the DataLoader's prefetch reads
    ahead there)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    on_disk, in_bucket = _datasets(*corpus, tmp_path)
    sampler = MegatronPretrainingSampler(len(in_bucket), 0, 4, 2, 1)
    batches = list(MegatronPretrainingSampler(len(in_bucket), 0, 4, 2, 1).iter_batches())
    loader = ResumableDataLoader(
        in_bucket, batch_size=2, sampler=sampler, num_workers=1, multiprocessing_context="fork", timeout=60
    )
    got = list(loader)
    assert len(got) == len(batches) and in_bucket.dataset.remote.bytes_fetched == 0
    for batch, indices in zip(got, batches):
        np.testing.assert_array_equal(batch["tokens"].numpy(), np.stack([on_disk.tokens(i) for i in indices]))


def test_a_server_that_stopped_is_one_error_naming_the_object_after_bounded_retries(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    local, _ = corpus
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(s3_server())
        stack.enter_context(s3_environment(endpoint))
        make_bucket("other")
        for suffix in (".bin", ".idx"):
            _fs().put_file(local + suffix, f"s3://other/shk{suffix}")
        dataset = IndexedDataset("s3://other/shk")
        np.testing.assert_array_equal(dataset[0], IndexedDataset(local)[0])
        stack.pop_all().close()  # the server stops; the environment still points at it
        with pytest.raises(ObjectStoreError, match=r"s3://other/shk.bin: the object store at .* cannot be reached"):
            dataset[1]


def test_a_read_while_the_server_restarts_is_retried_until_it_is_back_and_the_read_ahead_goes_on(
    server, corpus, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "10")  # a window of seconds at least: backoffs up to 1, 2, 4, ... s
    local, url = corpus
    with TcpProxy(server) as proxy, s3_environment(proxy.endpoint):
        on_disk, in_bucket = _datasets(local, url, tmp_path)
        in_bucket.prefetch_samples([1, 2])
        np.testing.assert_array_equal(in_bucket.tokens(0), on_disk.tokens(0))  # connections open, reads ahead started
        proxy.stop()  # the server goes down: open connections are cut, new ones refused
        restart = threading.Timer(0.5, proxy.start)  # ... and is back, with its objects, half a second later
        restart.start()
        later, ahead = 16, range(17, 25)
        try:
            in_bucket.prefetch_samples(list(ahead))  # a sampler's announcement during the outage: they meet it too
            np.testing.assert_array_equal(in_bucket.tokens(later), on_disk.tokens(later))  # never announced
        finally:
            restart.join()
        for index in ahead:  # what the read-ahead thread fetched through the outage
            np.testing.assert_array_equal(in_bucket.tokens(index), on_disk.tokens(index))
        in_bucket.dataset.remote.close()  # its reads ahead of these are not for the tests after this one


def test_a_process_whose_store_is_down_exits_without_waiting_for_its_reads_ahead(corpus):
    """Reads ahead are never worth waiting for at exit: each one queued would spend its retries on a store that is
    down (seconds to minutes) before the process could end -- after an error, say."""
    remote = IndexedDataset(corpus[1]).remote
    assert remote is not None
    with s3_environment(f"http://127.0.0.1:{free_port()}"):  # the store is down: nothing listens there
        # a forked process makes its own connections and read-ahead thread, queues reads ahead, and ends
        reads = [(offset, 2) for offset in range(0, 32, 2)]
        child = multiprocessing.get_context("fork").Process(target=remote.prefetch, args=(reads,))
        child.start()
        child.join(timeout=30)  # a hang, not a timing: it ends at once, or after minutes of retries
        hung = child.exitcode is None
        if hung:
            child.kill()
            child.join()
    assert not hung and child.exitcode == 0


def test_reads_of_the_ranges_whose_read_ahead_close_dropped_fetch_them(corpus):
    local, url = corpus
    remote = IndexedDataset(url).remote
    assert remote is not None
    reads = [(offset, 2) for offset in range(0, 64, 2)]
    remote.prefetch(reads)
    remote.close()  # the thread is fetching the first: the others are dropped
    expected = Path(local + ".bin").read_bytes()
    assert [remote.read(*read) for read in reads] == [expected[offset : offset + n] for offset, n in reads]


def test_a_truncated_object_is_one_error_naming_it(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    local, url = corpus
    fs = _fs()
    truncated = f"s3://{BUCKET}/truncated_text_document"
    fs.pipe_file(truncated + ".idx", Path(local + ".idx").read_bytes())
    fs.pipe_file(truncated + ".bin", Path(local + ".bin").read_bytes()[:-10])
    with pytest.raises(ValueError, match=rf"{truncated}.bin has \d+ bytes but .* one of them is truncated"):
        IndexedDataset(truncated)


def test_a_tp2_fit_reading_from_the_bucket_has_the_local_fits_losses(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    local, url = corpus
    config = tiny_config(vocab_size=VOCAB, seq_length=SEQ)
    losses = []
    for prefix in (local, url):
        data = PretrainDataModule(
            [prefix],
            seq_length=SEQ,
            micro_batch_size=2,
            global_batch_size=4,
            vocab_size=VOCAB,
            split="98,2,0",
            cache_dir=str(tmp_path / prefix[-5:] / "indices"),
        )
        losses.append(run(tmp_path / prefix[-5:], devices=2, tp=2, steps=3, gbs=4, config=config, data=data)["losses"])
    assert len(losses[0]) == 3 and losses[1] == losses[0]
    assert len(list((tmp_path / "cache").rglob("*.idx"))) == 1  # the bucket's .idx was read (in the launching process)


# --- corpora and tokenizer files in the bucket --------------------------------------------------------------------
SPM = HERE.parents[0] / "data" / "tokenizers" / "llama-sp" / "tokenizer.model"  # tests/data/README.md: origin, licence
PARTS = ("part-0.jsonl", "part-1.jsonl.gz", "part-2.parquet")
WORDS = (
    "to be or not that is the question whether tis nobler in mind suffer slings arrows of outrageous fortune".split()
)
JSONL_MODULES = {
    "sft": lambda i, r: {"messages": [{"role": "user", "content": r(5)}, {"role": "assistant", "content": r(8)}]},
    "preference": lambda i, r: {"prompt": r(4), "chosen": r(6), "rejected": r(3)},
    "rl": lambda i, r: {"prompt": r(4), "answer": str(i)},
}


@pytest.fixture(scope="module")
def raw(corpus, tmp_path_factory):
    """Raw inputs, locally and in the bucket (under raw/): three corpus parts (plain and gzipped JSON lines, parquet),
    the JSONL files of the data modules and a SentencePiece model. Yields the local folder."""
    root = tmp_path_factory.mktemp("raw")
    rng = random.Random(1)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    lines = [json.dumps({"text": text(rng.randrange(3, 30))}) for _ in range(40)]
    (root / "part-0.jsonl").write_text("\n".join(lines[:25]) + "\n")
    (root / "part-1.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines[25:]) + "\n").encode()))
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": [text(12) for _ in range(6)]}), root / "part-2.parquet")
    for name, row in JSONL_MODULES.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row(i, text)) + "\n" for i in range(12)))
    shutil.copy(SPM, root / "tokenizer.model")
    fs = _fs()  # one client: making one costs ~0.5 s
    for path in root.iterdir():
        fs.put_file(str(path), f"s3://{BUCKET}/raw/{path.name}")
    yield root


def _copies(cache: Path) -> list[str]:
    """The names of the local copies of objects in the object cache (not the caches made beside them)."""
    folder = cache / "megatron-lite" / "object-store"
    copies = folder.iterdir() if folder.is_dir() else []
    return sorted(p.name.rsplit("-", 1)[-1] for p in copies if not p.name.startswith("."))


def test_preprocess_streams_a_corpus_in_the_bucket_and_reads_a_tokenizer_from_it(raw, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    runs = {
        "local": ([str(raw / name) for name in PARTS], str(raw / "tokenizer.model")),
        "bucket": ([f"s3://{BUCKET}/raw/part-*"], f"s3://{BUCKET}/raw/tokenizer.model"),  # a glob over the prefix
    }
    for name, (inputs, model) in runs.items():
        arguments = ["--input", *inputs, "--output-prefix", str(tmp_path / name), "--append-eod", "--no-progress"]
        with pytest.raises(SystemExit) as done:
            cli(["preprocess", *arguments, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model])
        assert done.value.code == 0
    for suffix in (".bin", ".idx"):
        local = (tmp_path / f"local_text_document{suffix}").read_bytes()
        assert (tmp_path / f"bucket_text_document{suffix}").read_bytes() == local
    assert len(IndexedDataset(str(tmp_path / "bucket_text_document"))) == 46
    assert _copies(tmp_path / "cache") == ["tokenizer.model"]  # the corpus was streamed, not copied


def test_merge_reads_and_writes_pairs_in_the_bucket(corpus, tmp_path):
    local, url = corpus
    fs = _fs()
    for suffix in (".bin", ".idx"):
        shutil.copy(local + suffix, tmp_path / f"again{suffix}")
        fs.copy(url + suffix, f"s3://{BUCKET}/again{suffix}")
    merge([local, str(tmp_path / "again")], str(tmp_path / "merged"))
    merge([url, f"s3://{BUCKET}/again.idx"], f"s3://{BUCKET}/merged")
    for suffix in (".bin", ".idx"):
        assert fs.cat_file(f"s3://{BUCKET}/merged{suffix}") == (tmp_path / f"merged{suffix}").read_bytes()


def _jsonl_module(name: str, path: str, tokenizer):
    sizes = {"seq_length": 64, "micro_batch_size": 1, "global_batch_size": 2}
    if name == "sft":
        return SFTDataModule(path, tokenizer, split="80,20", **sizes)
    if name == "preference":
        return PreferenceDataModule(path, tokenizer, split="80,20", **sizes)
    return RLPromptDataModule(tokenizer, path=path, split="80,20", **sizes)


@pytest.mark.parametrize("name", sorted(JSONL_MODULES))
def test_a_jsonl_data_module_reads_its_file_from_the_bucket(raw, name, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(raw / "tokenizer.model"))
    modules = [
        _jsonl_module(name, path, tokenizer) for path in (str(raw / f"{name}.jsonl"), f"s3://{BUCKET}/raw/{name}.jsonl")
    ]
    for module in modules:
        module.setup()
    for split in ("train", "validation"):
        expected = modules[0].datasets[split]
        assert len(modules[1].datasets[split]) == len(expected) > 0
        for index in range(len(expected)):
            _assert_same_sample(modules[1].datasets[split][index], expected[index])
    assert _copies(tmp_path / "cache") == [f"{name}.jsonl"]  # one local copy, read by every rank


def _assert_same_sample(got, expected) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value


def test_calibration_streams_a_corpus_in_the_bucket(raw, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(raw / "tokenizer.model"))
    batches = [
        calibration_batches(source, tokenizer, seq_length=16, batch_size=2, count=2)
        for source in (str(raw / "part-1.jsonl.gz"), f"s3://{BUCKET}/raw/part-1.jsonl.gz")
    ]
    assert len(batches[1]) == 2 and all(torch.equal(b["tokens"], a["tokens"]) for a, b in zip(*batches))
    assert _copies(tmp_path / "cache") == []


def test_a_missing_object_is_one_error_naming_its_url(raw, tmp_path, monkeypatch, capsys):  # noqa: ARG001
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    missing = f"s3://{BUCKET}/raw/missing.jsonl"
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=VOCAB)
    with pytest.raises(SystemExit) as done:
        arguments = ["--input", missing, "--output-prefix", str(tmp_path / "x"), "--vocab-size", str(VOCAB)]
        cli(["preprocess", *arguments, "--tokenizer-type", "null"])
    assert done.value.code == 2 and missing in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match=f"{missing}: no objects under this prefix"):
        SFTDataModule(missing, tokenizer)
    with pytest.raises(FileNotFoundError, match=f"{missing}.model: no objects under this prefix"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=missing + ".model")
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such object in the store"):
        build_tokenizer("SentencePieceTokenizer", train_corpus=missing, vocab_size=300, output_prefix=tmp_path / "spm")
    with pytest.raises(FileNotFoundError, match=f"--data {missing}: .* no object {missing}"):
        calibration_batches(missing, tokenizer, seq_length=16, batch_size=2, count=2)


def test_a_sentencepiece_model_trains_on_a_corpus_streamed_from_the_bucket(raw, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    models = [
        build_tokenizer("SentencePieceTokenizer", train_corpus=corpus, vocab_size=300, output_prefix=tmp_path / name)
        for name, corpus in (("local", raw / "part-0.jsonl"), ("bucket", f"s3://{BUCKET}/raw/part-0.jsonl"))
    ]
    local, streamed = ([m.detokenize([i]) for i in range(m.vocab_size)] for m in models)  # (the files name their paths)
    assert streamed == local and len(local) == 300
    assert models[1].tokenize("To be or not to be") == models[0].tokenize("To be or not to be")
    assert _copies(tmp_path / "cache") == []
    # trained into the bucket: the pair is uploaded, and a tokenizer read back from there is the same model
    url = f"s3://{BUCKET}/tokenizers/trained"
    build_tokenizer("SentencePieceTokenizer", train_corpus=raw / "part-0.jsonl", vocab_size=300, output_prefix=url)
    again = build_tokenizer("SentencePieceTokenizer", tokenizer_model=url + ".model")
    assert [again.detokenize([i]) for i in range(again.vocab_size)] == local
    assert _fs().exists(url + ".vocab")


def test_a_text_corpus_module_reads_its_corpus_and_tokenizer_from_the_bucket(raw, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sizes = {"seq_length": 16, "micro_batch_size": 1, "global_batch_size": 2, "split": "80,20"}
    local, in_bucket = (
        TextCorpusDataModule(f"{root}/part-1.jsonl.gz", tokenizer_model=f"{root}/tokenizer.model", **sizes)
        for root in (str(raw), f"s3://{BUCKET}/raw")
    )
    for module in (local, in_bucket):
        module.setup()
    for split in ("train_dataset", "val_dataset"):
        expected = getattr(local, split).tokens
        np.testing.assert_array_equal(getattr(in_bucket, split).tokens, expected)
        assert len(expected) > 16
    assert _copies(tmp_path / "cache") == ["1.jsonl.gz", "tokenizer.model"]
