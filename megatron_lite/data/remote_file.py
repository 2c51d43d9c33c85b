"""Indexed datasets read from an object store (``s3://bucket/prefix``) without copying the corpus.

- The ``.idx`` is read once and kept in a local cache, named by the object's URL, ETag and size
  (:func:`megatron_lite.core.object_staging.cached_copy`): a changed object is downloaded again, an unchanged one
  never.
- The ``.bin`` is a :class:`RemoteFile`: each read is one ranged GET of exactly the bytes asked for (a sample's
  tokens), kept in a bounded in-memory cache, and the reads a dataset announces (:meth:`RemoteFile.prefetch`: the
  next samples of this rank) are fetched ahead in a background thread, so a step does not wait on the network once
  the read-ahead keeps up.

Where the local copies go: ``$XDG_CACHE_HOME/megatron-lite/object-store`` (``~/.cache/...``), see
:func:`megatron_lite.core.object_staging.object_cache_dir`.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Iterable, Optional

from megatron_lite.core.object_staging import object_identity
from megatron_lite.core.object_store import errors_named, filesystem

_ReadAhead = Optional[tuple[tuple[int, int], "Future[bytes]"]]
"""An item of the read-ahead thread's queue: a range and the future its fetch completes; None: stop."""

DEFAULT_CACHE_BYTES = 64 << 20
"""Bytes of ``.bin`` ranges a :class:`RemoteFile` keeps in memory (fetched ahead or read recently)."""


class RemoteFile:
    """A read-only object read by ranged GETs: :meth:`read` ``(offset, length)`` returns exactly those bytes, from the
    cache when a read-ahead (:meth:`prefetch`) or an earlier read fetched them. Counts what it fetched
    (:attr:`bytes_fetched`, :attr:`requests`). A forked process (a DataLoader worker) starts with its own
    connections, cache and thread: the parent's are not usable there."""

    def __init__(self, url: str, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.url = url
        self.size, self.etag = object_identity(url)
        self.cache_bytes = cache_bytes
        self.bytes_fetched = 0
        """Bytes received from the store."""
        self.requests = 0
        """Ranged GETs sent."""
        self._start()

    def _start(self) -> None:
        """This process's connections (fsspec makes new ones in a new process), cache, lock and read-ahead thread."""
        self._pid = os.getpid()
        self._fs = filesystem(self.url)
        self._cache: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._cached = 0
        self._pending: dict[tuple[int, int], Future[bytes]] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_ReadAhead] = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def read(self, offset: int, length: int) -> bytes:
        """Bytes ``offset : offset + length`` of the object."""
        if self._pid != os.getpid():
            self._start()
        key = (offset, length)
        with self._lock:
            data = self._cache.get(key)
            if data is not None:
                self._cache.move_to_end(key)
                return data
            pending = self._pending.get(key)
        return pending.result() if pending is not None else self._fetch(key)

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Fetch the ``(offset, length)`` ranges in the background (those not cached or on their way already)."""
        if self._pid != os.getpid():
            self._start()
        with self._lock:
            if self._thread is None:
                # A daemon thread, not a ThreadPoolExecutor: the interpreter waits for an executor's queued work at
                # exit, and reads ahead from a store that is down would hold the exit for all their retries.
                self._thread = threading.Thread(
                    target=self._read_ahead, args=(self._queue,), name="megatron-lite-read-ahead", daemon=True
                )
                self._thread.start()
            for key in ranges:
                if key not in self._cache and key not in self._pending and key[1] > 0:
                    future: Future[bytes] = Future()
                    self._pending[key] = future
                    self._queue.put((key, future))

    def _read_ahead(self, work: queue.SimpleQueue[_ReadAhead]) -> None:
        """The read-ahead thread: fetch the queued ranges in order until :meth:`close` queues None."""
        while (item := work.get()) is not None:
            key, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._fetch(key))
                except BaseException as error:  # noqa: BLE001 - for the read that waits on it to raise
                    future.set_exception(error)

    def _fetch(self, key: tuple[int, int]) -> bytes:
        offset, length = key
        try:
            if offset < 0 or offset + length > self.size:
                raise ValueError(
                    f"{self.url}: bytes {offset}..{offset + length} asked for, but the object has {self.size} bytes"
                )
            with errors_named(self.url):
                data = bytes(self._fs.cat_file(self.url, start=offset, end=offset + length)) if length else b""
            if len(data) != length:
                raise ValueError(
                    f"{self.url}: a read of {length} bytes at {offset} returned {len(data)}: the object is truncated "
                    f"or was replaced while it was read (rebuild it with `megatron-lite preprocess`)"
                )
            with self._lock:
                self.bytes_fetched += len(data)
                self.requests += 1
                self._cache[key] = data
                self._cached += len(data)
                while self._cached > self.cache_bytes and len(self._cache) > 1:
                    _, dropped = self._cache.popitem(last=False)
                    self._cached -= len(dropped)
            return data
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def close(self) -> None:
        """Stop the read-ahead thread after the fetch it is doing, dropping those queued (reads still work: they fetch
        in the caller's thread)."""
        with self._lock:
            if self._thread is None:
                return
            self._thread = None
            self._queue.put(None)
            self._queue = queue.SimpleQueue()
            for key, future in list(self._pending.items()):
                if future.cancel():  # queued, not started: a read of it fetches it itself
                    del self._pending[key]
