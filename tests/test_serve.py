"""``extproc serve`` as a process: starts on the embedded defaults, drains on SIGTERM,
refuses bad configuration with a message naming the file."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from extproc.datalayer.pods_file import DEFAULT_PODS_FILE
from extproc.launch import free_port, start_extproc


def test_serve_starts_and_drains_on_sigterm(tmp_path: Path) -> None:
    proc = start_extproc(
        DEFAULT_PODS_FILE, tmp_path, grpc_port=free_port(), metrics_port=free_port()
    )
    assert proc.stop(signal.SIGTERM) == 0
    log = proc.log_tail()
    assert "draining" in log and "stopped" in log and "Traceback" not in log


def test_serve_refuses_a_bad_config_naming_the_file(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(
        "scheduler:\n  plugins:\n    Score:\n      enabled:\n        - name: prefix-cache\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--config", str(config),
         "--grpc-port", str(free_port()), "--health-port", str(free_port()),
         "--metrics-port", str(free_port())],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"{config}: failed to Load Scheduler" in result.stderr
    assert "must set a weight greater than 0, got 0" in result.stderr
    assert "Traceback" not in result.stderr
