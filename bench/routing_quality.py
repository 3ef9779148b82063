"""Routing quality: the same workloads through every router, on the same pods, in one run.

    python -m bench.routing_quality [--pods sim,vllm] [--contenders ...] [--workloads ...]

For each pod set (many simulated pods; 3 real vLLM pods, `--vllm-pods`), each workload and each
contender (``bench/contenders.py``): every pod's prefix cache is emptied, the router
starts, the workload is replayed open loop and streamed (``bench/replay.py``), the router
stops. Measured from the pods' own counters: the engine-side prefix hit ratio (hit
tokens / prompt tokens, next to the workload's bound with unlimited cache and perfect
routing) and the requests each pod served; from the client: TTFT p50/p99, completed
requests and output tokens per second. Every run is bounded in requests and seconds.
Workloads (``bench/workloads.py``, described in ``NOTES``): ``conversation``,
``synthetic``, ``tenants``, ``multiturn``, ``longchat``, ``groups`` (issue 35). Each
``extproc-*`` row's verdict needs the best peer's hit ratio and a TTFT p99 no worse than
the best peer's nor round robin's.
Writes ``bench/results/routing_quality.md`` (+ PNG charts, + JSON) and prints the
configuration to repeat it. Needs ``python -m e2e.real_vllm.prepare --peers`` first.
The simulated pods run their pseudo-tokenizer without KV events, as in the recorded
results, unless ``extproc-precise`` runs (or ``--sim-precise``): then, for every
contender of the run, they tokenize with the Qwen3 tokenizer and publish KV events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

from bench import report
from bench.bench_pods import PodSet, sim_pod_set, vllm_pod_set
from bench.contenders import CONTENDERS
from bench.envoy_timings import LOG_NAME, RequestTiming, read_timings
from bench.replay import Outcome, replay
from bench.workloads import (
    BYTES_PER_TOKEN,
    Sizing,
    TimedRequest,
    group_sessions,
    lora_sessions,
    mooncake,
    multi_tenant_burst,
    multi_turn,
    prefix_bound,
)
from e2e.real_vllm.pods import cores_shared, num_cores
from extproc.sim.launch import lora_args
from extproc.sim.timing import DEFAULT_PROFILE

WORKLOADS = ("conversation", "synthetic", "tenants", "multiturn", "longchat", "groups", "lora")
LORA_WORKLOAD = "lora"  # only on its own pod set: simulated pods with adapters and slots
LORA_ADAPTERS, LORA_SLOTS = 16, 2
SIM_BLOCKS = 2048
SIM_PROFILE = DEFAULT_PROFILE
SIM_ENGINE = [
    "--num-gpu-blocks", str(SIM_BLOCKS), "--max-num-seqs", "8", "--timing-profile", SIM_PROFILE
]  # fmt: skip


def build_workload(name: str, kind: str, args: argparse.Namespace) -> list[TimedRequest]:
    """The requests of one workload, sized for the pods (simulated: big; vLLM: 512 tokens)."""
    sim = kind == "sim"
    sizing = Sizing(
        scale=16 if sim else 64,
        max_prompt_tokens=8000 if sim else 280,
        max_output_tokens=32 if sim else 8,
        model="sim-llm" if sim else "qwen3-tiny",
    )
    if name in ("conversation", "synthetic"):
        limit = args.trace_requests if sim else args.vllm_trace_requests
        return mooncake(name, sizing, limit, args.speedup if sim else args.vllm_speedup)
    if name == "tenants":
        return multi_tenant_burst(sizing, rate=10.0 if sim else 3.0, burst_factor=4.0 if sim else 3.0,
                                  system_tokens=600 if sim else 150)  # fmt: skip
    if name == "longchat":  # long histories, think time, working set > the caches (sim)
        return multi_turn(sizing, sessions=150 if sim else 30, turns=6 if sim else 5,
                          rate=4.0 if sim else 1.0, think_s=5.0, system_tokens=100 if sim else 20,
                          turn_tokens=250 if sim else 30, seed=5)  # fmt: skip
    if name == LORA_WORKLOAD:  # issue 32: chats on 16 adapters, Zipf popularity; 768
        # requests, so that a run's p99 is not its third-slowest request (256 before)
        return lora_sessions(sizing, adapters=LORA_ADAPTERS, sessions=192)
    if name == "groups":  # issue 35: histories growing in groups at a fixed rate
        if sim:
            return group_sessions(sizing)
        return group_sessions(  # histories start over at ~280 tokens, every ~5 rounds
            sizing, groups=3, sessions_per_group=3, system_tokens=40, user_tokens=(20, 30),
            answer_tokens=8, rate=2.0, requests=120,
        )  # fmt: skip
    return multi_turn(sizing, sessions=48 if sim else 20, turns=6 if sim else 4,
                      system_tokens=200 if sim else 40, turn_tokens=80 if sim else 20)  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(
    outcomes: list[Outcome], wall_s: float, before: list[dict[str, float]],
    after: list[dict[str, float]], block_tokens: int,
    timings: Mapping[int, RequestTiming] | None = None,
) -> dict[str, Any]:  # fmt: skip
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before, strict=True))
    ok = [o for o in outcomes if o.ok]
    ttfts = [o.ttft_s * 1000 for o in ok if o.ttft_s is not None]
    return {
        "hit_ratio": hits / queries if queries else 0.0,
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p99_ms": _pct(ttfts, 0.99),
        "req_per_s": len(ok) / wall_s,
        "out_tok_per_s": sum(o.completion_tokens for o in ok) / wall_s,
        "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok}),
        "per_pod": [a["served"] - b["served"] for a, b in zip(after, before, strict=True)],
        "adapter_loads": sum(
            a["adapter_loads"] - b["adapter_loads"] for a, b in zip(after, before, strict=True)
        ),
        "wall_s": wall_s,
        "slowest": slowest(ok, timings=timings),
        **lost_histories(ok, block_tokens),
        "history_lost_turns": lost_turns(ok, block_tokens),
    }


def slowest(
    outcomes: list[Outcome], n: int = 3, timings: Mapping[int, RequestTiming] | None = None
) -> list[dict[str, Any]]:
    """The ``n`` longest TTFTs and when their requests were due: tells a tail made of a
    few stalls (a run's start, one moment) from a tail spread over the run. With Envoy's
    ``timings`` (``bench.envoy_timings``), each also says where its time went."""
    timed = sorted((o for o in outcomes if o.ttft_s is not None), key=lambda o: -(o.ttft_s or 0))
    out: list[dict[str, Any]] = []
    for o in timed[:n]:
        entry: dict[str, Any] = {
            "at_s": round(o.at_s, 2),
            "ttft_ms": round((o.ttft_s or 0) * 1000, 1),
        }
        if timings and o.index is not None and (t := timings.get(o.index)) is not None:
            entry |= asdict(t)
        out.append(entry)
    return out


def _slow_text(entry: dict[str, Any]) -> str:
    """A slowest entry for the log line: due time and TTFT, and Envoy's spans if known."""
    text = f"{entry['at_s']} s: {entry['ttft_ms']} ms"
    if "pod" in entry:
        text += (f" (picker {entry['picker_ms']}, pod headers {entry['pod_ms']} ms, {entry['pod']},"
                 f" {entry['attempts']} attempts, flags {entry['flags']})")  # fmt: skip
    return text


def lost_histories(outcomes: list[Outcome], block_tokens: int) -> dict[str, int]:
    """Chat turns that did not find their own history cached: a turn sent after its
    session's previous turn ended should be served from a cache holding that turn's prompt
    (its whole blocks, one block of slack for the chat template's last tokens); when its
    ``cached_tokens`` are fewer, its chat moved to another pod or the pod evicted it.
    Tells a hit-ratio gap made of moved chats from one made of copies of a shared prefix.
    Empty when the workload has no sessions or the pods report no cached tokens."""
    checked = list(_checked_turns(outcomes, block_tokens))
    lost = sum(t.lost for t in checked)
    return {"history_turns": len(checked), "history_lost": lost} if checked else {}


def lost_turns(outcomes: list[Outcome], block_tokens: int) -> list[dict[str, Any]]:
    """The turns ``lost_histories`` counts lost, each with its chat, its place in the chat
    (the first turn is 0), when it was due and the tokens it found and should have: tells
    chats moved at a run's start from moves spread over it."""
    return [
        {"session": t.session, "turn": t.number, "at_s": round(t.turn.at_s, 2),
         "cached": t.turn.cached_tokens or 0, "held": t.held}
        for t in _checked_turns(outcomes, block_tokens)
        if t.lost
    ]  # fmt: skip


class _CheckedTurn(NamedTuple):
    """A chat turn sent after its previous one ended."""

    session: int
    number: int  # its place in the chat (the first turn is 0, never checked)
    turn: Outcome
    held: int  # the tokens of its history the pod should hold

    @property
    def lost(self) -> bool:
        """It found fewer cached tokens than its history: moved or evicted."""
        return (self.turn.cached_tokens or 0) < self.held


def _checked_turns(outcomes: list[Outcome], block_tokens: int) -> Iterator[_CheckedTurn]:
    """Each chat turn sent after its previous one ended, with the history it should find."""
    turns: dict[int, list[Outcome]] = {}
    for o in outcomes:
        if o.session is not None and o.prompt_tokens is not None and o.cached_tokens is not None:
            turns.setdefault(o.session, []).append(o)
    for session, chat in turns.items():
        chat.sort(key=lambda o: o.at_s)
        for number, (prev, turn) in enumerate(pairwise(chat), start=1):
            if turn.at_s < prev.at_s + prev.e2e_s:
                continue  # sent while its previous turn still ran
            held = (prev.prompt_tokens or 0) // block_tokens * block_tokens - block_tokens
            yield _CheckedTurn(session, number, turn, held)


PEERS = ("sglang-router", "vllm-router")


def _summed(reps: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """``keys`` summed over the repetitions, when every one has them."""
    if not all(k in r for r in reps for k in keys):
        return {}
    return {k: sum(r[k] for r in reps) for k in keys}


def _slowest_of(reps: list[dict[str, Any]], n: int = 3) -> list[dict[str, Any]]:
    """The ``n`` slowest requests over every repetition, each with its repetition."""
    entries = [{**e, "rep": r["rep"]} for r in reps for e in r["slowest"]]
    return sorted(entries, key=lambda e: -e["ttft_ms"])[:n]


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, contender) over its repetitions: mean hit ratio, median
    TTFT p50 and p99 (with each repetition's p99), summed failures, errors and requests
    per pod, the slowest requests of all; each ``extproc-*`` row gets its verdict against
    the best peer and round robin of the same workload."""
    keys = list(dict.fromkeys((r["workload"], r["contender"]) for r in runs))
    rows = []
    for workload, contender in keys:
        reps = [r for r in runs if (r["workload"], r["contender"]) == (workload, contender)]
        p99s = [r["ttft_p99_ms"] for r in reps]
        first = {k: v for k, v in reps[0].items() if k not in ("rep", "wall_s")}
        rows.append({
            **first,
            "repetitions": len(reps),
            "hit_ratio": statistics.fmean(r["hit_ratio"] for r in reps),
            "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in reps),
            "ttft_p99_ms": statistics.median(p99s),
            "ttft_p99_each_ms": p99s,
            "req_per_s": statistics.fmean(r["req_per_s"] for r in reps),
            "out_tok_per_s": statistics.fmean(r["out_tok_per_s"] for r in reps),
            "failed": sum(r["failed"] for r in reps),
            "errors": sorted({e for r in reps for e in r["errors"]}),
            "slowest": _slowest_of(reps),
            "per_pod": [sum(c) for c in zip(*(r["per_pod"] for r in reps), strict=True)],
            "adapter_loads": statistics.fmean(r.get("adapter_loads", 0) for r in reps),
            **_summed(reps, ("history_turns", "history_lost")),
        })  # fmt: skip
    for row in rows:
        if row["contender"].startswith("extproc-"):
            _judge(row, [r for r in rows if r["workload"] == row["workload"]])
    return rows


def _judge(row: dict[str, Any], workload_rows: list[dict[str, Any]]) -> None:
    """An ``extproc-*`` row's verdict, when a peer ran: "win" when its hit ratio is at least
    the best peer's and its TTFT p99 at most both the best peer's and, when it ran, round
    robin's (``envoy-rr``), with no failed request; the brackets give each comparison."""
    peers = [r for r in workload_rows if r["contender"] in PEERS]
    if not peers:
        return
    best_hit = max(r["hit_ratio"] for r in peers)
    best_p99 = min(r["ttft_p99_ms"] for r in peers)
    hit_ok = row["hit_ratio"] >= best_hit
    p99_ok = row["ttft_p99_ms"] <= best_p99
    texts = [f"hit {'>=' if hit_ok else '<'} {best_hit:.3f}",
             f"p99 {'<=' if p99_ok else '>'} {best_p99:.0f}"]  # fmt: skip
    rr_ok = True
    if (rr_p99 := report.rr_p99(workload_rows)) is not None:
        rr_ok = row["ttft_p99_ms"] <= rr_p99
        texts.append(f"p99 {'<=' if rr_ok else '>'} rr {rr_p99:.0f}")
    loads_ok = True
    if row.get("adapter_loads"):  # the lora workload: fewer adapter loads than the peers'
        fewest = min(r.get("adapter_loads", 0) for r in peers)
        loads_ok = row["adapter_loads"] <= fewest
        texts.append(f"loads {'<=' if loads_ok else '>'} {fewest:.0f}")
    won = hit_ok and p99_ok and rr_ok and loads_ok and not row["failed"]
    row["verdict"] = f"{'win' if won else 'loss'} ({', '.join(texts)})"


def workloads_of(kind: str, workloads: list[str]) -> list[str]:
    """The workloads a pod set runs: ``lora`` alone on the pods with adapters."""
    return [w for w in workloads if (w == LORA_WORKLOAD) == (kind == "sim-lora")]


def run_pods(
    pods: PodSet, workloads: list[str], args: argparse.Namespace, log_dir: Path
) -> list[dict[str, Any]]:
    rows = []
    block_bytes = pods.block_size * BYTES_PER_TOKEN
    for workload in workloads:
        requests = build_workload(workload, pods.kind, args)
        bound = prefix_bound(requests, block_bytes)
        print(f"[{pods.kind}] {workload}: {len(requests)} requests over "
              f"{requests[-1].at_s:.0f} s, bound {bound:.3f}", flush=True)  # fmt: skip
        for rep, name in ((r, n) for r in range(args.repeat) for n in args.contenders):
            pods.reset_all()
            (log_dir / LOG_NAME).unlink(missing_ok=True)
            with CONTENDERS[name](pods, log_dir) as url:
                before = pods.counters()  # after a contender's own start-up requests
                outcomes, wall = asyncio.run(replay(url, requests, deadline_s=args.deadline_s))
            time.sleep(0.5)  # the last counters settle
            row = {"workload": workload, "contender": name, "bound": bound, "requests": len(requests),
                   "rep": rep, **summarize(outcomes, wall, before, pods.counters(), pods.block_size,
                                           read_timings(log_dir / LOG_NAME))}  # fmt: skip
            print(f"  {rep} {name:14s} hit {row['hit_ratio']:.3f}  ttft p50 {row['ttft_p50_ms']:.0f} "
                  f"p99 {row['ttft_p99_ms']:.0f} ms  {row['req_per_s']:.1f} req/s  "
                  f"failed {row['failed']} {row['errors']}  per pod {row['per_pod']}  "
                  f"slowest {[_slow_text(s) for s in row['slowest']]}"
                  + (f"  history lost {cell} turns" if (cell := report.history_cell(row)) else ""),
                  flush=True)  # fmt: skip
            rows.append(row)
    return rows


def sim_precise(args: argparse.Namespace) -> bool:
    """Whether the simulated pods tokenize with Qwen3 and publish KV events: only when
    ``extproc-precise`` runs (or ``--sim-precise``), so that other runs keep the setup of
    the recorded results (the pseudo-tokenizer, no events)."""
    return bool(args.sim_precise) or "extproc-precise" in args.contenders


def pod_sets(
    args: argparse.Namespace, log_dir: Path
) -> dict[str, tuple[str, str, Callable[[], AbstractContextManager[PodSet]]]]:
    precise = sim_precise(args)
    engine = " ".join(SIM_ENGINE)
    if precise:
        sim_setup = (
            f"{args.sim_pods} simulated pods (`extproc sim-pods {engine} --tokenizer QWEN3_DIR "
            f"--kv-events-endpoint tcp://127.0.0.1:*`: 2,048 blocks of 16 tokens each, at most 8 "
            f"running requests, the {SIM_PROFILE} timing profile, vLLM V1 scheduling with "
            f"chunked prefill; prompts tokenized by the vLLM pods' Qwen3 tokenizer and chat "
            f"template and KV events published, for every contender of this "
            f"run, since `extproc-precise` needs them). Mooncake traces: first "
            f"{args.trace_requests} requests, token counts / 16 (at 4 bytes a token), clock "
            f"x{args.speedup}."
        )
    else:
        sim_setup = (
            f"{args.sim_pods} simulated pods (`extproc sim-pods {engine}`: 2,048 "
            f"blocks of 16 tokens each, at most 8 running requests, the {SIM_PROFILE} timing "
            f"profile, vLLM V1 scheduling with chunked prefill; the pseudo-tokenizer, no KV "
            f"events). Mooncake traces: first {args.trace_requests} requests, token counts / "
            f"16, clock x{args.speedup}."
        )
    binding = (
        f"on {num_cores()} shared cores"
        if cores_shared(args.vllm_pods)
        else "each engine bound to its own core (client, Envoy and routers on all of them)"
    )
    quota = args.vllm_cpu_quota
    if quota is not None:
        binding += (
            f", each pod (server and engine) held to {quota:g} of a core by a CFS quota in "
            f"10 ms periods (`--vllm-cpu-quota`, `e2e/real_vllm/cpu_quota.py`): equal, "
            f"fixed compute, whatever the other pods and the routers do"
        )
    vllm_setup = (
        f"{args.vllm_pods} real vLLM-CPU pod{'s' if args.vllm_pods != 1 else ''} (tiny random "
        f"Qwen3, 2 layers, blocks of 32 tokens, prefix caching) {binding}. Mooncake traces: "
        f"first {args.vllm_trace_requests} requests, token counts / 64, prompts cut to ~280 "
        f"tokens, clock x{args.vllm_speedup}."
    )
    # Capped pods are another pod set: their section does not replace the one without.
    vllm_kind, vllm_title = (
        ("vllm", "Real vLLM pods")
        if quota is None
        else ("vllm-quota", f"Real vLLM pods, {quota:g} of a core each")
    )
    # The simulated pods with events are another pod set: their section does not replace
    # the one of the pods without.
    sim_kind, sim_title = (
        ("sim-events", "Simulated pods with KV events") if precise else ("sim", "Simulated pods")
    )
    lora_engine = [*SIM_ENGINE, *lora_args(LORA_ADAPTERS, LORA_SLOTS)]
    lora_setup = (
        f"{args.lora_pods} simulated pods (`extproc sim-pods {engine} --enable-lora "
        f"--max-loras {LORA_SLOTS} --lora-modules lora-0=... lora-{LORA_ADAPTERS - 1}=...`: "
        f"{LORA_ADAPTERS} LoRA adapters registered on every pod, {LORA_SLOTS} GPU slots each, "
        f"an adapter brought into a slot lengthens that step by the default 50 ms, "
        f"otherwise as the simulated pods above)."
    )
    return {
        sim_kind: (sim_title, sim_setup,
                   lambda: sim_pod_set(args.sim_pods, SIM_ENGINE, log_dir, precise)),
        "sim-lora": ("Simulated pods with LoRA adapters", lora_setup,
                     lambda: sim_pod_set(args.lora_pods, lora_engine, log_dir)),
        vllm_kind: (vllm_title, vllm_setup,
                    lambda: vllm_pod_set(args.vllm_pods, log_dir, quota)),
    }  # fmt: skip


NOTES = """\
Contenders run one after the other on the same pods, each from empty prefix caches; with
`--repeat N` the contenders take turns N times (each turn in the same order), and a row
gives the mean hit ratio, the median TTFT p50 and the median TTFT p99 (each repetition's
p99 in brackets). `envoy-rr` is Envoy alone (round robin), `sglang-rr` sglang-router round robin
(no cache policy; with `envoy-rr`, what the proxy alone adds). `extproc-*` is Envoy + extproc
with a scheduler configuration: `default` (shipped, `extproc/data/config.yaml`: the
estimated-ttft cost model), `kthena` (`extproc/data/kthena.yaml`, Kthena's default and
extproc's before: least-request filter; least-request, gpu-usage, least-latency and
prefix-cache scores, weight 1 each), `cost-aware` (Kthena's plus cost-aware),
`least-request` and `prefix-cache` alone (`bench/configs/`), `precise`
(`extproc/data/precise.yaml`: the default's cost model reading precise-prefix-cache's
exact cached-token counts from the pods' KV events; it starts serving once every pod's
view is trusted); extproc scrapes the pods' `/metrics` every 200 ms. `sglang-router` and
`vllm-router` use `cache_aware` (cache threshold 0.3, balance thresholds 64 / 1.5).
The simulated pods run their pseudo-tokenizer (about 4 bytes a token) and publish no KV
events, the setup of the runs recorded before `extproc-precise` existed, unless
`extproc-precise` is among the contenders or `--sim-precise` is given: then they tokenize
with the vLLM pods' Qwen3 tokenizer and chat template and publish KV events for every
contender of the run, whose simulated rows then compare only with runs made the same way
(the section's setup says which). The verdict of an `extproc-*` row: "win"
when its hit ratio is at least the best peer's and its TTFT p99 at most the best peer's
(each best taken separately) and at most round robin's (`envoy-rr`'s, the "RR p99 ms"
column, when it ran), with no failed request; otherwise "loss". Rows recorded before
issue 35 were judged against the peers alone (their verdicts do not mention rr).
Workloads: `conversation` and `synthetic` are the Mooncake traces; `tenants` 8 tenants with
a burst on one; `multiturn` 48 chat sessions sharing a system prompt; `longchat` (added
for issue 14, not used to choose the default's arguments) 150 chat sessions of 6 turns of
250 tokens (simulated pods; 30 sessions of 5 turns of 30 tokens on vLLM) with 5 s mean
think time, sessions starting 4 a second, so about 100 are open at once and their
histories (about 350,000 tokens) exceed the 8 pods' caches (262,144 tokens); `groups`
(added for issue 35, not used to choose the default's arguments beyond what the offline
simulator's `groups` showed) 13 groups of 5 chat sessions, each group with a system prompt
of 300 tokens of its own, every round of a session re-sending its history plus 250-350
new tokens (and a 32-token answer), 1,000 requests at a fixed 20 a second, so histories
grow to about 6,000 tokens in some 15 rounds: a group's 5 histories (about 28,000 tokens)
fit one pod's cache (32,768), two piled on one pod outgrow it past mid-run (vLLM: 3
groups of 3 sessions, 40-token system prompts, 20-30 new tokens a round, 120 requests at
2 a second; a history starts over as a new session before it passes ~280 tokens);
`lora` (issue 32, on its own pods) 192 chat sessions of 4 turns, 768 requests over 60 s,
each on one of 16 LoRA adapters drawn with Zipf popularity, an adapter's chats sharing its
system prompt. Hit ratio: the pods' `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`
over the run; bound: the same with unlimited cache and perfect routing, from the
prompts, in blocks of the pods' size at 4 bytes a token (exact for the pseudo-tokenizer;
the Qwen3 tokenizer of the vLLM pods, and of the simulated pods run for `extproc-precise`,
makes about 2.6-2.7 bytes a token of these texts and the chat template adds its own, so
there the bound is approximate and can be exceeded). TTFT:
client side, streamed, through the router. All on one 2-core machine shared by client,
router and pods, so absolute latencies include CPU contention
and single p99 values are noisy; compare contenders within a run. Chat turns lost history
(chat workloads): turns sent after their session's previous turn ended whose cached tokens
(the pods' `usage.prompt_tokens_details`) are fewer than that turn's whole blocks less one,
of those checked: a chat moved or evicted. The JSON keeps each run's three slowest TTFTs
with when they were due and, behind Envoy + extproc, Envoy's spans for each
(`bench/envoy_timings.py`), and each repetition's lost chat turns (chat, place, due time). docs/routing-quality.md reads the results."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", default="sim,vllm", help="sim, vllm or both")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--sim-pods", type=int, default=8)
    parser.add_argument("--lora-pods", type=int, default=4, help="simulated pods, lora workload")
    parser.add_argument("--sim-precise", action="store_true",
                        help="simulated pods tokenize with Qwen3 and publish KV events even "
                        "without extproc-precise (on by default with it)")  # fmt: skip
    parser.add_argument("--trace-requests", type=int, default=1000)
    parser.add_argument("--speedup", type=float, default=10.0, help="trace clock, simulated pods")
    parser.add_argument(
        "--vllm-pods",
        type=int,
        default=3,
        help="real vLLM pods, each engine bound to core i mod the cores",
    )
    parser.add_argument(
        "--vllm-cpu-quota",
        type=float,
        default=None,
        metavar="CORES",
        help="hold each real vLLM pod to this many cores (a cgroup CFS quota; needs root): "
        "pods with equal, fixed compute, a section of its own in the results",
    )
    parser.add_argument("--vllm-trace-requests", type=int, default=150)
    parser.add_argument("--vllm-speedup", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each contender")
    parser.add_argument("--deadline-s", type=float, default=120.0, help="per contender run")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop what started
    args.contenders = args.contenders.split(",")
    args.workloads = args.workloads.split(",")
    command = "python -m bench.routing_quality " + shlex.join(sys.argv[1:])
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["sim_engine"] = SIM_ENGINE
    print(command, "\n", json.dumps(config), flush=True)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        for kind, (title, setup, start) in pod_sets(args, Path(tmp)).items():
            workloads = workloads_of(kind, args.workloads)
            if kind.partition("-")[0] not in args.pods.split(",") or not workloads:
                continue
            started = utc_now()
            with start() as pods:
                each = run_pods(pods, workloads, args, Path(tmp))
            runs[kind] = {"title": title, "setup": setup, "runs": each, "rows": aggregate(each),
                          "command": command, "config_json": json.dumps(config, indent=1),
                          "utc": f"{started} to {utc_now()}"}  # fmt: skip
    # Another pod set's section, from an earlier run into the same directory, stays.
    path = args.out / "routing_quality.json"
    results = report.merged({"runs": runs}, json.loads(path.read_text()) if path.exists() else None)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    print("wrote", report.write(results, args.out, NOTES))


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


if __name__ == "__main__":
    main()
