"""``extproc serve`` with precise-prefix-cache configured: the KV-events subscriber runs
(bind topology here), and a pod's events show in its view's metrics; a bind topology
without an endpoint is refused at start-up."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from extproc.pods import Pod, PodId
from extproc.sim.kv_cache import BlockStored, TokenBlockHash
from extproc.sim.kv_events import ZmqEventPublisher
from extproc.sim.launch import free_port, start_extproc, write_pods_file
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer

pytestmark = needs_model_tokenizer
POD = Pod(PodId("default", "p0"), "127.0.0.1:8000", frozenset({"qwen3-tiny"}))
BLOCKS = 'extproc_kv_events_blocks{medium="GPU",pod="default/p0"}'


def precise_config(tmp_path: Path) -> Path:
    text = (
        Path("extproc/data/precise.yaml").read_text().replace("/models/qwen3-tiny", str(MODEL_DIR))
    )
    path = tmp_path / "precise.yaml"
    path.write_text(text)
    return path


def test_serve_feeds_the_view_from_the_pods_events(tmp_path: Path) -> None:
    events_port, metrics_port = free_port(), free_port()
    proc = start_extproc(
        write_pods_file([POD], tmp_path / "pods.yaml"),
        tmp_path,
        grpc_port=free_port(),
        metrics_port=metrics_port,
        config=precise_config(tmp_path),
        extra_args=[
            "--stale-after-s",
            "0",
            "--kv-events-topology",
            "bind",
            "--kv-events-bind",
            f"tcp://127.0.0.1:{events_port}",
        ],
    )
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{events_port}", "kv@127.0.0.1:8000@qwen3-tiny")
    try:
        deadline = time.monotonic() + 30
        page = ""
        while f"{BLOCKS} 2.0" not in page:
            assert time.monotonic() < deadline, page[-2000:]
            pub.publish(
                0.0,
                [
                    BlockStored(
                        (TokenBlockHash(1), TokenBlockHash(2)),
                        None,
                        tuple(range(32)),
                        16,
                        (None, None),
                    )
                ],
            )
            time.sleep(0.2)
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            page = urllib.request.urlopen(url, timeout=5).read().decode()
        assert "extproc_kv_events_applied_total" in page
    finally:
        pub.close()
        assert proc.stop() == 0, proc.log_tail()


def test_a_bind_topology_needs_an_endpoint(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "extproc", "serve", "--config", str(precise_config(tmp_path)),
            "--pods", str(write_pods_file([POD], tmp_path / "pods.yaml")),
            "--grpc-port", "0", "--health-port", "0", "--metrics-port", "0",
            "--kv-events-topology", "bind"]  # fmt: skip
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--kv-events-topology bind needs at least one --kv-events-bind" in done.stderr
