"""LoRA as vLLM serves it: slots, LRU eviction, load time, cache keys, events, the metric,
/v1/models and the load/unload endpoints."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.errors import ConfigError
from extproc.pods import LoraSlots
from extproc.sim import pods_cli
from extproc.sim.engine import Engine, EngineConfig, SimRequest, StepResult
from extproc.sim.kv_cache import BlockStored
from extproc.sim.kv_events import event_to_wire
from extproc.sim.launch import SimPods, lora_args
from extproc.sim.lora import LoraError, LoraModule, LoraRegistry, LoraRequest, parse_lora_module
from extproc.sim.offline import SimSettings, make_pods, scrape, simulate
from extproc.sim.pods import GroupSettings
from extproc.sim.policies import RoundRobin
from extproc.sim.report import summarize
from extproc.sim.workloads import MULTITURN_PARAMS, LoraParams, lora_workload
from testkit.factories import constant_step, seq
from testkit.harness import run_sim_pods

A, B, C = (LoraRequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", 1))
STEP_S = 0.01
LORA = EngineConfig(
    enable_lora=True, max_loras=2, lora_load_ms=100.0, timing_profile=constant_step(STEP_S)
)


def request(rid: str, lora: LoraRequest | None, prompt_seed: int = 1, max_tokens: int = 1,
            salt: str | None = None) -> SimRequest:  # fmt: skip
    return SimRequest(rid, tuple(seq(prompt_seed, 40)), max_tokens, salt, lora=lora)


def drain(engine: Engine) -> list[StepResult]:
    results = []
    while engine.has_work():
        results.append(engine.step(engine.clock))
    return results


def finish(engine: Engine, req: SimRequest) -> int:
    """Run ``req`` alone to its end; its prefix-cache hit in tokens."""
    engine.add_request(req, engine.clock)
    (fin,) = [f for r in drain(engine) for f in r.finished]
    return fin.num_cached_tokens


# Scheduling: slots and loads


def test_a_step_holds_at_most_max_loras_adapters_and_the_third_waits_without_blocking() -> None:
    engine = Engine(LORA)
    for rid, lora in (("ra", A), ("rb", B), ("rc", C), ("base", None)):
        engine.add_request(request(rid, lora, max_tokens=3), 0.0)
    first = engine.step(0.0)
    assert [rid for rid, _ in first.scheduled] == ["ra", "rb", "base"]  # rc skipped, not a wall
    assert set(first.lora_loads) == {"a", "b"}
    results = drain(engine)
    assert all(len({r for r, _ in s.scheduled} - {"base"}) <= 2 for s in results)
    rc_first = next(i for i, s in enumerate(results) if "rc" in dict(s.scheduled))
    assert {f.request_id for s in results[:rc_first] for f in s.finished} >= {"ra", "rb"}
    assert results[rc_first].lora_loads == ("c",)


def test_a_load_evicts_the_least_recently_used_adapter() -> None:
    engine = Engine(LORA)
    for rid, lora in (("1", A), ("2", B), ("3", A), ("4", C)):
        finish(engine, request(rid, lora, prompt_seed=int(rid)))
    assert [a.name for a in engine.lora_slots.resident] == ["a", "c"]  # b was used least lately
    assert engine.stats().num_lora_loads == 3  # a's second run found it in its slot


def test_a_load_lengthens_its_step_once() -> None:
    engine = Engine(LORA)
    engine.add_request(request("r", A, max_tokens=3), 0.0)
    steps = drain(engine)
    assert [round(s.end_s - s.start_s, 6) for s in steps] == [STEP_S + 0.1, STEP_S, STEP_S]
    assert [s.lora_loads for s in steps] == [("a",), (), ()]
    engine.add_request(request("two", A), engine.clock)
    engine.add_request(request("three", B), engine.clock)
    engine.add_request(request("four", C), engine.clock)
    (both, after) = drain(engine)
    assert round(both.end_s - both.start_s, 6) == STEP_S + 0.1  # a resident, b loaded
    assert round(after.end_s - after.start_s, 6) == STEP_S + 0.1  # c, in a's or b's slot


def test_load_time_scales_with_time_scale() -> None:
    engine = Engine(dataclasses.replace(LORA, time_scale=0.5))
    engine.add_request(request("r", A), 0.0)
    (step,) = drain(engine)
    assert step.end_s - step.start_s == pytest.approx((STEP_S + 0.1) * 0.5)


def test_an_adapter_request_needs_lora_enabled() -> None:
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        Engine(EngineConfig()).add_request(request("r", A), 0.0)


# Cache keys and KV events


def test_blocks_cached_under_an_adapter_serve_only_that_adapter() -> None:
    engine = Engine(LORA)
    assert finish(engine, request("1", A)) == 0
    assert finish(engine, request("2", None)) == 0  # base: a's blocks do not serve it
    assert finish(engine, request("3", B)) == 0
    moved = dataclasses.replace(A, path="/adapters/a-v2")
    assert finish(engine, request("4", moved)) == 0  # same name, other weights
    assert finish(engine, request("5", A)) == 32
    assert finish(engine, request("6", None)) == 32


def test_block_stored_carries_the_adapter() -> None:
    engine = Engine(dataclasses.replace(LORA, enable_kv_cache_events=True, block_size=16))
    finish(engine, request("r", B, salt="tenant"))
    (stored,) = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
    assert (stored.lora_id, stored.lora_name) == (2, "b")
    assert stored.extra_keys == (("b", "tenant"), ("b",))
    wire = event_to_wire(stored)
    assert (wire["lora_id"], wire["lora_name"], wire["extra_keys"]) == (
        2, "b", [["b", "tenant"], ["b"]],
    )  # fmt: skip
    assert event_to_wire(stored, "array")[5:] == [2, "GPU", "b"]


# vllm:lora_requests_info's adapters


def test_an_adapter_is_listed_from_its_first_token_to_its_last_request_end() -> None:
    engine = Engine(dataclasses.replace(LORA, max_loras=1))
    engine.add_request(request("ra", A, max_tokens=2), 0.0)
    engine.add_request(request("rb", B, max_tokens=2), 0.0)
    engine.step(0.0)
    assert engine.lora_request_states() == ("a",)  # b waits unseen, as vLLM 0.32 shows it
    engine.step(engine.clock)
    assert engine.lora_request_states() == ()
    engine.step(engine.clock)
    assert engine.lora_request_states() == ("b",)


def test_a_scraped_engine_shows_its_listed_adapters_in_both_labels() -> None:
    engine = Engine(LORA)
    engine.add_request(request("ra", A, max_tokens=3), 0.0)
    engine.step(0.0)
    (pod,) = make_pods(1, "m", ["a", "b"])
    assert scrape(pod, engine, 0).metrics.lora == LoraSlots(
        frozenset({"a"}), frozenset({"a"}), max_lora=2
    )
    assert pod.adapters == {"a", "b"} and pod.models == {"m", "a", "b"}


# The offline simulator


def test_the_offline_lora_workload_counts_adapter_loads_per_pod() -> None:
    chat = dataclasses.replace(MULTITURN_PARAMS, num_requests=60)
    workload = lora_workload(LoraParams(num_adapters=4, chat=chat))
    items = list(workload.items())
    adapters = {i.sim.lora.name for i in items if i.sim.lora}
    assert adapters <= set(workload.params["adapters"]) and len(adapters) > 1
    assert all(i.sim.lora and i.request.model == i.sim.lora.name for i in items)
    by_chat: dict[str, set[str]] = {}
    for i in items:
        by_chat.setdefault(i.request_id.rsplit("-", 1)[0], set()).add(i.request.model)
    assert all(len(names) == 1 for names in by_chat.values())  # a chat keeps its adapter
    run = simulate(workload, RoundRobin(), SimSettings(2, EngineConfig(**workload.engine_defaults)))
    summary = summarize(run)
    assert len(run.requests) == 60
    per_pod = [p["num_lora_loads"] for p in summary["pods"]]
    assert all(n >= 2 for n in per_pod) and summary["num_lora_loads"] == sum(per_pod)


# The registry and --lora-modules


def test_lora_modules_take_vllms_two_forms() -> None:
    assert parse_lora_module("x=/p/x") == LoraModule("x", "/p/x")
    assert parse_lora_module('{"name": "y", "path": "/p/y", "base_model_name": "m"}') == (
        LoraModule("y", "/p/y")
    )
    for bad in ("nothing", "=/p", '{"name": "z"}'):
        with pytest.raises(ConfigError, match="--lora-modules"):
            parse_lora_module(bad)


def test_registry_ids_and_vllms_refusals() -> None:
    reg = LoraRegistry("base", [LoraModule("x", "/x"), LoraModule("y", "/y")])
    assert [(a.name, a.int_id) for a in map(reg.get, reg.names()) if a] == [("x", 1), ("y", 2)]
    with pytest.raises(LoraError, match="'x' has already been loaded") as e:
        reg.load("x", "/x2")
    assert (e.value.status, e.value.err_type) == (400, "InvalidUserInput")
    assert reg.load("x", "/x2", load_inplace=True) == LoraRequest("x", 1, "/x2")
    with pytest.raises(LoraError, match="conflicts with a served base model"):
        reg.load("base", "/b")
    with pytest.raises(LoraError, match="Both 'lora_name' and 'lora_path' must be provided."):
        reg.load("z", "")
    reg.unload("y")
    with pytest.raises(LoraError, match="The lora adapter 'y' cannot be found.") as e:
        reg.unload("y")
    assert (e.value.status, e.value.err_type) == (404, "NotFoundError")
    assert reg.load("y", "/y").int_id == 3  # a new load, a new id
    with pytest.raises(ConfigError, match="already been loaded"):
        LoraRegistry("base", [LoraModule("x", "/x"), LoraModule("x", "/x")])


def test_the_cli_builds_pods_with_slots_and_adapters() -> None:
    parser = argparse.ArgumentParser()
    pods_cli.add_arguments(parser)
    settings = pods_cli.settings_from_args(parser.parse_args(lora_args(16, 2)))
    assert (settings.engine.enable_lora, settings.engine.max_loras) == (True, 2)
    assert len(settings.lora_modules) == 16
    assert settings.lora_modules[3] == LoraModule("lora-3", "/sim/adapters/lora-3")
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        pods_cli.settings_from_args(parser.parse_args(["--lora-modules", "x=/x"]))


# Over HTTP


@pytest.fixture(scope="module")
def lora_pods() -> Iterator[SimPods]:
    engine = dataclasses.replace(LORA, timing_profile=constant_step(0.005), lora_load_ms=5.0)
    modules = (LoraModule("a", "/adapters/a"), LoraModule("b", "/adapters/b"))
    with run_sim_pods(GroupSettings(num_pods=1, engine=engine, lora_modules=modules)) as pods:
        yield pods


def completion(url: str, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "prompt": "tell me about adapters", "max_tokens": max_tokens}
    return httpx.post(url + "/v1/completions", json=body, timeout=10)


def test_models_lists_each_adapter_under_the_base_model(lora_pods: SimPods) -> None:
    data = httpx.get(lora_pods.urls[0] + "/v1/models").json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in data] == [
        ("sim-llm", None, "sim-llm"), ("a", "sim-llm", "/adapters/a"),
        ("b", "sim-llm", "/adapters/b"),
    ]  # fmt: skip
    assert data[1]["max_model_len"] is None and data[1]["object"] == "model"
    (pod,) = lora_pods.as_pods()
    assert (pod.models, pod.adapters) == (frozenset({"sim-llm", "a", "b"}), frozenset({"a", "b"}))


def test_an_adapter_answers_under_its_name_and_an_unknown_model_is_vllms_404(
    lora_pods: SimPods,
) -> None:
    url = lora_pods.urls[0]
    resp = completion(url, "a")
    assert resp.status_code == 200 and resp.json()["model"] == "a"
    resp = completion(url, "nope")
    assert resp.status_code == 404
    assert resp.json() == {"error": {
        "message": "The model `nope` does not exist. Valid aliases: sim-llm.",
        "type": "NotFoundError", "param": "model", "code": 404,
    }}  # fmt: skip


def lora_info(url: str) -> dict[tuple[str, str, str], float]:
    """``vllm:lora_requests_info``'s series: (max_lora, waiting, running) -> value."""
    text = httpx.get(url + "/metrics").text
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
    ]
    assert family.type == "gauge"
    out = {}
    for s in family.samples:
        assert set(s.labels) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}
        out[s.labels["max_lora"], s.labels["waiting_lora_adapters"],
            s.labels["running_lora_adapters"]] = s.value  # fmt: skip
    return out


