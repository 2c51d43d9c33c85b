"""Indexed datasets in an object store (issue 28), against a real S3 server (moto's, in a subprocess on loopback):
``megatron-lite preprocess --output-prefix s3://...`` uploads the same .bin/.idx it writes locally; a GPTDataset over
the URL gives the local dataset's samples, fetching exactly their bytes by ranged reads (the .idx once, cached
locally by ETag and size); a TP2 fit reading from the bucket has the local fit's losses; a read while the server
restarts is retried until it is back, a server that stays down and a truncated object are one error naming the
object."""

import contextlib
import json
import multiprocessing
import random
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lite.cli import main as cli
from megatron_lite.core.object_store import ObjectStoreError
from megatron_lite.data import PretrainDataModule
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.indexed_dataset import IndexedDataset

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
        np.testing.assert_array_equal(in_bucket.tokens(0), on_disk.tokens(0))  # connections open, reads ahead started
        proxy.stop()  # the server goes down: open connections are cut, new ones refused
        restart = threading.Timer(0.5, proxy.start)  # ... and is back, with its objects, half a second later
        restart.start()
        try:
            later = 2 * in_bucket.read_ahead  # not read ahead: its GET, and those read ahead of it, meet the outage
            np.testing.assert_array_equal(in_bucket.tokens(later), on_disk.tokens(later))
        finally:
            restart.join()
        for index in range(later + 1, later + 1 + in_bucket.read_ahead):  # what the read-ahead thread fetched
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
