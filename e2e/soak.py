"""A bounded soak through real Envoy: many distinct prefixes, all three APIs, salts, and
streaming mixed in, against simulated pods; extproc watched from /proc as it runs.

    python -m e2e.soak --requests 100000            # the full soak (minutes)
    python -m e2e.soak --requests 4000 --json       # what the suite runs (e2e/test_soak.py)

Pass criteria (``SoakReport.problems`` lists what failed; the exit code is 1 if any):

* zero unexpected errors: every answer is 200, every stream ends with ``[DONE]``;
* the prefix index never holds more than pods x maxHashCacheSize entries (a small
  maxHashCacheSize, so that the bound is reached and eviction runs all the time);
* extproc's RSS, threads and file descriptors are sampled every ``--sample-every``
  requests; after warm-up (the first fifth of the requests, at least 1,000) RSS stops
  growing: neither the end sample nor the trend (a least-squares line through the
  samples since warm-up, over that span) adds more than ``--rss-slack-mb``, and no
  sample holds more than 2 threads or file descriptors beyond warm-up's;
* every success is recorded, once: extproc's count of records is the successes', and
  each success's end reached extproc once, on the pod that served it (Envoy answers
  with the request's id, ``--log-picks`` logs each end with its id and pod); every
  routed request's end reaches extproc: nothing pending at the end, no traceback.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from e2e.support import MODEL, body_for, metric
from extproc.sim.launch import Stack, run_stack, spawn_sim_pods
from testkit.usage import Usage, usage_of
from testkit.waiting import wait_until

MB = 1024 * 1024
APIS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
CONFIG = """\
scheduler:
  plugins:
    Filter: {{enabled: [least-request]}}
    Score:
      enabled:
        - {{name: prefix-cache, weight: 1}}
        - {{name: least-request, weight: 1}}
  pluginConfig:
    - name: prefix-cache
      args: {{blockSizeToHash: 64, maxBlocksToMatch: 128, maxHashCacheSize: {cache}, topKMatches: 5}}
