"""bench.routing_quality's simulated pods: the pseudo-tokenizer and no KV events, as in the
recorded results, unless extproc-precise runs (or ``--sim-precise``); then the Qwen3
tokenizer and KV events a port each, for every contender of the run."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest
import yaml

from bench.bench_pods import sim_pod_set
from bench.contenders import CACHE_AWARE, CONTENDERS, ROUND_ROBIN, sglang_argv
from bench.routing_quality import (
    LORA_ADAPTERS,
    LORA_SLOTS,
    SIM_ENGINE,
    aggregate,
    pod_sets,
    sim_precise,
    workloads_of,
)
from e2e.real_vllm.pods import cores_shared, engine_core
from extproc.datalayer.kv_events import EVENTS_PORT_LABEL
from testkit.e2e_cache import needs_model_tokenizer
from testkit.factories import make_pod
from tests.bench.rows import run_row


def run_args(contenders: list[str], sim_precise: bool = False) -> argparse.Namespace:
    return argparse.Namespace(
        contenders=contenders, sim_precise=sim_precise, sim_pods=8, trace_requests=300,
        speedup=5.0, vllm_pods=3, vllm_trace_requests=150, vllm_speedup=2.0, lora_pods=4,
        vllm_cpu_quota=None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("contenders", "flag", "precise"),
    [
        pytest.param(["extproc-default", "sglang-router"], False, False, id="without-precise"),
        pytest.param(["extproc-default", "extproc-precise"], False, True, id="with-precise"),
        pytest.param(["extproc-default"], True, True, id="forced-by-the-flag"),
    ],
)
def test_the_sim_pods_tokenize_for_precise_only_when_it_runs(
    contenders: list[str], flag: bool, precise: bool, tmp_path: Path
) -> None:
    args = run_args(contenders, flag)
    assert sim_precise(args) is precise
    sets = pod_sets(args, tmp_path)
    kind = "sim-events" if precise else "sim"  # one section each in the results
    assert set(sets) == {kind, "vllm", "sim-lora"}
    setup = sets[kind][1]
    assert ("Qwen3" in setup) is precise
    assert ("pseudo-tokenizer, no KV events" in setup) is not precise
    assert setup.startswith(f"8 simulated pods (`extproc sim-pods {' '.join(SIM_ENGINE)}")


def test_pods_without_precise_publish_no_events(tmp_path: Path) -> None:
    with sim_pod_set(2, SIM_ENGINE, tmp_path) as pods:
        assert pods.tokenizer_dir is None and pods.events_args == []
        assert [p.label(EVENTS_PORT_LABEL) for p in pods.pods] == [None, None]


@needs_model_tokenizer
def test_pods_for_precise_tokenize_and_publish_a_port_each(tmp_path: Path) -> None:
    with sim_pod_set(2, SIM_ENGINE, tmp_path, precise=True) as pods:
        assert pods.tokenizer_dir is not None
        assert pods.events_args == ["--kv-events-topology", "connect"]
        ports = [p.label(EVENTS_PORT_LABEL) for p in pods.pods]
        assert all(port and port.isdigit() for port in ports) and len(set(ports)) == 2


@pytest.mark.parametrize(
    ("num_pods", "binding"),
    [
        pytest.param(3, "on 2 shared cores", id="more-pods-than-cores"),
        pytest.param(2, "each engine bound to its own core", id="a-core-each"),
        pytest.param(1, "each engine bound to its own core", id="one-pod"),
    ],
)
def test_the_vllm_setup_says_how_many_pods_and_how_they_share_the_cores(
    num_pods: int, binding: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    args = run_args(["extproc-default"])
    args.vllm_pods = num_pods
    setup = pod_sets(args, tmp_path)["vllm"][1]
    assert setup.startswith(f"{num_pods} real vLLM-CPU {'pods' if num_pods > 1 else 'pod'} (")
    assert binding in setup


def test_capped_vllm_pods_are_a_section_of_their_own(tmp_path: Path) -> None:
    """A run with ``--vllm-cpu-quota`` adds its section beside the uncapped pods' one
    (``report.merged`` keeps sections by key) and says what the cap is."""
    args = run_args(["extproc-default"])
    assert "vllm-quota" not in pod_sets(args, tmp_path)
    args.vllm_cpu_quota = 0.5
    sets = pod_sets(args, tmp_path)
    assert "vllm" not in sets
    title, setup, _start = sets["vllm-quota"]
    assert title == "Real vLLM pods, 0.5 of a core each"
    assert "held to 0.5 of a core by a CFS quota" in setup


def test_vllm_engines_take_the_cores_round_robin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert [engine_core(i) for i in range(3)] == [0, 1, 0]
    assert not cores_shared(2) and cores_shared(3)


def test_sglang_round_robin_is_the_same_proxy_without_the_cache_policy() -> None:
    pods = [make_pod("a"), make_pod("b")]
    cache_aware, round_robin = (
        sglang_argv(pods, 1),
        sglang_argv(pods, 1, ROUND_ROBIN),
    )
    assert cache_aware[cache_aware.index("--policy") + 1] == "cache_aware"
    assert set(CACHE_AWARE) <= set(cache_aware)
    assert round_robin[round_robin.index("--policy") + 1] == "round_robin"
    assert "--cache-threshold" not in round_robin
    assert {"sglang-router", "sglang-rr"} <= set(CONTENDERS)


def test_a_round_robin_baseline_is_no_peer_of_the_verdict() -> None:
    """sglang-rr is a baseline like envoy-rr: its better p99 does not decide the verdict."""
    rows = aggregate([
        run_row("extproc-default", hit_ratio=0.8, ttft_p99_ms=50.0),
        run_row("sglang-router", hit_ratio=0.7, ttft_p99_ms=60.0),
        run_row("sglang-rr", hit_ratio=0.6, ttft_p99_ms=40.0),
        run_row("envoy-rr", hit_ratio=0.6, ttft_p99_ms=55.0),
    ])  # fmt: skip
    verdicts = {r["contender"]: r.get("verdict") for r in rows}
    assert str(verdicts["extproc-default"]).startswith("win")
    assert verdicts["sglang-rr"] is None


def test_a_row_keeps_the_slowest_requests_and_errors_of_every_repetition() -> None:
    slow = [{"at_s": 1.0, "ttft_ms": 90.0}, {"at_s": 2.0, "ttft_ms": 20.0}]
    rows = aggregate([
        run_row(rep=0, slowest=slow, errors=["HTTP 503"]),
        run_row(rep=1, slowest=[{"at_s": 5.0, "ttft_ms": 300.0}], errors=["timeout"]),
    ])  # fmt: skip
    (row,) = rows
    assert [(e["ttft_ms"], e["rep"]) for e in row["slowest"]] == [(300.0, 1), (90.0, 0), (20.0, 0)]
    assert row["errors"] == ["HTTP 503", "timeout"]
    assert "rep" not in row and "wall_s" not in row  # a repetition's own, not the row's


def test_the_lora_workload_runs_alone_on_its_own_pods_with_adapters(tmp_path: Path) -> None:
    everything = ["multiturn", "lora", "groups"]
    assert workloads_of("sim", everything) == ["multiturn", "groups"]
    assert workloads_of("vllm", everything) == ["multiturn", "groups"]
    assert workloads_of("sim-lora", everything) == ["lora"]
    _title, setup, start = pod_sets(run_args(["extproc-default"]), tmp_path)["sim-lora"]
    assert f"--max-loras {LORA_SLOTS}" in setup and setup.startswith("4 simulated pods")
    with start() as pods:
        assert all(len(p.adapters) == LORA_ADAPTERS for p in pods.pods)
        assert [c["adapter_loads"] for c in pods.counters()] == [0.0] * 4
        body = {"model": "lora-3", "prompt": "hello", "max_tokens": 2}
        for name in ("extproc-no-lora-affinity", "extproc-lora-blind"):
            with CONTENDERS[name](pods, tmp_path) as url:
                assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
            if name == "extproc-no-lora-affinity":
                assert sum(c["adapter_loads"] for c in pods.counters()) == 1
    for file, lora_load_ms in [("", 50.0), ("-loraLoadMs-0.0", 0.0)]:
        config = yaml.safe_load((tmp_path / f"config-without-lora-affinity{file}.yaml").read_text())
        scores = config["scheduler"]["plugins"]["Score"]["enabled"]
        assert [s["name"] for s in scores] == ["estimated-ttft"]
        (ttft,) = config["scheduler"]["pluginConfig"]
        assert ttft["args"]["loraLoadMs"] == lora_load_ms
