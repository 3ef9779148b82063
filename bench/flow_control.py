"""Flow control under overload: priorities, fairness and refusals, side by side (issue 30).

    python -m bench.flow_control [--contenders extproc-flow,extproc-off,sglang-router]

On one set of simulated pods (``extproc sim-pods``, vLLM-like: ``--max-num-seqs`` running,
a waiting queue, ``/metrics``): the pods' capacity is measured first (closed loop, no
router: the requests a second they complete for this workload's requests), then each
contender in turn serves the same two open-loop schedules (``bench/flow_workload.py``):
``--baseline`` x the capacity (not overloaded, the TTFT reference) and ``--overload`` x
the capacity, each for a bounded time and count, from three classes named in
``x-gateway-inference-objective`` and, within the standard band, tenants named in
``x-gateway-inference-fairness-id``, one of them noisy. Contenders:

- ``extproc-flow``: Envoy + extproc, the shipped default configuration with the
  ``flowControl`` section of ``bench/configs/flow-control.yaml`` (``--saturation``
  overrides its saturation limit; several values: one contender each), the generated
  Envoy configuration as shipped (it sends both headers; extproc lengthens Envoy's
  message timeout for a held request);
- ``extproc-off``: Envoy + extproc, the shipped default with flow control off;
- ``sglang-router``: its ``cache_aware`` policy with its request queue
  (``--max-concurrent-requests`` the pods' running slots, ``--rate-limit-tokens-per-second``
  the measured capacity, ``--queue-size``, ``--queue-timeout-secs`` the flow queue's time
  to live).

Reports per class TTFT p50/p99, goodput, refusals and time queued (extproc's
``extproc_flow_queued_seconds``), Jain's index over the standard tenants, and a verdict
per goal of issue 30. Writes ``flow_control.md``, ``.json`` and ``.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shlex
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench import flow_report
from bench.bench_pods import PodSet, sim_pod_set
from bench.contenders import CACHE_AWARE, EXTPROC_DATA, sglang_argv, start_peer
from bench.flow_client import capacity, replay
from bench.flow_metrics import flow_samples, queued_by_class, run_summary, sample_delta, verdicts
from bench.flow_workload import FlowRequest, Mix, arrivals
from e2e.real_vllm.pods import metric_sum
from extproc.sim.launch import free_port, run_stack

FLOW_SECTION = Path(__file__).with_name("configs") / "flow-control.yaml"
CONTENDERS = ("extproc-flow", "extproc-off", "sglang-router")
REFERENCE = "extproc-off"  # the goodput every contender is held to
OFF_SECTION = "flowControl: {enabled: false}\n"
IDLE_TIMEOUT_S = 120.0
BASELINE_SEED, OVERLOAD_SEED = 2, 3


@dataclass(frozen=True, slots=True)
class Served:
    """A started contender: its URL and, with flow control, extproc's ``/metrics`` page."""

    url: str
    metrics: Callable[[], str] | None = None


Serve = Callable[[PodSet, Path], AbstractContextManager[Served]]


@dataclass(frozen=True)
class Saturation:
    """A flow contender's saturation limits: ``maxWaiting``, ``reservedSlots`` (kept for
    the critical band, priority 100) and ``batchSlots`` (the pods' size, told); written
    ``W``, ``WrR`` (``0r2``), ``WsS`` or ``WrRsS`` (``0r4s4``)."""

    max_waiting: float
    reserved_slots: int = 0
    batch_slots: int | None = None

    @classmethod
    def parse(cls, text: str) -> Saturation:
        match = re.fullmatch(r"([0-9.]+)(?:r([0-9]+))?(?:s([0-9]+))?", text)
        if match is None:
            raise ValueError(f"saturation limits {text!r}: expected W, WrR, WsS or WrRsS")
        waiting, reserved, slots = match.groups()
        return cls(float(waiting), int(reserved or 0), int(slots) if slots else None)

    @property
    def name(self) -> str:
        return (
            f"w{self.max_waiting:g}"
            + (f"-r{self.reserved_slots}" if self.reserved_slots else "")
            + (f"-s{self.batch_slots}" if self.batch_slots else "")
        )


def flow_section(path: Path, limits: Saturation | None) -> str:
    """The ``flowControl`` section's YAML, with ``limits`` as its saturation limits when
    given."""
    doc = yaml.safe_load(path.read_text())
    if limits is not None:
        saturation = doc["flowControl"].setdefault("saturation", {})
        saturation["maxWaiting"] = limits.max_waiting
        if limits.reserved_slots:
            saturation["reservedSlots"] = limits.reserved_slots
            saturation["reservedFor"] = 100
        if limits.batch_slots:
            saturation["batchSlots"] = limits.batch_slots
    return str(yaml.safe_dump(doc, sort_keys=False))


