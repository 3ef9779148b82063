"""A recorded request stream and the picks extproc made for it: the check that a change
meant to make routing cheaper changes no routing decision.

``run_stream`` routes a fixed, seeded stream through a ``Router`` built as ``extproc
serve`` builds it (record metadata, flow control, sessions, per-request metrics) and
returns every decision (the destination list, or the error) in order. The stream mixes
what the routing-quality workloads do: multi-turn chats resending their history, tenants
whose one-shot questions share a system prompt, session-header conversations, plain
completions, short prompts; requests end out of order, some fail, some are abandoned;
the pods' scraped metrics change every few dozen requests and a pod leaves and returns.
Everything random is seeded, so the same code gives the same picks.

``tests/scheduling/data/recorded_picks.json`` holds the picks of the code they were
recorded with; ``test_recorded_picks`` compares. Record again only for a change that is
meant to move decisions:

    python -m tests.scheduling.picks_stream --write
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path

import orjson
from prometheus_client import CollectorRegistry

from extproc.errors import ExtProcError
from extproc.pods import Pod, PodId, PodMetrics
from extproc.routing.flow.config import parse_flow_control
from extproc.routing.outcome_metrics import OutcomeMetrics
from extproc.routing.router import Router
from extproc.scheduling.config import build_scheduler, named_config_text, parse_config
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.sessions import SessionStore

RECORDED = Path(__file__).parent / "data" / "recorded_picks.json"
CONFIGS = ("default", "kthena", "cost-aware")
POD_COUNTS = (16, 80)  # the small-pool path and the sorted one (past the scheduler's SMALL_RANK)
NUM_REQUESTS = 400
MODEL = "m"
SEED = 31


def make_pods(num_pods: int, rng: random.Random, gone: int | None = None) -> list[Pod]:
    """Ready pods with seeded scraped metrics; ``gone``: a pod left out."""
    pods = []
    for i in range(num_pods):
        if i == gone:
            continue
        measured = rng.random() < 0.8
        metrics = PodMetrics(
            waiting=rng.choice([0, 0, 0, 1, 2, 3, 5, 12]),
            running=rng.randrange(0, 24),
            kv_usage=rng.random() * 0.95,
            ttft_s=rng.uniform(0.02, 0.8) if measured else None,
            itl_s=rng.uniform(0.005, 0.05) if measured else None,
            kv_capacity_tokens=rng.choice([None, 20_000, 200_000]),
        )
        pods.append(
            Pod(
                id=PodId("ns", f"pod-{i}"),
                address=f"10.1.{i // 200}.{i % 200 + 1}:8000",
                models=frozenset({MODEL}),
                metrics=metrics,
            )
        )
    return pods


def make_router(config: str, pods: list[Pod]) -> Router:
    registry = CollectorRegistry()
    in_flight = InFlight()
    parsed = parse_config(named_config_text(config), config)
    scheduler = build_scheduler(parsed, registry, in_flight, SessionStore(ttl_s=600))
    scheduler.rng = random.Random(SEED)
    flow = replace(parse_flow_control(parsed.flow_control, parsed.source), scraped=True)
    router = Router(
        scheduler, pods, in_flight=in_flight, registry=registry, carry_records=True, flow=flow
    )
    router.observers.append(OutcomeMetrics(registry))
    return router


def _words(rng: random.Random, n: int) -> str:
    vocab = ("cache", "token", "prefill", "decode", "pod", "route", "queue", "tenant", "kv")
    return " ".join(rng.choice(vocab) for _ in range(n))


def make_requests(rng: random.Random) -> list[tuple[bytes, dict[str, str]]]:
    """The stream's bodies and headers, in order."""
    system = "You are the support assistant of a large company. " * 60  # ~3 KB, shared
    chats: list[list[dict[str, str]]] = [[] for _ in range(12)]
    out: list[tuple[bytes, dict[str, str]]] = []
    for n in range(NUM_REQUESTS):
        kind = rng.random()
        headers: dict[str, str] = {}
        if kind < 0.4:  # a multi-turn chat: its history resent, one more turn
            c = rng.randrange(len(chats))
            chats[c].append({"role": "user", "content": _words(rng, rng.randrange(20, 400))})
            messages = [{"role": "system", "content": f"Chat {c}. " + system}, *chats[c]]
            body: dict[str, object] = {"model": MODEL, "messages": messages}
            chats[c].append({"role": "assistant", "content": _words(rng, 60)})
            if c % 3 == 0:
                headers["x-session-id"] = f"chat-{c}"
        elif kind < 0.7:  # a tenant's one-shot question after the shared system prompt
            tenant = rng.randrange(4)
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": f"Tenant {tenant}. " + system},
                    {"role": "user", "content": _words(rng, rng.randrange(5, 80))},
                ],
                "max_tokens": 32,
            }
        elif kind < 0.9:  # a completion over a long document, some documents repeated
            doc = rng.randrange(6)
            body = {
                "model": MODEL,
                "prompt": f"Document {doc}: " + _words(random.Random(doc), 1500) + _words(rng, 20),
            }
        else:  # a short prompt (under one block) or another model (an error)
            body = {"model": MODEL if n % 2 else "nope", "prompt": _words(rng, 5)}
        out.append((orjson.dumps(body), headers))
    return out


def run_stream(config: str, num_pods: int) -> list[str]:
    """Each request's decision: its destination list (``a,b,c``), or ``error:<code>``."""
    rng = random.Random(f"{SEED}-{config}-{num_pods}")
    router = make_router(config, make_pods(num_pods, rng))
    picks: list[str] = []
    open_ids: list[tuple[str, str]] = []  # (request id, address it will be served by)
    for n, (body, headers) in enumerate(make_requests(random.Random(SEED))):
        if n and n % 40 == 0:  # a new scrape: new metrics; once, a pod gone and back
            gone = 3 if n == 160 else None
            router.set_pods(make_pods(num_pods, rng, gone))
        request_id = f"r{n}"
        path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
        try:
            decision = router.route(path, body, request_id=request_id, headers=headers)
        except ExtProcError as exc:
            picks.append(f"error:{exc.code}")
            continue
        picks.append(decision.destination)
        served = decision.pods[0].address
        if rng.random() < 0.1 and len(decision.pods) > 1:  # the first failed: a retry
            served = decision.pods[1].address
        open_ids.append((request_id, served))
        while len(open_ids) > rng.randrange(0, 6):  # ends come out of order
            done_id, done_at = open_ids.pop(rng.randrange(len(open_ids)))
            outcome = rng.random()
            if outcome < 0.05:
                router.abandon(done_id)
            else:
                router.complete(done_id, done_at, outcome > 0.12, attempts=1 + (outcome > 0.9))
    return picks


def run_all() -> dict[str, list[str]]:
    return {
        f"{config}/{num_pods}": run_stream(config, num_pods)
        for config in CONFIGS
        for num_pods in POD_COUNTS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"record the picks in {RECORDED}")
    args = parser.parse_args()
    picks = run_all()
    if args.write:
        RECORDED.parent.mkdir(exist_ok=True)
        RECORDED.write_text(json.dumps(picks, indent=0) + "\n")
        print(f"wrote {RECORDED}")
    else:
        for name, decisions in picks.items():
            print(name, sum(d.startswith("error") for d in decisions), "errors")


if __name__ == "__main__":
    main()
