"""The fork/spawn launcher's rendezvous port is chosen below the kernel's ephemeral range, where no outgoing
connection can take it between the choice and the rendezvous's bind (Lightning's bind-to-0 port can be taken)."""

import socket

import pytest

from megatron_lite.strategies.ports import LOWEST_PORT, ephemeral_range_start, rendezvous_port


def test_the_port_is_free_and_below_the_ephemeral_range(tmp_path):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    ports = {rendezvous_port(path=ranges) for _ in range(20)}
    assert None not in ports and all(LOWEST_PORT <= port < 32768 for port in ports)
    assert len(ports) > 1  # drawn, not one fixed port that two runs on a machine would both take
    port = ports.pop()
    with socket.socket() as s:
        s.bind(("", port))  # free: the probe's socket was closed


def test_no_port_where_the_range_is_unknown_or_leaves_no_room(tmp_path):
    assert rendezvous_port(path=tmp_path / "missing") is None  # not Linux: Lightning's own choice stands
    low = tmp_path / "low"
    low.write_text(f"{LOWEST_PORT} 60999")
    assert rendezvous_port(path=low) is None


@pytest.mark.skipif(ephemeral_range_start() is None, reason="no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
def test_this_machines_range_is_read():
    assert ephemeral_range_start() > 1024
