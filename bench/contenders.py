"""The routers compared, each started on demand in front of the same pods, stopped by PID.

- ``envoy-rr``: Envoy alone, round robin (extproc's bootstrap without ext_proc).
- ``extproc``: Envoy + extproc with its shipped configuration. On main today that is
  the prefix-cache scorer alone: least-request, cost-aware and a pod-metrics scraper are
  not merged yet, so "prefix-cache only" and "defaults" are the same contender.
- ``extproc-sized``: the same with ``maxHashCacheSize`` set to what one pod's KV cache
  really holds (``index_entries``), instead of the default 50,000 entries (3.2 MB of text).
- ``sglang-router``, ``vllm-router``: the peers' Rust proxies with their ``cache_aware``
  policy and the thresholds of ``../shared/TOOLING.md``, each from its own venv
  (``python -m e2e.real_vllm.prepare --peers``).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from bench.picker import envoy_alone_config
from e2e.real_vllm.prepare import peer_binary
from extproc.envoyconf.build import EnvoyOptions
from extproc.launch import Proc, free_port, run_stack, spawn, start_envoy_config, wait_until
from extproc.types import Pod

PEER_START_TIMEOUT_S = 60.0
CACHE_AWARE = [
    "--policy", "cache_aware", "--cache-threshold", "0.3",
    "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5",
]  # fmt: skip

Serve = Callable[[Sequence[Pod], Path], AbstractContextManager[str]]


@contextmanager
def envoy_rr(pods: Sequence[Pod], log_dir: Path) -> Iterator[str]:
    options = EnvoyOptions(
        extproc_address="127.0.0.1:9", listen_port=free_port(), admin_port=free_port()
    )
    config = envoy_alone_config(list(pods), options)
    proc = start_envoy_config(config, options.admin_port, log_dir, "envoy-rr")
    try:
        yield f"http://127.0.0.1:{options.listen_port}"
    finally:
        proc.stop()


@contextmanager
def extproc(pods: Sequence[Pod], log_dir: Path) -> Iterator[str]:
    with run_stack(pods) as stack:
        yield stack.url


SIZED_CONFIG = """\
scheduler:
  plugins:
    Score:
      enabled:
        - name: prefix-cache
          weight: 1
  pluginConfig:
    - name: prefix-cache
      args:
        maxHashCacheSize: {entries}
"""


def index_entries(kv_tokens_per_pod: int, bytes_per_token: int = 4, block_bytes: int = 64) -> int:
    """Prefix-index entries (64-byte blocks of prompt) that match a pod's KV capacity."""
    return max(1, kv_tokens_per_pod * bytes_per_token // block_bytes)


def extproc_sized(entries: int) -> Serve:
    """extproc whose per-pod prefix index holds ``entries`` blocks."""

    @contextmanager
    def serve(pods: Sequence[Pod], log_dir: Path) -> Iterator[str]:
        config = log_dir / f"extproc-sized-{entries}.yaml"
        config.write_text(SIZED_CONFIG.format(entries=entries))
        with run_stack(pods, config=config) as stack:
            yield stack.url

    return serve


def _ready(url: str) -> bool:
    with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
        return bool(r.status == 200)


@contextmanager
def _peer(name: str, argv: list[str], port: int, log_dir: Path) -> Iterator[str]:
    proc: Proc = spawn(name, argv, log_dir, {"RUST_LOG": "warn"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), proc, name, PEER_START_TIMEOUT_S)
        yield url
    finally:
        proc.stop()


@contextmanager
def sglang_router(pods: Sequence[Pod], log_dir: Path) -> Iterator[str]:
    port = free_port()
    argv = [
        str(peer_binary("sglang-router")), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *[f"http://{p.address}" for p in pods], *CACHE_AWARE,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    with _peer("sglang-router", argv, port, log_dir) as url:
        yield url


@contextmanager
def vllm_router(pods: Sequence[Pod], log_dir: Path) -> Iterator[str]:
    port = free_port()
    argv = [
        str(peer_binary("vllm-router")), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *[f"http://{p.address}" for p in pods], *CACHE_AWARE,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    with _peer("vllm-router", argv, port, log_dir) as url:
        yield url


CONTENDERS: dict[str, Serve] = {
    "envoy-rr": envoy_rr,
    "extproc": extproc,
    "sglang-router": sglang_router,
    "vllm-router": vllm_router,
}
