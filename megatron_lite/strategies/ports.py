"""The rendezvous port of a run whose ranks this machine starts (the fork/spawn launcher), when the user set none.

Lightning picks one by binding port 0: an *ephemeral* port, free at that instant, which the kernel may hand to any
outgoing connection (a gloo pair of another job, an HTTP client) before the rendezvous binds it -- on a busy machine
the run then dies at start-up with EADDRINUSE. A port below the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``) is never handed out that way: only another explicit ``bind`` could take
it in between.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Optional

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000
"""The lowest port chosen: above the well-known and most registered service ports."""


def ephemeral_range_start(path: Path = EPHEMERAL_RANGE) -> Optional[int]:
    """The first port of the kernel's ephemeral range, or None where it cannot be read (not Linux)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def rendezvous_port(attempts: int = 64, path: Path = EPHEMERAL_RANGE) -> Optional[int]:
    """A port free now, below the ephemeral range (``LOWEST_PORT`` or more); None when the range is unknown or
    leaves no room, or when no free one was found -- then Lightning's own choice stands."""
    start = ephemeral_range_start(path)
    if start is None or start <= LOWEST_PORT:
        return None
    draw = random.Random()  # its own generator: a seeded run's draws stay as they were
    for _ in range(attempts):
        port = draw.randrange(LOWEST_PORT, start)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("", port))  # as the rendezvous store will (no SO_REUSEADDR: TIME_WAIT is not free)
            except OSError:
                continue
        return port
    return None