"""
EXTPROC_ARGS = ("--log-picks", "--log-format", "json")  # a line per end: its id and pod
POD_NAMESPACE = "default"  # the simulated pods'


@dataclass
class Sample:
    requests: int  # answered so far
    seconds: float
    rss_mb: float
    threads: int
    fds: int
    index_entries: int


@dataclass
class SoakReport:
    requests: int
    pods: int
    max_hash_cache_size: int
    seconds: float = 0.0
    requests_per_s: float = 0.0
    streamed: int = 0
    prefixes: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)  # the first few
    num_unexpected: int = 0
    max_index_entries: int = 0
    index_bound: int = 0
    recorded: int = 0
    pending_at_end: int = 0
    ends_checked: int = 0  # successes whose end was found once, on the pod that served
    end_mismatches: list[str] = field(default_factory=list)  # the first few
    num_end_mismatches: int = 0
    samples: list[Sample] = field(default_factory=list)
    warm: Sample | None = None
    end: Sample | None = None
    rss_trend_mb: float = 0.0  # the fitted growth from warm-up to the end
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        w, e = self.warm, self.end
        assert w is not None and e is not None
        return (
            f"{self.requests} requests ({self.streamed} streamed, {self.prefixes} distinct "
            f"prefixes) in {self.seconds:.0f} s ({self.requests_per_s:.0f}/s) through Envoy to "
            f"{self.pods} pods: {self.num_unexpected} unexpected answers, statuses "
            f"{self.statuses}; index at most {self.max_index_entries} of {self.index_bound} "
            f"entries; extproc after warm-up (request {w.requests}) RSS {w.rss_mb:.1f} MB, "
            f"{w.threads} threads, {w.fds} fds; at the end RSS {e.rss_mb:.1f} MB, "
            f"{e.threads} threads, {e.fds} fds, RSS trend {self.rss_trend_mb:+.1f} MB over "
            f"{len(self.samples)} samples; {self.recorded} recorded, {self.ends_checked} ends "
            f"found once on the serving pod, {self.pending_at_end} pending at the end"
            + ("" if self.ok else f"; PROBLEMS: {'; '.join(self.problems)}")
        )


class Workload:
    """Request ``i``: a hot prefix (70%) or one of the long tail, an API, sometimes a
    salt or a stream; deterministic for a seed."""

    def __init__(self, num_prefixes: int, stream_every: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.prefixes = [
            f"[doc {n}:{rng.getrandbits(64):x}] "
            + "Policy text for the soak, " * rng.randint(10, 60)
            for n in range(num_prefixes)
        ]
        self.hot = self.prefixes[: max(1, num_prefixes // 50)]
        self.stream_every = stream_every
        self.seed = seed

    def request(self, i: int) -> tuple[str, dict[str, object], bool]:
        rng = random.Random(self.seed * 1_000_003 + i)
        prefix = rng.choice(self.hot) if rng.random() < 0.7 else rng.choice(self.prefixes)
        api = APIS[i % 3]
        stream = self.stream_every > 0 and i % self.stream_every == 0
        extra: dict[str, object] = {"stream": True} if stream else {}
        if rng.random() < 0.1:
            extra["cache_salt"] = f"tenant-{rng.randint(0, 3)}"
        return api, body_for(api, prefix, f"question {i}?", **extra), stream


@dataclass
class Answer:
    """One request's outcome: None when it ended as expected, else what went wrong; the
    id Envoy gave it and the pod that served it, when answered."""

    problem: str | None
    request_id: str | None = None
    pod: str | None = None


def _answer(resp: httpx.Response, problem: str | None) -> Answer:
    return Answer(problem, resp.headers.get("x-request-id"), resp.headers.get("x-sim-pod"))


def _send(client: httpx.Client, api: str, body: dict[str, object], stream: bool) -> Answer:
    """One request, and how it ended."""
    try:
        if not stream:
            resp = client.post(api, json=body)
            ok = resp.status_code == 200
            return _answer(resp, None if ok else f"{resp.status_code} {resp.text[:200]}")
        with client.stream("POST", api, json=body) as resp:
            if resp.status_code != 200:
                return _answer(resp, f"{resp.status_code} {resp.read()[:200]!r}")
            last = ""
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    last = line
            done = last == "data: [DONE]" or (
                api == "/v1/responses" and "response.completed" in last
            )
            return _answer(resp, None if done else f"stream ended without its end: {last[:120]!r}")
    except httpx.HTTPError as exc:
        return Answer(f"{type(exc).__name__}: {exc}")


def request_id_in_response(config: dict[str, Any]) -> dict[str, Any]:
    """Envoy answers with the x-request-id it made, the one extproc logs the end with."""
    listener = config["static_resources"]["listeners"][0]
    listener["filter_chains"][0]["filters"][0]["typed_config"][
        "always_set_request_id_in_response"
    ] = True
    return config


def _sample(stack: Stack, answered: int, started: float) -> Sample:
    usage: Usage = usage_of(stack.extproc.pid)
    return Sample(
        answered,
        round(time.monotonic() - started, 2),
        round(usage.rss_bytes / MB, 1),
        usage.threads,
        usage.fds,
        int(metric(stack, "kthena_router_prefix_cache_entries")),
    )


@contextmanager
def soak_stack(pods: int, cache_size: int) -> Iterator[Stack]:
    """Fast simulated pods (a hundredth of real time) and Envoy + extproc before them."""
    with tempfile.TemporaryDirectory(prefix="extproc-soak-") as tmp:
        config = Path(tmp) / "soak.yaml"
        config.write_text(CONFIG.format(cache=cache_size))
        sim_args = ["--model", MODEL, "--time-scale", "0.01", "--max-num-seqs", "64"]
        with (
            spawn_sim_pods(pods, args=sim_args) as sim,
            run_stack(
                sim.as_pods(),
                config=config,
                extproc_args=EXTPROC_ARGS,
                envoy_transform=request_id_in_response,
            ) as stack,
        ):
            yield stack


def run_soak(
    requests: int,
    *,
    concurrency: int = 8,
    pods: int = 4,
    num_prefixes: int = 2000,
    stream_every: int = 5,
    cache_size: int = 2000,
    rss_slack_mb: float = 8.0,
    sample_every: int = 250,
    seed: int = 0,
) -> SoakReport:
    """Run the soak and judge it (see the module doc); never raises for a failed check."""
    report = SoakReport(requests, pods, cache_size, index_bound=pods * cache_size)
    workload = Workload(num_prefixes, stream_every, seed)
    report.prefixes = num_prefixes
    warm_up = min(requests, max(1000, requests // 5))
    served: dict[str, str] = {}  # each success's request id: the pod that served it
    with soak_stack(pods, cache_size) as stack:
        recorded_before = metric(stack, "extproc_completions_total", 'outcome="recorded"')
        counter = itertools.count()
        lock = threading.Lock()
        answered = 0
        statuses: Counter[str] = Counter()
        started = time.monotonic()

        def worker() -> None:
            nonlocal answered
            with httpx.Client(base_url=stack.url, timeout=60) as client:
                while (i := next(counter)) < requests:
                    api, body, stream = workload.request(i)
                    answer = _send(client, api, body, stream)
                    problem = answer.problem
                    if problem is None and not (answer.request_id and answer.pod):
                        problem = "answered without x-request-id or x-sim-pod"
                    with lock:
                        answered += 1
                        report.streamed += stream
                        if problem is None:
                            served[str(answer.request_id)] = str(answer.pod)
                        statuses["ok" if problem is None else problem.split(" ", 1)[0]] += 1
                        if problem is not None:
                            report.num_unexpected += 1
                            if len(report.unexpected) < 10:
                                report.unexpected.append(f"request {i} {api}: {problem}")

        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(worker) for _ in range(concurrency)]
            next_sample = sample_every
            while not all(f.done() for f in futures):
                time.sleep(0.05)
                if answered >= next_sample:
                    sample = _sample(stack, answered, started)
                    report.samples.append(sample)
                    if report.warm is None and answered >= warm_up:
                        report.warm = sample
                    next_sample += sample_every
            for f in futures:
                f.result()
        report.seconds = round(time.monotonic() - started, 1)
        report.requests_per_s = round(requests / report.seconds, 1)
        with suppress(AssertionError):  # the end sample reports any still pending
            wait_until(lambda: metric(stack, "extproc_pending_completions") == 0, timeout_s=10)
        report.end = _sample(stack, answered, started)
        report.samples.append(report.end)
        report.warm = report.warm or report.end
        report.statuses = dict(statuses)
        report.pending_at_end = int(metric(stack, "extproc_pending_completions"))
        report.recorded = int(
            metric(stack, "extproc_completions_total", 'outcome="recorded"') - recorded_before
        )
        report.max_index_entries = max(s.index_entries for s in report.samples)
        ends, traceback = _read_log(stack.extproc.log_path)
    _check_ends(report, served, ends)
    _judge(report, rss_slack_mb, traceback)
    return report


def _read_log(path: Path) -> tuple[dict[str, list[tuple[str | None, bool]]], bool]:
    """extproc's log: each request id's ends as logged (pod, succeeded), and whether a
    traceback is in it. Read line by line: a long soak's log is large."""
    ends: dict[str, list[tuple[str | None, bool]]] = {}
    traceback = False
    with path.open("rb") as log:
        for line in log:
            traceback = traceback or b"Traceback" in line
            if b'"served_by"' not in line:
                continue
            with suppress(orjson.JSONDecodeError):
                end = orjson.loads(line)
                if end.get("logger") == "extproc.picks":
                    ends.setdefault(end["x_request_id"], []).append(
                        (end["served_by"], end["succeeded"])
                    )
    return ends, traceback


