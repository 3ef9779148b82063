"""extproc.sim.launch's port picks: free now, and never the same one twice."""

from __future__ import annotations

import socket

from extproc.sim.launch import free_port


def test_free_port_never_hands_out_a_port_twice_in_a_process() -> None:
    # 400 random picks among ~20,000 ports would meet about 4 times without the memory.
    ports = [free_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # and free when handed out
