"""extproc.sim.launch's port picks: free now, and never the same one twice."""

from __future__ import annotations

import socket
from pathlib import Path

from extproc.datalayer.pods_file import load_pods
from extproc.pods import Pod, PodId, PodRole
from extproc.sim.launch import free_port, write_pods_file


def test_free_port_never_hands_out_a_port_twice_in_a_process() -> None:
    # 400 random picks among ~20,000 ports would meet about 4 times without the memory.
    ports = [free_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # and free when handed out


def test_a_pods_file_written_for_pods_reads_back_as_the_same_pods(tmp_path: Path) -> None:
    pods = (
        Pod(PodId("default", "a"), "127.0.0.1:8000", frozenset({"m", "lora-1"}),
            frozenset({"lora-1"}), (("zone", "x"),)),
        Pod(PodId("ns", "b"), "127.0.0.1:8001", frozenset({"m"}), role=PodRole.DECODE),
    )  # fmt: skip
    assert load_pods(write_pods_file(pods, tmp_path / "pods.yaml")) == pods
