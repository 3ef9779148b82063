"""The routers compared, each started on demand in front of the same pods, stopped by PID.

- ``envoy-rr``: Envoy alone, round robin (extproc's bootstrap without ext_proc).
- ``extproc-*``: Envoy + extproc with a scheduler configuration: ``least-request`` and
  ``prefix-cache`` alone (``bench/configs/``), ``default`` (the shipped one: the
  estimated-ttft cost model), ``kthena`` (``extproc/data/kthena.yaml``, Kthena's default:
  least-request filter, least-request + gpu-usage + least-latency + prefix-cache scores)
  and ``cost-aware`` (``extproc/data/cost-aware.yaml``: Kthena's default plus cost-aware).
- ``extproc-no-lora-affinity``: the shipped default less its ``lora-affinity`` score, to
  show what that plugin adds on the ``lora`` workload; ``extproc-lora-blind``: less its
  adapter term too (estimated-ttft's ``loraLoadMs`` 0), to show what routing by adapter
  adds.
- ``extproc-default-2-replicas``: the default configuration on two extproc replicas
  behind one Envoy, records in the reply metadata, views shared through a redis-server
  (``testkit.replicas``).
- ``extproc-precise``: ``extproc/data/precise.yaml`` (the default's cost model reading
  precise-prefix-cache's exact counts), its models map naming the pods' tokenizer,
  receiving the pods' KV events; it serves once every pod's view is trusted.
- ``sglang-router``, ``vllm-router``: the peers' Rust proxies with their ``cache_aware``
  policy and the thresholds of ``../shared/TOOLING.md``, each from its own venv
  (``python -m e2e.real_vllm.prepare --peers``).
- ``sglang-rr``: sglang-router round robin, no cache policy: against ``envoy-rr`` (the
  same placement) it shows what the proxy alone adds, Envoy's against sglang-router's.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import yaml

import extproc as extproc_package
from bench.bench_pods import PodSet
from bench.envoy_timings import LOG_NAME, http_managers, timing_log
from e2e.real_vllm.prepare import peer_binary
from extproc.envoyconf.build import make_bootstrap
from extproc.envoyconf.options import EnvoyOptions
from extproc.envoyconf.render import to_dict
from extproc.pods import Pod
from extproc.sim.launch import Proc, free_port, run_stack, spawn, start_envoy_config, wait_until
from testkit.replicas import run_replicas

PEER_START_TIMEOUT_S = 60.0
CACHE_AWARE = [
    "--policy", "cache_aware", "--cache-threshold", "0.3",
    "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5",
]  # fmt: skip
ROUND_ROBIN = ["--policy", "round_robin"]

Serve = Callable[[PodSet, Path], AbstractContextManager[str]]


def envoy_alone_config(pods: list[Pod], options: EnvoyOptions) -> dict[str, Any]:
    """The generated bootstrap without extproc: router only, no access log."""
    config = to_dict(make_bootstrap(pods, options))
    for manager in http_managers(config):
        manager["http_filters"] = [
            h for h in manager["http_filters"] if h["name"].endswith("router")
        ]
        manager.pop("access_log", None)
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] != "extproc"
    ]
    return config


def start_envoy_alone(
    pods: Sequence[Pod], log_dir: Path, name: str = "envoy-rr"
) -> tuple[Proc, str]:
    """Envoy alone, round robin over ``pods``: its process and URL (stop it by ``Proc.stop``)."""
    options = EnvoyOptions(
        extproc_address="127.0.0.1:9", listen_port=free_port(), admin_port=free_port()
    )
    config = envoy_alone_config(list(pods), options)
    proc = start_envoy_config(config, options.admin_port, log_dir, name)
    return proc, f"http://127.0.0.1:{options.listen_port}"


@contextmanager
def envoy_rr(pod_set: PodSet, log_dir: Path) -> Iterator[str]:
    proc, url = start_envoy_alone(pod_set.pods, log_dir)
    try:
        yield url
    finally:
        proc.stop()


CONFIGS = Path(__file__).with_name("configs")
EXTPROC_DATA = Path(extproc_package.__file__).with_name("data")


def extproc_with(config: Path | None) -> Serve:
    """Envoy + extproc with ``config`` (None: the shipped default)."""

    @contextmanager
    def serve(pod_set: PodSet, log_dir: Path) -> Iterator[str]:
        timings = timing_log(log_dir / LOG_NAME)
        with run_stack(pod_set.pods, config=config, envoy_transform=timings) as stack:
            yield stack.url

    return serve


def without_score(plugin: str, **ttft_args: float) -> Serve:
    """Envoy + extproc with the shipped default less the score ``plugin`` (what it adds),
    and estimated-ttft's ``ttft_args`` set."""

    @contextmanager
    def serve(pod_set: PodSet, log_dir: Path) -> Iterator[str]:
        config = yaml.safe_load((EXTPROC_DATA / "config.yaml").read_text())
        scores = config["scheduler"]["plugins"]["Score"]["enabled"]
        config["scheduler"]["plugins"]["Score"]["enabled"] = [
            s for s in scores if s["name"] != plugin
        ]
        (ttft,) = (c for c in config["scheduler"]["pluginConfig"] if c["name"] == "estimated-ttft")
        ttft["args"].update(ttft_args)
        changed = "".join(f"-{name}-{value}" for name, value in ttft_args.items())
        path = log_dir / f"config-without-{plugin}{changed}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        with extproc_with(path)(pod_set, log_dir) as url:
            yield url

    return serve