def flow_sections(path: Path, variants: list[Saturation]) -> dict[str, str]:
    """The flow contenders: ``extproc-flow`` (the file's limits, or the ones given), or
    one ``extproc-flow-<limits>`` per variant when several are compared."""
    if len(variants) < 2:
        return {"extproc-flow": flow_section(path, variants[0] if variants else None)}
    return {f"extproc-flow-{v.name}": flow_section(path, v) for v in variants}


def with_section(section: str) -> str:
    """The shipped default configuration with ``section``'s flowControl in place of its
    own (the default turns flow control on with its defaults)."""
    doc = yaml.safe_load((EXTPROC_DATA / "config.yaml").read_text())
    doc["flowControl"] = yaml.safe_load(section)["flowControl"]
    return str(yaml.safe_dump(doc, sort_keys=False))


def extproc_serve(section: str) -> Serve:
    """Envoy + extproc, the default configuration with ``section`` as its flowControl
    (its flow metrics read unless the section turns flow control off)."""
    flow_on = section != OFF_SECTION

    @contextmanager
    def serve(pods: PodSet, log_dir: Path) -> Iterator[Served]:
        config = log_dir / "flow-control-config.yaml"
        config.write_text(with_section(section))
        with run_stack(pods.pods, config=config) as stack:
            yield Served(stack.url, stack.metrics_text if flow_on else None)

    return serve


def sglang_queue_args(args: argparse.Namespace, capacity_req_s: float) -> list[str]:
    """sglang-router's request queue sized like the pods and the flow queue."""
    return [
        "--max-concurrent-requests", str(args.pods * args.max_num_seqs),
        "--rate-limit-tokens-per-second", str(math.ceil(capacity_req_s)),
        "--queue-size", str(args.sglang_queue_size),
        "--queue-timeout-secs", str(args.sglang_queue_timeout_s),
    ]  # fmt: skip


def sglang_serve(queue_args: list[str]) -> Serve:
    @contextmanager
    def serve(pods: PodSet, log_dir: Path) -> Iterator[Served]:
        port = free_port()
        argv = sglang_argv(pods.pods, port, [*CACHE_AWARE, *queue_args])
        proc, url = start_peer("sglang-router", argv, port, log_dir)
        try:
            yield Served(url)
        finally:
            proc.stop()

    return serve


def contenders(sections: dict[str, str], queue_args: list[str]) -> dict[str, Serve]:
    return {
        **{name: extproc_serve(section) for name, section in sections.items()},
        "extproc-off": extproc_serve(OFF_SECTION),
        "sglang-router": sglang_serve(queue_args),
    }


def expand(names: list[str], sections: dict[str, str]) -> list[str]:
    """The contenders to run, ``extproc-flow`` standing for every flow variant."""
    return [v for n in names for v in (list(sections) if n == "extproc-flow" else [n])]


