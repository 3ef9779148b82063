"""Simulated pods with a real tokenizer (``sim-pods --tokenizer DIR``) and KV events on a
port of each pod's own: precise-prefix-cache, given the same directory in its ``models``
map and connected to every pod (the connect topology, as several replicas would be),
predicts each pod's ``cached_tokens`` exactly, request after request, as it does for
real vLLM (``e2e/real_vllm/test_precise.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from extproc.datalayer.kv_events import EVENTS_PORT_LABEL, EventsSettings, KvEventsSubscriber
from extproc.prefix.precise.keys import chain_keys
from extproc.request.chat_input import chat_input
from extproc.request.parse import Api
from extproc.request.parse import parse_request as parse_for_routing
from extproc.request.tokens import SegmentTokenizer
from extproc.scheduling.interfaces import Cycle, PluginContext
from extproc.scheduling.plugins.precise_prefix_cache import PrecisePrefixCache
from extproc.sim.api import ApiError, parse_request, to_chat_message
from extproc.sim.launch import SimPods
from extproc.sim.pods import GroupSettings, KvEventsSettings
from extproc.sim.tokenizer import chat_pieces
from testkit.e2e_cache import MODEL_DIR, needs_model_tokenizer
from testkit.factories import FAST_ENGINE
from testkit.harness import run_sim_pods
from testkit.waiting import wait_until

pytestmark = needs_model_tokenizer
SYSTEM = "You are the support assistant of a cloud platform. Answer briefly. " * 8
FUNCTION: dict[str, Any] = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object"}},
}
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions",
         "responses": "/v1/responses"}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> SegmentTokenizer:
    return SegmentTokenizer(MODEL_DIR)


@pytest.mark.parametrize(
    ("kind", "body", "as_chat"),
    [
        pytest.param("chat", {"messages": [{"role": "user", "content": "hi"}]}, None, id="chat"),
        pytest.param(
            "responses", {"input": "hi", "instructions": SYSTEM},
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
            id="responses-as-its-chat-messages",
        ),
        pytest.param(
            "responses", {"input": "hi", "reasoning": {"effort": "none"}}, None,
            id="responses-as-vllm-builds-them",  # thinking off: not its chat messages alone
        ),
        pytest.param("completion", {"prompt": SYSTEM}, None, id="completion"),
        pytest.param("completion", {"prompt": [151_660, 7]}, None,
                     id="token-ids-of-the-real-vocabulary"),
        pytest.param("chat", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [FUNCTION], "tool_choice": "required"}, None,
                     id="chat-with-tools"),
        pytest.param("responses", {"input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "a", "output": "done"},
        ], "tools": [{"type": "function", **FUNCTION["function"]}]}, None,
                     id="responses-with-tools-and-a-call"),
    ],
)  # fmt: skip
def test_prompts_are_the_tokenizers(
    tokenizer: SegmentTokenizer, kind: str, body: dict[str, Any], as_chat: list[Any] | None
) -> None:
    parsed = parse_request(kind, {"model": "m", **body}, "m", 16, tokenizer)  # type: ignore[arg-type]
    routed = {"model": "m", **({"messages": as_chat} if as_chat else body)}
    path = PATHS["chat" if as_chat else kind]
    request = parse_for_routing(path, orjson.dumps(routed))
    assert request.data is not None
    assert list(parsed.prompt_token_ids) == tokenizer.request_tokens(request.api, request.data)


TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Now.",
                                           "parameters": {"type": "object"}}}]  # fmt: skip
TOOL_CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        {"id": "b", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
    ]},
    {"role": "tool", "tool_call_id": "a", "content": "12:00"},
    {"role": "tool", "tool_call_id": "b", "content": "11:00"},
    {"role": "assistant", "content": "Noon."},
    {"role": "user", "content": "Thanks."},
]  # fmt: skip


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_the_pseudo_template_writes_qwen3s_text(
    tokenizer: SegmentTokenizer, tools: list[Any] | None
) -> None:
    """The pseudo-tokenizer's pieces, joined, are the text the model's template renders."""
    body = {"messages": TOOL_CONVERSATION, "tools": tools}
    chat = chat_input(body)
    messages = [to_chat_message(m) for m in chat.messages]
    assert "".join(chat_pieces(messages, chat.tools or ())) == tokenizer.render(chat)


def test_a_forced_tool_choice_gets_a_call_with_the_real_tokenizer(
    tokenizer: SegmentTokenizer,
) -> None:
    body = {"messages": TOOL_CONVERSATION[:2], "tools": TOOLS, "tool_choice": "required"}
    parsed = parse_request("chat", body, "m", 16, tokenizer)
    assert parsed.prompt_token_ids == tuple(tokenizer.request_tokens(Api.CHAT_COMPLETIONS, body))
    assert parsed.tool_call is not None and parsed.tool_call.name == "get_time"


def test_a_prompt_the_template_refuses_is_a_bad_request(tokenizer: SegmentTokenizer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"messages": "clash"}}  # fmt: skip
    with pytest.raises(ApiError) as err:
        parse_request("chat", body, "m", 16, tokenizer)
    assert err.value.status == 400


@pytest.fixture(scope="module")
def sim() -> Iterator[SimPods]:
    settings = GroupSettings(
        num_pods=2, model="m", engine=FAST_ENGINE, tokenizer=str(MODEL_DIR),
        kv_events=KvEventsSettings("tcp://127.0.0.1:*"),
    )  # fmt: skip
    with run_sim_pods(settings) as pods:
        yield pods


@pytest.fixture(scope="module")
def precise(sim: SimPods) -> Iterator[PrecisePrefixCache]:
    plugin = PrecisePrefixCache.from_args(
        {"models": {"m": str(MODEL_DIR)}}, PluginContext(CollectorRegistry())
    )
    subscriber = KvEventsSubscriber(plugin.index, EventsSettings("connect"), CollectorRegistry())
    subscriber.set_pods(sim.as_pods())
    plugin.pods_changed(sim.as_pods())
    subscriber.start()
    try:
        for pod in sim.as_pods():
            # Joined late (ZMQ): a reset's AllBlocksCleared makes the view exact from there.
            def trusted(pod_id: Any = pod.id) -> bool:
                sim.reset_cache(pod_id.name)
                view = plugin.index.views.get(pod_id)
                return view is not None and not view.stale()

            wait_until(trusted, 30, what=f"no events from {pod.id}")
        yield plugin
    finally:
        subscriber.stop()


def test_each_pod_publishes_on_a_port_of_its_own(sim: SimPods) -> None:
    ports = [pod.label(EVENTS_PORT_LABEL) for pod in sim.as_pods()]
    assert all(p and p.isdigit() for p in ports) and len(set(ports)) == len(ports)


def test_predicted_cached_tokens_equal_the_pods_report(
    sim: SimPods, precise: PrecisePrefixCache
) -> None:
    requests: list[tuple[str, dict[str, Any]]] = []
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(3):
        messages = [*messages, {"role": "user", "content": f"Question {turn}: why?"}]
        requests.append(("chat", {"messages": messages}))
        requests.append(("chat", {"messages": messages, "cache_salt": "tenant-a"}))
        messages = [*messages, {"role": "assistant", "content": f"Because {turn}."}]
    requests.append(("completion", {"prompt": SYSTEM + "Summarize."}))
    requests.append(("responses", {"instructions": SYSTEM, "input": "Summarize briefly."}))
    hits = 0
    with httpx.Client(timeout=30) as client:
        for _ in range(2):  # the second round finds every prompt cached on its pod
            for i, (kind, body) in enumerate(requests):
                pod = sim.as_pods()[i % len(sim.pods)]
                body = {"model": "m", **body, "max_tokens": 4}
                cycle = Cycle(parse_for_routing(PATHS[kind], orjson.dumps(body)))
                predicted = precise.matched_tokens(cycle, [pod])[pod.id]
                resp = client.post(f"http://{pod.address}{PATHS[kind]}", json=body)
                usage = resp.json()["usage"]
                prefix = "input" if kind == "responses" else "prompt"
                tokens = precise.prompt_tokens(cycle)
                assert tokens is not None
                assert usage[f"{prefix}_tokens"] == len(tokens)
                cached = usage[f"{prefix}_tokens_details"]["cached_tokens"]
                assert predicted == cached, (i, body)
                hits += predicted > 0
                # before the next request: this one's blocks are in the pod's view
                keys = chain_keys(tokens, 16, cycle.request.cache_salt)
                held = lambda p=pod.id, k=keys: precise.index.match(p, k)[0] == len(k)
                wait_until(held, 10)
    assert hits >= len(requests)