def precise_config(model: str, tokenizer_dir: Path, block_size: int, path: Path) -> Path:
    """``precise.yaml`` with its models map naming ``model``'s tokenizer, written to ``path``."""
    text = (EXTPROC_DATA / "precise.yaml").read_text()
    text = text.replace("qwen3-tiny: /models/qwen3-tiny", f"{model}: {tokenizer_dir}")
    path.write_text(text.replace("blockSize: 16", f"blockSize: {block_size}"))
    return path


@contextmanager
def extproc_precise(pod_set: PodSet, log_dir: Path) -> Iterator[str]:
    if pod_set.tokenizer_dir is None:
        raise ValueError(f"the {pod_set.kind} pods were started without a tokenizer and events")
    config = precise_config(
        pod_set.model, pod_set.tokenizer_dir, pod_set.block_size, log_dir / "precise.yaml"
    )
    timings = timing_log(log_dir / LOG_NAME)
    with run_stack(
        pod_set.pods, config=config, extproc_args=pod_set.events_args, envoy_transform=timings
    ) as stack:
        pod_set.wait_events_trusted([stack.metrics_text])
        yield stack.url


def extproc_replicas(num_replicas: int) -> Serve:
    """Envoy + ``num_replicas`` extprocs (default configuration) sharing through Redis."""

    @contextmanager
    def serve(pod_set: PodSet, log_dir: Path) -> Iterator[str]:
        with run_replicas(pod_set.pods, num_replicas=num_replicas, redis=True) as stack:
            yield stack.urls[0]

    return serve


def _ready(url: str) -> bool:
    with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
        return bool(r.status == 200)


def start_peer(
    name: str, argv: list[str], port: int, log_dir: Path, timeout_s: float = PEER_START_TIMEOUT_S
) -> tuple[Proc, str]:
    """Start a peer router and wait until it serves ``/v1/models``: its process and URL."""
    proc: Proc = spawn(name, argv, log_dir, {"RUST_LOG": "warn"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), proc, name, timeout_s)
    except BaseException:
        proc.stop()
        raise
    return proc, url


@contextmanager
def _peer(name: str, argv: list[str], port: int, log_dir: Path) -> Iterator[str]:
    proc, url = start_peer(name, argv, port, log_dir)
    try:
        yield url
    finally:
        proc.stop()


def sglang_argv(
    pods: Sequence[Pod], port: int, policy: Sequence[str] = tuple(CACHE_AWARE)
) -> list[str]:
    """``sglang-router launch`` with ``policy`` (cache_aware) over ``pods``, serving
    127.0.0.1:``port``."""
    return [
        str(peer_binary("sglang-router")), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *[f"http://{p.address}" for p in pods], *policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip


def sglang_with(policy: Sequence[str]) -> Serve:
    """sglang-router with ``policy``'s arguments."""

    @contextmanager
    def serve(pod_set: PodSet, log_dir: Path) -> Iterator[str]:
        port = free_port()
        with _peer("sglang-router", sglang_argv(pod_set.pods, port, policy), port, log_dir) as url:
            yield url

    return serve


@contextmanager
def vllm_router(pod_set: PodSet, log_dir: Path) -> Iterator[str]:
    port = free_port()
    argv = [
        str(peer_binary("vllm-router")), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *[f"http://{p.address}" for p in pod_set.pods], *CACHE_AWARE,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    with _peer("vllm-router", argv, port, log_dir) as url:
        yield url


CONTENDERS: dict[str, Serve] = {
    "envoy-rr": envoy_rr,
    "extproc-least-request": extproc_with(CONFIGS / "least-request.yaml"),
    "extproc-prefix-cache": extproc_with(CONFIGS / "prefix-cache.yaml"),
    "extproc-default": extproc_with(None),
    "extproc-no-lora-affinity": without_score("lora-affinity"),
    "extproc-lora-blind": without_score("lora-affinity", loraLoadMs=0.0),
    "extproc-kthena": extproc_with(EXTPROC_DATA / "kthena.yaml"),
    "extproc-cost-aware": extproc_with(EXTPROC_DATA / "cost-aware.yaml"),
    "extproc-default-2-replicas": extproc_replicas(2),
    "extproc-precise": extproc_precise,
    "sglang-router": sglang_with(CACHE_AWARE),
    "sglang-rr": sglang_with(ROUND_ROBIN),
    "vllm-router": vllm_router,
}