def wait_idle(pods: PodSet, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Until no pod runs or queues a request (the previous run's stragglers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for url in pods.urls:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                text = r.read().decode()
            busy += metric_sum(text, "vllm:num_requests_running")
            busy += metric_sum(text, "vllm:num_requests_waiting")
        if not busy:
            return
        time.sleep(0.5)
    raise TimeoutError(f"pods still busy after {timeout_s} s")


def run_phase(
    served: Served, requests: list[FlowRequest], duration_s: float, args: argparse.Namespace,
    tenants: list[str],
) -> dict[str, Any]:  # fmt: skip
    """One schedule through one contender: its ``run_summary`` (+ time queued for extproc)."""
    before = flow_samples(served.metrics()) if served.metrics else None
    outcomes = asyncio.run(replay(served.url, requests, deadline_s=duration_s + args.drain_s))
    summary = run_summary(outcomes, duration_s, args.slo_ttft_s, tenants)
    if served.metrics and before is not None:
        summary["queued"] = queued_by_class(sample_delta(flow_samples(served.metrics()), before))
    return summary


def _line(name: str, load: str, s: dict[str, Any]) -> str:
    c = s["classes"]
    return (f"  {name:16s} {load:9s} " + "  ".join(
        f"{k} p50/p99 {c[k]['ttft_p50_ms']:.0f}/{c[k]['ttft_p99_ms']:.0f} ms "
        f"served {c[k]['served']}/{c[k]['sent']} refused {c[k]['refused']} failed {c[k]['failed']}"
        for k in c) + f"  goodput {s['all']['goodput_tok_s']:.0f} tok/s  Jain {s['jain']:.3f}")  # fmt: skip


def run_all(
    pods: PodSet, serves: dict[str, Serve], schedules: dict[str, tuple[list[FlowRequest], float]],
    args: argparse.Namespace, log_dir: Path,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Every contender on both schedules, the pods emptied and idle before each."""
    tenants = list(args.mix.tenant_weights())
    out: dict[str, dict[str, Any]] = {}
    for name in args.contenders:
        runs: dict[str, Any] = {}
        with serves[name](pods, log_dir) as served:
            for load, (requests, duration) in schedules.items():
                wait_idle(pods)
                pods.reset_all()
                runs[load] = run_phase(served, requests, duration, args, tenants)
                print(_line(name, load, runs[load]), flush=True)
        wait_idle(pods)
        out[name] = runs
    off = out.get(REFERENCE)
    goodput = off["overload"]["all"]["goodput_tok_s"] if off else None
    unloaded_p99 = off["baseline"]["all"]["ttft_p99_ms"] if off else None
    for name, runs in out.items():  # the reference is not held to its own goodput
        held_to = None if name == REFERENCE else goodput
        runs["verdicts"] = verdicts(runs["overload"], runs["baseline"], held_to, unloaded_p99)
    return out


NOTES = """\
Issue 30's benchmark (`python -m bench.flow_control`, `make bench-flow`). The simulated
pods' capacity is measured first, closed loop without a router (twice as many clients as
the pods' running slots, each sending to one pod, completions counted after a warm-up);
then every contender serves the same two open-loop schedules, Poisson arrivals: the
baseline (not overloaded) and the overload, each bounded in time and count, with the
pods emptied and idle before each. Classes, in `x-gateway-inference-objective`:
`critical` (priority 100), `standard` (0), `sheddable` (-1); within the standard band
tenants in `x-gateway-inference-fairness-id`, `tenant-0` sending 5x each other tenant's
rate. Every prompt is distinct (no prefix sharing) and asks for the same output length.

Definitions. TTFT: client side, streamed, through the router, of the served requests.
Served: answered 200 and streamed to its end. Refused: answered 429 (extproc's flow
control, sglang-router's full queue), 408 (sglang-router's queue timeout) or 503; the
column gives the count by status and how many carried `Retry-After`.
Failed: anything else not served (the error is named; `deadline`: still open when the
run's drain time ended). Goodput: output tokens a second, over the schedule's duration,
of the requests served with a TTFT within the SLO. Jain's index: `(sum x)^2 / (n sum
x^2)` over the standard tenants' output tokens served while the overload lasted
(requests ended before the schedule's end; in brackets in the fairness table, every
token served, the backlog drained after the last arrival included): 1 when equal, 1/n
when one tenant has everything; the share each tenant got while the pods were saturated.
Queued: requests that went through extproc's flow-control queue (however they left
it), their mean time queued and the bucket bound of its p99 (`extproc_flow_queued_seconds`,
whose buckets are too coarse to interpolate), then flow control's refusals by reason
(`extproc_flow_refused_total`: `shed`, `queue_timeout`, `queue_full`, `evicted`); empty
for contenders without flow control. Goals (issue 30): critical TTFT p99
overloaded at most 1.5x the TTFT p99 not overloaded, the lower of the same contender's and
extproc-off's (every class of the baseline schedule: without overload a request's class
changes nothing, and the critical class alone has too few requests there for a p99; the
lower of the two, so that a contender slower unloaded is not judged against its own
slower run); no critical request refused;
Jain's index at least 0.9; total goodput at least extproc-off's. One 2-core machine
runs client, routers and pods: absolute latencies include CPU contention."""


def setup_text(args: argparse.Namespace, capacity_req_s: float, queue_args: list[str]) -> str:
    mix: Mix = args.mix
    return (
        f"{args.pods} simulated pods (`extproc sim-pods --max-num-seqs {args.max_num_seqs} "
        f"--num-gpu-blocks 2048 --time-scale {args.time_scale}`: the gpu-h100-8b timing "
        f"profile {args.time_scale}x slower, at most {args.max_num_seqs} running requests "
        f"a pod). Requests: {mix.prompt_tokens}-token distinct prompts, {mix.output_tokens} "
        f"output tokens. Capacity measured: {capacity_req_s:.1f} requests a second. "
        f"Baseline: {args.baseline}x = {args.baseline * capacity_req_s:.1f} req/s for "
        f"{args.baseline_s} s; overload: {args.overload}x = "
        f"{args.overload * capacity_req_s:.1f} req/s for {args.overload_s} s (each at most "
        f"{args.max_requests} requests; open requests cancelled {args.drain_s} s after the "
        f"last arrival). Classes critical / standard / sheddable "
        f"{' / '.join(f'{s:.0%}' for s in mix.shares)}; {mix.tenants} standard tenants, "
        f"the noisy one at {mix.noisy_factor:g}x. TTFT SLO for goodput: {args.slo_ttft_s} s. "
        f"sglang-router: `{' '.join([*CACHE_AWARE, *queue_args])}`."
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--pods", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=4.0, help="the pods' step-time factor")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--shares", default="0.1,0.7,0.2", help="critical,standard,sheddable")
    p.add_argument("--tenants", type=int, default=5, help="standard tenants, one noisy")
    p.add_argument("--noisy-factor", type=float, default=5.0)
    p.add_argument("--capacity", type=float, help="req/s; default: measured")
    p.add_argument("--capacity-s", type=float, default=15.0, help="capacity measurement")
    p.add_argument("--baseline", type=float, default=0.5, help="x capacity, not overloaded")
    p.add_argument("--baseline-s", type=float, default=30.0)
    p.add_argument("--overload", type=float, default=2.0, help="x capacity")
    p.add_argument("--overload-s", type=float, default=25.0)
    p.add_argument("--max-requests", type=int, default=2000, help="per schedule")
    p.add_argument("--drain-s", type=float, default=45.0, help="after the last arrival")
    p.add_argument("--slo-ttft-s", type=float, default=1.0, help="goodput's TTFT limit")
    p.add_argument("--flow-config", type=Path, default=FLOW_SECTION)
    p.add_argument("--saturation", default="",
                   help="override the saturation limits: W (maxWaiting), WrR (and "
                   "reservedSlots R for the critical band), WsS or WrRsS (and batchSlots S); "
                   "several (comma-separated): one "
                   "extproc-flow-wW[-rR][-sS] contender each")  # fmt: skip
    p.add_argument("--sglang-queue-size", type=int, default=1000)
    p.add_argument("--sglang-queue-timeout-s", type=int, default=15)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()
    variants = [Saturation.parse(v) for v in args.saturation.split(",") if v]
    args.sections = flow_sections(args.flow_config, variants)
    args.contenders = expand(args.contenders.split(","), args.sections)
    shares = tuple(float(s) for s in args.shares.split(","))
    if len(shares) != 3:
        p.error("--shares takes three numbers")
    args.mix = Mix(shares=(shares[0], shares[1], shares[2]), tenants=args.tenants,
                   noisy_factor=args.noisy_factor, prompt_tokens=args.prompt_tokens,
                   output_tokens=args.output_tokens)  # fmt: skip
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop what started
    command = "python -m bench.flow_control " + shlex.join(sys.argv[1:])
    print(command, flush=True)
    started = utc_now()
    engine = ["--max-num-seqs", str(args.max_num_seqs), "--num-gpu-blocks", "2048",
              "--time-scale", str(args.time_scale)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as tmp, \
            sim_pod_set(args.pods, engine, Path(tmp)) as pods:  # fmt: skip
        cap = args.capacity or asyncio.run(capacity(
            pods.urls, args.mix, concurrency=2 * args.pods * args.max_num_seqs,
            seconds=args.capacity_s, warmup_s=min(3.0, args.capacity_s / 3)))  # fmt: skip
        print(f"capacity {cap:.1f} req/s", flush=True)
        schedules = {
            "baseline": (arrivals(args.mix, args.baseline * cap, args.baseline_s,
                                  max_requests=args.max_requests, seed=BASELINE_SEED),
                         args.baseline_s),
            "overload": (arrivals(args.mix, args.overload * cap, args.overload_s,
                                  max_requests=args.max_requests, seed=OVERLOAD_SEED),
                         args.overload_s),
        }  # fmt: skip
        queue_args = sglang_queue_args(args, cap)
        runs = run_all(pods, contenders(args.sections, queue_args), schedules, args, Path(tmp))
    config = {k: str(v) if isinstance(v, (Path, Mix)) else v for k, v in vars(args).items()
              if k != "sections"}  # fmt: skip
    results = {
        "command": command, "config": config, "utc": f"{started} to {utc_now()}",
        "setup": setup_text(args, cap, queue_args), "capacity_req_s": cap,
        "baseline_factor": args.baseline, "overload_factor": args.overload,
        "slo_ttft_s": args.slo_ttft_s, "flow_sections": args.sections, "contenders": runs,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flow_control.json").write_text(json.dumps(results, indent=1))
    print("wrote", flow_report.write(results, args.out, NOTES))


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


if __name__ == "__main__":
    main()
