"""Checkpoints in an object store (issue 28), against a real S3 server (moto's, in a subprocess on loopback): a TP2
fit checkpoints to ``s3://`` through DCP's fsspec writer, resumes from ``ckpt_path="last"`` with the losses of an
uninterrupted run on local disk; a checkpoint whose commit marker is gone (a save killed before it committed) is
refused by an explicit load before any rank starts, skipped by ``last`` and deleted by the next save. A re-save of
the same name keeps the previous checkpoint loadable until its marker is replaced; a load while the server restarts
is retried until it is back. The bad cases -- a missing bucket, refused credentials, a server that is down -- are one
error naming the URL and the fix, before launch."""

import logging
import sys
import threading
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.core.checkpoint import Checkpointer
from megatron_lite.core.checkpoint.format import object_commit
from megatron_lite.core.checkpoint.format.sharded import load_sharded, save_sharded
from megatron_lite.core.object_store import ObjectStoreError
from megatron_lite.core.parallel.layout import ParallelLayout

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "distributed"))
sys.path.insert(0, str(HERE))
from parity_utils import run, tiny_config  # noqa: E402
from s3_server import TcpProxy, free_port, make_bucket, s3_environment, s3_server, skip_without_s3_tools  # noqa: E402

BUCKET = "ckpt"


@pytest.fixture(scope="module")
def s3():
    """One server for the module, the AWS environment pointed at it, and a bucket."""
    skip_without_s3_tools()
    with s3_server() as endpoint, s3_environment(endpoint):
        make_bucket(BUCKET)
        yield endpoint


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True)


def _logged(out: Path, fn):
    handler = logging.FileHandler(out)
    logger = logging.getLogger("megatron_lite")
    logger.addHandler(handler)
    try:
        result = fn()
    finally:
        logger.removeHandler(handler)
        handler.close()
    return result, out.read_text()


