"""A real S3-compatible server for tests: moto's standalone server, in a subprocess on 127.0.0.1 at a free port, with
the AWS environment (endpoint, credentials, region) that botocore -- and so s3fs -- reads pointed at it; and a TCP
proxy in front of it (:class:`TcpProxy`) whose stop and restart cut and restore the network path to the server without
losing the server's objects (a restarted moto server has none)."""

from __future__ import annotations

import asyncio
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


def _wait_until_listening(
    port: int, process: subprocess.Popen, timeout: float = 30.0, name: str = "moto's server"
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode} before it listened on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.01)
    raise RuntimeError(f"{name} did not listen on {port} within {timeout} s")


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


class TcpProxy:
    """A TCP proxy on a free loopback port in front of ``endpoint`` (an ``http://127.0.0.1:port`` server), in a
    subprocess: :attr:`endpoint` is the URL to point clients at. :meth:`stop` kills it (open connections are cut,
    new ones refused, as when the server goes down); :meth:`start` starts it again on the same port (the server is
    back, with its objects). A context manager: stopped at the end."""

    def __init__(self, endpoint: str) -> None:
        self.target = int(endpoint.rsplit(":", 1)[1])
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        assert self._process is None, "the proxy is running"
        self._process = subprocess.Popen([sys.executable, __file__, str(self.port), str(self.target)])
        _wait_until_listening(self.port, self._process, name="the TCP proxy")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait(timeout=10)

    def __enter__(self) -> "TcpProxy":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


async def _forward(port: int, target: int) -> None:
    """Accept on ``port``; copy each connection's bytes both ways to a connection to ``target``."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    server = await asyncio.start_server(serve, "127.0.0.1", port)  # SO_REUSEADDR: a restart gets the same port
    await server.serve_forever()


if __name__ == "__main__":  # the proxy's process (TcpProxy.start)
    asyncio.run(_forward(int(sys.argv[1]), int(sys.argv[2])))