def loads_total(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "sim:lora_loads"]
    return sum(s.value for s in family.samples if s.name == "sim:lora_loads_total")


def test_lora_requests_info_is_vllms_gauge_of_update_times(lora_pods: SimPods) -> None:
    url = lora_pods.urls[0]
    before = time.time()
    loads = loads_total(url)
    assert completion(url, "b", max_tokens=3).status_code == 200
    series = lora_info(url)
    assert series["2", "b", "b"] >= before  # while b's request ran
    latest = max(series, key=series.__getitem__)
    assert latest == ("2", "", "")  # after it finished
    assert series[latest] <= time.time()
    assert loads_total(url) == loads + 1  # b was in no slot yet (a's request ran before)


def test_load_and_unload_at_run_time(lora_pods: SimPods) -> None:
    url = lora_pods.urls[0]

    def post(path: str, body: object) -> httpx.Response:
        return httpx.post(url + path, json=body, timeout=10)

    resp = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/adapters/c"})
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'c' added successfully.")
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]][-1] == "c"
    assert completion(url, "c").status_code == 200
    resp = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/adapters/c"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "InvalidUserInput"
    assert "has already been loaded" in resp.json()["error"]["message"]
    resp = post("/v1/load_lora_adapter", {"lora_name": "d"})
    assert resp.status_code == 400 and "body.lora_path" in resp.json()["error"]["message"]
    resp = post("/v1/unload_lora_adapter", {"lora_name": "c"})
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
    assert completion(url, "c").status_code == 404
    resp = post("/v1/unload_lora_adapter", {"lora_name": "c"})
    assert resp.status_code == 404
    assert resp.json()["error"] == {"message": "The lora adapter 'c' cannot be found.",
                                    "type": "NotFoundError", "param": None, "code": 404}  # fmt: skip
    lora_pods.load_lora_adapter("sim-0", "c", "/adapters/c2")  # the launcher's helper
    assert httpx.get(url + "/v1/models").json()["data"][-1]["root"] == "/adapters/c2"


def test_a_pod_without_lora_has_neither_the_metric_nor_the_endpoints(pods: SimPods) -> None:
    url = pods.urls[0]
    assert "lora" not in httpx.get(url + "/metrics").text
    body = {"lora_name": "c", "lora_path": "/c"}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 404
    assert len(httpx.get(url + "/v1/models").json()["data"]) == 1