def test_a_tp2_fit_checkpoints_to_s3_and_resumes_from_last_like_an_uninterrupted_run(s3, tmp_path):
    run_url = f"s3://{BUCKET}/run"
    reference = run(tmp_path / "reference", devices=2, tp=2, steps=6)

    def checkpoints():
        return ModelCheckpoint(dirpath=run_url, every_n_train_steps=2, save_top_k=-1)

    # written in the background (async_save): the same writer and commit, from the writer's thread
    first = run(
        tmp_path / "first", devices=2, tp=2, steps=4, callbacks=[checkpoints()], strategy_kwargs={"async_save": True}
    )
    assert first["losses"] == reference["losses"][:4]
    fs = _fs()
    step4 = f"{run_url}/epoch=0-step=4.ckpt"
    (killed,) = [p for p in fs.ls(step4) if "/v-" in p]
    assert sorted(fs.ls(killed)) == sorted(
        f"{killed}/{n}" for n in (".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "manifest.json")
    )

    fs.rm_file(f"{step4}/{object_commit.MARKER}")  # a save killed before its marker was written
    with pytest.raises(FileNotFoundError, match=r"has no commit marker \(commit.json\): its save was interrupted"):
        run(tmp_path / "explicit", devices=2, tp=2, steps=6, ckpt_path=step4)

    resumed, log = _logged(
        tmp_path / "log.txt",
        lambda: run(tmp_path / "resumed", devices=2, tp=2, steps=6, ckpt_path="last", callbacks=[checkpoints()]),
    )
    assert "epoch=0-step=4.ckpt: no commit marker" in log  # skipped by last: step 2 resumed
    assert resumed["losses"] == reference["losses"][2:]
    torch.testing.assert_close(resumed["params"], reference["params"], rtol=0, atol=0)
    fs.invalidate_cache()
    assert not fs.exists(killed)  # the uncommitted save was deleted; step 4 was saved again and committed
    assert object_commit.data_of(step4) is not None

    # loaded at another layout as on disk: the TP2 shards of step 6 into one process's model
    module = ml.GPTModule(tiny_config())
    module.model = module.build_model(ParallelLayout.single())
    Checkpointer(module).load(f"{run_url}/epoch=0-step=6.ckpt", optimizers=False, rng=False)
    loaded = dict(module.model.named_parameters())
    assert loaded.keys() == resumed["params"].keys()
    for name, reference in resumed["params"].items():  # the recorded vocabulary rows are the unpadded ones
        got = loaded[name].detach()[tuple(slice(0, n) for n in reference.shape)]
        torch.testing.assert_close(got, reference, rtol=0, atol=0, msg=name)


def test_a_resave_keeps_the_previous_checkpoint_until_the_new_marker_replaces_it(s3):
    url = f"s3://{BUCKET}/resave/last.ckpt"
    save_sharded({"w": torch.full((4,), 1.0)}, url, extra={"global_step": 1}, latest=True)
    first = object_commit.data_of(url)
    # a second save killed after writing its files, before its marker: the first is what loads
    target = object_commit.begin(url)
    _fs().pipe_file(f"{target}/__0_0.distcp", b"partial")
    loaded = {"w": torch.zeros(4)}
    assert load_sharded(loaded, url)["global_step"] == 1 and loaded["w"].eq(1).all()
    save_sharded({"w": torch.full((4,), 2.0)}, url, extra={"global_step": 2}, latest=True)
    assert load_sharded(loaded, f"s3://{BUCKET}/resave")["global_step"] == 2 and loaded["w"].eq(2).all()
    versions = [p for p in _fs().ls(url) if "/v-" in p]
    assert versions == [object_commit.data_of(url).removeprefix("s3://")]  # the first and the killed one deleted
    assert first not in versions


def test_a_load_while_the_server_restarts_is_retried_until_it_is_back(s3, monkeypatch):
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "10")  # a window of seconds at least: backoffs up to 1, 2, 4, ... s
    url = f"s3://{BUCKET}/outage/last.ckpt"
    saved = {"w": torch.arange(4.0)}
    with TcpProxy(s3) as proxy, s3_environment(proxy.endpoint):
        save_sharded(saved, url, extra={"global_step": 3}, latest=True)
        proxy.stop()  # the server goes down: open connections are cut, new ones refused
        restart = threading.Timer(0.5, proxy.start)  # ... and is back, with its objects, half a second later
        restart.start()
        loaded = {"w": torch.zeros(4)}
        try:
            assert load_sharded(loaded, url)["global_step"] == 3
        finally:
            restart.join()
    torch.testing.assert_close(loaded["w"], saved["w"], rtol=0, atol=0)


class Started(L.Callback):
    """Each rank marks that it started (its setup ran)."""

    def __init__(self, out: Path):
        self.out = out

    def setup(self, trainer, pl_module, stage):
        (self.out / f"started-{trainer.global_rank}").touch()


def _refused_before_launch(dirpath: str, tmp_path: Path, error: str) -> None:
    """A fit checkpointing to ``dirpath`` raises ``error`` (a regex) in the launching process: no rank started."""
    callbacks = [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1), Started(tmp_path)]
    with pytest.raises(ObjectStoreError, match=error):
        run(tmp_path, devices=2, tp=2, steps=1, callbacks=callbacks)
    assert not list(tmp_path.glob("started-*"))


def test_a_missing_bucket_is_named_before_launch(s3, tmp_path):
    error = r"s3://no-such-bucket/run: the bucket 'no-such-bucket' does not exist at the endpoint .*; create it"
    _refused_before_launch("s3://no-such-bucket/run", tmp_path, error)


def test_refused_credentials_are_named_before_launch(s3, tmp_path):
    with s3_server(check_credentials=True) as endpoint, s3_environment(endpoint):  # it issued no key: ours is refused
        error = r"s3://ckpt/run: access denied .*; check the credentials botocore finds \(AWS_ACCESS_KEY_ID"
        _refused_before_launch(f"s3://{BUCKET}/run", tmp_path, error)


def test_a_server_that_is_down_is_named_before_launch_after_bounded_retries(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    with s3_environment(f"http://127.0.0.1:{free_port()}"):  # nothing listens there
        error = r"s3://ckpt/run: the object store at http://127.0.0.1:\d+ cannot be reached .* after botocore's retries"
        _refused_before_launch(f"s3://{BUCKET}/run", tmp_path, error)
