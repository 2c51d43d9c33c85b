"""A real S3-compatible server for tests: moto's standalone server, in a subprocess on 127.0.0.1 at a free port, with
the AWS environment (endpoint, credentials, region) that botocore -- and so s3fs -- reads pointed at it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from typing import Iterator

ENVIRONMENT = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_listening(port: int, process: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto's server exited with {process.returncode} before it listened on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"moto's server did not listen on {port} within {timeout} s")


@contextlib.contextmanager
def s3_server(port: int | None = None, check_credentials: bool = False) -> Iterator[str]:
    """Start the server (``port``: a free one when None); yields its endpoint URL; stops it at the end.
    ``check_credentials``: the server authenticates every request against the keys its IAM issued (none: every
    key is refused, as AWS refuses a key it does not know)."""
    port = port or free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **ENVIRONMENT, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if check_credentials else {})},
    )
    try:
        _wait_until_listening(port, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def skip_without_s3_tools() -> None:
    """Skip the calling test unless moto's server and s3fs are installed (dev dependencies)."""
    import pytest

    pytest.importorskip("moto.server", reason="the object-storage tests need moto[s3,server] (a dev dependency)")
    pytest.importorskip("s3fs", reason="the object-storage tests need s3fs (megatron-lite[s3])")


@contextlib.contextmanager
def s3_environment(endpoint: str) -> Iterator[None]:
    """The AWS variables botocore reads, pointed at ``endpoint`` (forked ranks inherit them). fsspec keeps one S3 file
    system per process and settings, made when the environment was another one: dropped on the way in and out."""
    import pytest
    import s3fs

    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**ENVIRONMENT, "AWS_ENDPOINT_URL": endpoint}.items():
            patch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3"):
            patch.delenv(name, raising=False)
        s3fs.S3FileSystem.clear_instance_cache()
        try:
            yield
        finally:
            s3fs.S3FileSystem.clear_instance_cache()


def make_bucket(name: str) -> None:
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
