"""bench.routing_quality's simulated pods: the pseudo-tokenizer and no KV events, as in the
recorded results, unless extproc-precise runs (or ``--sim-precise``); then the Qwen3
tokenizer and KV events a port each, for every contender of the run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.bench_pods import sim_pod_set
from bench.routing_quality import SIM_ENGINE, pod_sets, sim_precise
from e2e.real_vllm.prepare import model_dir
from extproc.datalayer.kv_events import EVENTS_PORT_LABEL


def run_args(contenders: list[str], sim_precise: bool = False) -> argparse.Namespace:
    return argparse.Namespace(
        contenders=contenders, sim_precise=sim_precise, sim_pods=8, trace_requests=300,
        speedup=5.0, vllm_trace_requests=150, vllm_speedup=2.0,
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
    assert set(sets) == {kind, "vllm"}
    setup = sets[kind][1]
    assert ("Qwen3" in setup) is precise
    assert ("pseudo-tokenizer, no KV events" in setup) is not precise
    assert setup.startswith(f"8 simulated pods (`extproc sim-pods {' '.join(SIM_ENGINE)}")


def test_pods_without_precise_publish_no_events(tmp_path: Path) -> None:
    with sim_pod_set(2, SIM_ENGINE, tmp_path) as pods:
        assert pods.tokenizer_dir is None and pods.events_args == []
        assert [p.label(EVENTS_PORT_LABEL) for p in pods.pods] == [None, None]


@pytest.mark.skipif(
    not (model_dir() / "tokenizer.json").exists(), reason="run `python -m e2e.real_vllm.prepare`"
)
def test_pods_for_precise_tokenize_and_publish_a_port_each(tmp_path: Path) -> None:
    with sim_pod_set(2, SIM_ENGINE, tmp_path, precise=True) as pods:
        assert pods.tokenizer_dir is not None
        assert pods.events_args == ["--kv-events-topology", "connect"]
        ports = [p.label(EVENTS_PORT_LABEL) for p in pods.pods]
        assert all(port and port.isdigit() for port in ports) and len(set(ports)) == 2
