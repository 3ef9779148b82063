"""LoRA adapters on real vLLM pods, alone and behind Envoy and extproc.

Two pods of this module's own (LoRA on, one adapter in the engine at a time): the first
serves the adapters ``a`` and ``b``, the second ``b`` only (``prepare.py`` builds them
with peft). Checked:

* a pod answers for an adapter, and the answer is the adapter's (it differs from the
  base model's); ``/v1/models`` lists each adapter with its base model as ``parent``;
  ``vllm:lora_requests_info``'s newest series names the adapter while its request runs
  and none once it is done;
* the KV events of an adapter's blocks carry its name, and the same tokens get other
  block hashes than the base model's: an adapter and its base model share no cache;
* through Envoy and extproc (the pods file lists each pod's adapters), a request for
  ``a`` goes to the first pod alone, with no fallback, and one for ``b`` may go to both;
  the same prompt for ``a`` then for the base model finds nothing cached;
* extproc's scraper (the classes ``extproc serve`` runs) finds each pod's adapters on its
  ``/v1/models`` when the pods file names only the base model, and reads the running
  adapter and the slot count from ``vllm:lora_requests_info``; ``extproc serve`` on such
  a pods file routes ``a`` to the first pod alone once it has read the pages;
* with the ``lora-affinity`` plugin, while ``a`` runs in the first pod's only adapter
  slot and ``b`` on the second pod, requests for ``b`` go to the second pod.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from prometheus_client import CollectorRegistry
from zmq.utils.monitor import recv_monitor_message

from e2e.real_vllm.pods import BLOCK_SIZE, MODEL, VllmPod, start_vllm_pods
from e2e.real_vllm.prepare import adapter_dir, prepare
from e2e.real_vllm.support import chat, delta, long_prefix, lora_info, send_recorded, snapshot
from e2e.support import (
    LIST_HEADER,
    PREFIX_CONFIG,
    TRIES_HEADER,
    answer_says_list_and_tries,
    metric,
)
from extproc.datalayer.kv_events import decode_batch
from extproc.datalayer.scrape import MetricsScraper
from extproc.datalayer.store import PodStore
from extproc.pods import Pod
from extproc.sim.launch import Stack, run_stack
from testkit.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.real_vllm, pytest.mark.timeout(900)]

ONLY_FIRST = "a"  # served by the first pod alone
ON_BOTH = "b"
PREFIX_TOKENS = 7 * BLOCK_SIZE  # the full blocks of ``long_prefix()``'s system prompt
CONNECT_TIMEOUT_MS = 10_000
AFFINITY_CONFIG = """\
scheduler:
  plugins:
    Filter:
      enabled: [lora-affinity]
    Score:
      enabled:
        - name: lora-affinity
          weight: 1