def _check_ends(
    report: SoakReport,
    served: dict[str, str],
    ends: dict[str, list[tuple[str | None, bool]]],
) -> None:
    """Each success ended once in extproc, on the pod that served it; no other request
    ended as a success."""
    for request_id, pod in served.items():
        expected = [(f"{POD_NAMESPACE}/{pod}", True)]
        got = ends.get(request_id, [])
        if got == expected:
            report.ends_checked += 1
        else:
            _mismatch(report, f"request {request_id} served by {pod}: ends {got}")
    for request_id, got in ends.items():
        if request_id not in served and any(ok for _, ok in got):
            _mismatch(report, f"request {request_id} no client saw succeed: ends {got}")


def _mismatch(report: SoakReport, what: str) -> None:
    report.num_end_mismatches += 1
    if len(report.end_mismatches) < 10:
        report.end_mismatches.append(what)


def rss_trend_mb(samples: list[Sample]) -> float:
    """The growth of the least-squares line through the samples' RSS, from the first
    sample to the last: a steady leak shows here even when the last sample dips."""
    if len(samples) < 2:
        return 0.0
    xs = [float(s.requests) for s in samples]
    ys = [s.rss_mb for s in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    return round(slope * (xs[-1] - xs[0]), 2)


def _judge(report: SoakReport, rss_slack_mb: float, traceback: bool) -> None:
    warm, end = report.warm, report.end
    assert warm is not None and end is not None
    problems = report.problems
    since_warm = report.samples[report.samples.index(warm) :]
    report.rss_trend_mb = rss_trend_mb(since_warm)
    if report.num_unexpected:
        problems.append(f"{report.num_unexpected} unexpected answers")
    if report.max_index_entries > report.index_bound:
        problems.append(f"index held {report.max_index_entries} > {report.index_bound} entries")
    if end.rss_mb - warm.rss_mb > rss_slack_mb:
        problems.append(f"RSS grew {end.rss_mb - warm.rss_mb:.1f} MB after warm-up")
    if report.rss_trend_mb > rss_slack_mb:
        problems.append(f"RSS trend +{report.rss_trend_mb:.1f} MB after warm-up")
    for s in since_warm:
        if s.fds > warm.fds + 2 or s.threads > warm.threads + 2:
            problems.append(
                f"at request {s.requests}: fds {warm.fds} -> {s.fds}, "
                f"threads {warm.threads} -> {s.threads}"
            )
            break
    if report.pending_at_end:
        problems.append(f"{report.pending_at_end} routed requests still pending")
    successes = report.requests - report.num_unexpected
    if report.recorded != successes:
        problems.append(f"{report.recorded} recorded for {successes} successful requests")
    if report.num_end_mismatches or report.ends_checked != successes:
        problems.append(
            f"{report.ends_checked} of {successes} successes ended once on their pod: "
            + "; ".join(report.end_mismatches[:3])
        )
    if traceback:
        problems.append("a traceback in extproc's log")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m e2e.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pods", type=int, default=4)
    p.add_argument("--prefixes", type=int, default=2000, help="distinct prefixes")
    p.add_argument("--stream-every", type=int, default=5, help="every Nth request streams")
    p.add_argument("--max-hash-cache-size", type=int, default=2000, help="index entries per pod")
    p.add_argument("--rss-slack-mb", type=float, default=8.0)
    p.add_argument("--sample-every", type=int, default=250, help="requests between samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = p.parse_args(argv)
    report = run_soak(
        args.requests,
        concurrency=args.concurrency,
        pods=args.pods,
        num_prefixes=args.prefixes,
        stream_every=args.stream_every,
        cache_size=args.max_hash_cache_size,
        rss_slack_mb=args.rss_slack_mb,
        sample_every=args.sample_every,
        seed=args.seed,
    )
    print(json.dumps(asdict(report), indent=1) if args.json else report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
