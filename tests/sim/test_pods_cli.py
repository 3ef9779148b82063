"""``extproc sim-pods`` as a real process: flags, readiness, faults from flags, clean stop."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from extproc.sim.launch import spawn_sim_pods


def test_spawned_pods_serve_and_stop_on_sigterm() -> None:
    args = ["--model", "m1", "--name-prefix", "p", "--time-scale", "0.01",
            "--error-rate", "1", "--error-status", "503", "--fault-pods", "1"]  # fmt: skip
    with spawn_sim_pods(2, args=args) as pods:
        assert pods.pid is not None
        pid = pods.pid
        assert [p.name for p in pods.pods] == ["p-0", "p-1"]
        assert len({p.port for p in pods.pods}) == 2
        for p in pods.pods:
            assert httpx.get(p.url + "/health").status_code == 200
        body = {"model": "m1", "prompt": "hello", "max_tokens": 2}
        ok = httpx.post(pods.pods[0].url + "/v1/completions", json=body)
        assert ok.status_code == 200
        assert ok.json()["system_fingerprint"] == "p-0"
        assert httpx.post(pods.pods[1].url + "/v1/completions", json=body).status_code == 503
        assert pods.stats("p-1")["num_injected_errors"] == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: SIGTERM stopped it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--block-size", "0"], "EngineConfig.block_size must be > 0", id="block-size"),
        pytest.param(["--num-gpu-blocks", "-3"], "EngineConfig.num_gpu_blocks", id="blocks"),
        pytest.param(["--pods", "0"], "num_pods must be within", id="pods"),
        pytest.param(["--error-rate", "2"], "error_rate must be within 0..1", id="error-rate"),
        pytest.param(["--fault-pods", "5"], "fault_pods names pods outside", id="fault-pods"),
    ],
)
def test_invalid_flags_exit_2_naming_the_setting(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "extproc.sim.pods_cli", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    assert message in proc.stderr