"""
SCRAPES = "extproc_scrape_duration_seconds_count"  # +1 for each pod extproc scrapes
LONG_TOKENS = 480  # a few seconds of decoding on CPU, within the pods' max-model-len


@pytest.fixture(scope="module")
def lora_pods() -> Iterator[list[VllmPod]]:
    prepare()
    both = {name: adapter_dir(name) for name in (ONLY_FIRST, ON_BOTH)}
    with (
        tempfile.TemporaryDirectory(prefix="extproc-vllm-lora-") as tmp,
        start_vllm_pods(2, Path(tmp), adapters=[both, {ON_BOTH: both[ON_BOTH]}]) as pods,
    ):
        yield pods


@pytest.fixture(scope="module")
def lora_stack(lora_pods: list[VllmPod]) -> Iterator[Stack]:
    # The pod without ``a`` listed first, so a tie-break in its favour cannot hide a miss.
    pods = [p.as_pod() for p in reversed(lora_pods)]
    with run_stack(pods, config=PREFIX_CONFIG, envoy_transform=answer_says_list_and_tries) as s:
        yield s


@pytest.fixture(scope="module")
def base_only_stack(lora_pods: list[VllmPod]) -> Iterator[Stack]:
    """extproc on a pods file naming only the base model: it finds the adapters itself."""
    pods = [base_only(p) for p in reversed(lora_pods)]
    with run_stack(pods, config=PREFIX_CONFIG, envoy_transform=answer_says_list_and_tries) as s:
        yield s


@pytest.fixture(scope="module")
def affinity_stack(
    lora_pods: list[VllmPod], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """extproc with lora-affinity alone; the first pod listed first, so a tie-break in its
    favour cannot hide a miss."""
    config = tmp_path_factory.mktemp("lora") / "lora-affinity.yaml"
    config.write_text(AFFINITY_CONFIG)
    pods = [p.as_pod() for p in lora_pods]
    with run_stack(pods, config=config, envoy_transform=answer_says_list_and_tries) as s:
        yield s


@pytest.fixture
def client(lora_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=lora_stack.url, timeout=60) as c:
        yield c


def base_only(pod: VllmPod) -> Pod:
    """``pod`` as a pods file naming its base model alone lists it."""
    return replace(pod.as_pod(), models=frozenset({MODEL}), adapters=frozenset())


def complete(pod: VllmPod, model: str, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    """A greedy completion straight from ``pod``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(pod.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def chat_with(pod: VllmPod, body: dict[str, object]) -> httpx.Response:
    """A chat completion straight from ``pod``."""
    resp = httpx.post(pod.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


@contextmanager
def busy(pod: VllmPod, model: str) -> Iterator[None]:
    """A long request for ``model`` running on ``pod`` (straight) during the ``with``,
    answered in full by the end of it."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(complete, pod, model, "Count:", LONG_TOKENS)
        yield
        assert answer.result(120)["usage"]["completion_tokens"] == LONG_TOKENS


def parents(pod: VllmPod) -> dict[str, str | None]:
    """Each model ``/v1/models`` lists, with its ``parent``."""
    resp = httpx.get(pod.url + "/v1/models", timeout=10)
    return {card["id"]: card["parent"] for card in resp.json()["data"]}


def running_adapters(pod: VllmPod) -> str | None:
    info = lora_info(pod.metrics_text())
    return None if info is None else info["running_lora_adapters"]


def cached_tokens(resp: httpx.Response) -> int:
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@contextmanager
def stored_blocks(pod: VllmPod) -> Iterator[list[dict[str, Any]]]:
    """The ``BlockStored`` events ``pod`` publishes while the ``with`` lasts (from the
    moment its publisher has connected to the SUB socket bound on its endpoint)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.bind(pod.kv_events_endpoint)
    stored: list[dict[str, Any]] = []
    stop = threading.Event()

    def collect() -> None:
        while not stop.is_set():
            if sub.poll(50):
                payload = sub.recv_multipart()[2]
                stored.extend(e for e in decode_batch(payload) if e["type"] == "BlockStored")

    thread = threading.Thread(target=collect, name="kv-events", daemon=True)
    try:
        if not monitor.poll(CONNECT_TIMEOUT_MS):
            raise TimeoutError(f"{pod.name}'s KV-event publisher did not connect")
        recv_monitor_message(monitor)
        thread.start()
        yield stored
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(5)
        ctx.destroy(linger=0)


def first_stored(stored: list[dict[str, Any]], lora_name: str | None) -> dict[str, Any]:
    """The first event of a prompt's first blocks (no parent) stored for ``lora_name``."""
    found = [e for e in stored if e["parent_block_hash"] is None and e["lora_name"] == lora_name]
    return found[0]


def test_a_pod_serves_its_adapters_lists_them_and_reports_the_running_one(
    lora_pods: list[VllmPod],
) -> None:
    first, second = lora_pods
    assert parents(first) == {MODEL: None, ONLY_FIRST: MODEL, ON_BOTH: MODEL}
    assert parents(second) == {MODEL: None, ON_BOTH: MODEL}
    prompt = long_prefix()
    answer = complete(first, ONLY_FIRST, prompt)
    assert answer["model"] == ONLY_FIRST
    assert answer["choices"][0]["text"] != complete(first, MODEL, prompt)["choices"][0]["text"]
    with busy(first, ONLY_FIRST):
        wait_until(lambda: running_adapters(first) == ONLY_FIRST, 30, what=first.metrics_text)
        info = lora_info(first.metrics_text())
        assert info is not None and info["max_lora"] == "1"
    wait_until(lambda: running_adapters(first) == "", 10, what=first.metrics_text)


def test_an_adapters_blocks_carry_its_name_and_other_hashes_than_the_base_models(
    lora_pods: list[VllmPod],
) -> None:
    first = lora_pods[0]
    prompt = long_prefix()
    with stored_blocks(first) as stored:
        complete(first, ONLY_FIRST, prompt, max_tokens=1)
        complete(first, MODEL, prompt, max_tokens=1)
        wait_until(lambda: len({e["lora_name"] for e in stored}) == 2, 10, what=lambda: stored)
        adapted, base = first_stored(stored, ONLY_FIRST), first_stored(stored, None)
    assert adapted["lora_id"] is not None and base["lora_id"] is None
    assert adapted["token_ids"] == base["token_ids"]
    assert len(adapted["block_hashes"]) >= PREFIX_TOKENS // BLOCK_SIZE
    assert not set(adapted["block_hashes"]) & set(base["block_hashes"])


def test_requests_for_an_adapter_go_only_to_the_pods_serving_it(
    lora_stack: Stack, lora_pods: list[VllmPod], client: httpx.Client
) -> None:
    first, second = lora_pods
    before = snapshot(lora_pods)
    for i in range(4):
        resp = send_recorded(lora_stack, client, chat(long_prefix(), f"a {i}?", model=ONLY_FIRST))
        assert resp.json()["model"] == ONLY_FIRST
        assert resp.headers[LIST_HEADER] == first.address  # no fallback: no other pod has it
        assert resp.headers[TRIES_HEADER] == "1"
    listed = set()
    for i in range(4):
        resp = send_recorded(lora_stack, client, chat(long_prefix(), f"b {i}?", model=ON_BOTH))
        listed.add(frozenset(resp.headers[LIST_HEADER].split(",")))
    assert listed == {frozenset({first.address, second.address})}
    served = delta(before, snapshot(lora_pods), "vllm:request_success_total")
    assert served[0] >= 4 and sum(served) == 8


def test_the_same_prompt_for_an_adapter_then_its_base_model_finds_nothing_cached(
    lora_stack: Stack, lora_pods: list[VllmPod], client: httpx.Client
) -> None:
    first = lora_pods[0]
    body = chat(long_prefix(), "the same question?", model=ONLY_FIRST)
    assert cached_tokens(send_recorded(lora_stack, client, body)) == 0
    assert cached_tokens(send_recorded(lora_stack, client, body)) >= PREFIX_TOKENS
    # The base model on the pod that holds the adapter's blocks: none of them is its own,
    # and its own are found the second time.
    base = {**body, "model": MODEL}
    assert cached_tokens(chat_with(first, base)) == 0
    assert cached_tokens(chat_with(first, base)) >= PREFIX_TOKENS


def test_extprocs_scraper_finds_the_adapters_and_reads_the_running_one(
    lora_pods: list[VllmPod],
) -> None:
    first = lora_pods[0]
    store = PodStore(lambda _: None, stale_after_s=None)
    store.set_pods([base_only(p) for p in lora_pods])
    scraper = MetricsScraper(
        store, interval_s=0.1, registry=CollectorRegistry(), models_interval_s=0.1
    )
    scraper.start()
    try:
        served = [frozenset(p.adapters) for p in lora_pods]
        wait_until(lambda: [p.adapters for p in store.pods] == served, 10, what=lambda: store.pods)
        assert store.pods[0].models == {MODEL, ONLY_FIRST, ON_BOTH}

        def first_running() -> frozenset[str] | None:
            lora = store.pods[0].metrics.lora
            return None if lora is None else lora.running

        with busy(first, ONLY_FIRST):
            wait_until(
                lambda: first_running() == frozenset({ONLY_FIRST}), 30, what=lambda: store.pods[0]
            )
        lora = store.pods[0].metrics.lora
        assert lora is not None and lora.max_lora == 1
    finally:
        scraper.stop()


def test_extproc_routes_an_adapter_it_found_on_the_pods_pages(
    base_only_stack: Stack, lora_pods: list[VllmPod]
) -> None:
    first = lora_pods[0]
    body = chat(long_prefix(), "found?", model=ONLY_FIRST)
    with httpx.Client(base_url=base_only_stack.url, timeout=60) as client:
        wait_until(
            lambda: client.post("/v1/chat/completions", json=body).status_code == 200,
            20,
            what="extproc never routed the adapter its pods file does not name",
        )
        for i in range(3):
            question = chat(long_prefix(), f"{i}?", model=ONLY_FIRST)
            resp = send_recorded(base_only_stack, client, question)
            assert resp.headers[LIST_HEADER] == first.address


def test_lora_affinity_sends_an_adapter_where_it_runs_not_where_another_holds_the_slot(
    affinity_stack: Stack, lora_pods: list[VllmPod]
) -> None:
    """Both pods equally busy (one long request each): only the adapters tell them apart."""
    first, second = lora_pods
    with (
        httpx.Client(base_url=affinity_stack.url, timeout=60) as client,
        busy(first, ONLY_FIRST),
        busy(second, ON_BOTH),
    ):
        running = [ONLY_FIRST, ON_BOTH]
        wait_until(lambda: [running_adapters(p) for p in lora_pods] == running, 30)
        scrapes = metric(affinity_stack, SCRAPES)
        wait_until(lambda: metric(affinity_stack, SCRAPES) >= scrapes + 2 * len(lora_pods), 10)
        for i in range(4):
            body = chat(long_prefix(), f"b {i}?", model=ON_BOTH)
            resp = send_recorded(affinity_stack, client, body)
            assert resp.headers[LIST_HEADER].split(",")[0] == second.address
