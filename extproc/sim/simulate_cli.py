"""``extproc simulate``: compare routing policies on simulated vLLM engines, offline.

    extproc simulate --workload burst --pods 4
    extproc simulate --workload mooncake-conversation --pods 8 --requests 2000 \\
        --policies round-robin,prefix-cache,cost-aware --json out.json --png out.png
    extproc simulate --workload trace --trace my.jsonl --scale 32 --speedup 4

Workloads: ``burst`` and ``chat`` (``extproc.sim.workloads``), ``multiturn`` and
``tenants`` (chat and burst shaped like ``bench.routing_quality``'s), ``lora`` (those
chats on 16 LoRA adapters of Zipf popularity, 2 adapter slots a pod), the Mooncake traces in
``<repo>/../shared/traces`` and any trace file in their format (``extproc.sim.traces``).
Engine settings are the fields of ``EngineConfig`` as flags; unset ones take the
workload's default (``burst`` and ``chat`` use small caches), else the engine's. Prints a
table; ``--json`` writes the summaries with the full configuration (rerunning it with the
same flags gives the same file), ``--png`` a chart.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from extproc.errors import ConfigError
from extproc.scheduling.config import (
    DEFAULT_CONFIG_NAME,
    NAMED_CONFIGS,
    default_config_text,
    named_config_text,
    parse_config,
)
from extproc.sim.engine import EngineConfig
from extproc.sim.engine_flags import add_engine_flags, engine_config_from_args
from extproc.sim.offline import SimSettings, compare
from extproc.sim.policies import POLICY_NAMES
from extproc.sim.report import format_table, summarize, write_json, write_png
from extproc.sim.traces import TRACE_FILES, default_trace_dir, trace_workload
from extproc.sim.workloads import (
    DEFAULT_MODEL,
    MULTITURN_PARAMS,
    BurstParams,
    ChatParams,
    GroupsParams,
    LoraParams,
    Workload,
    burst_workload,
    chat_workload,
    groups_workload,
    lora_workload,
    multiturn_workload,
    tenants_workload,
)

WORKLOADS = ("burst", "chat", "multiturn", "tenants", "groups", "lora", *TRACE_FILES, "trace")


DESCRIPTION = """\
Compare routing policies offline: one workload replayed on simulated vLLM engines under
each policy, in simulated time (no Envoy, no network), and a table of prefix-cache hit
ratio, time to first token, evictions, refusals and requests per pod.

Most common:
  extproc simulate --workload burst --pods 4
  extproc simulate --workload mooncake-conversation --pods 8 --requests 2000 \\
      --policies round-robin,prefix-cache,cost-aware --json out.json --png out.png

Documentation: the site `make docs` builds from docs/ (docs/routing-quality.md; every flag
in docs/reference/cli.md)."""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "simulate",
        help="compare routing policies offline on simulated engines",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="burst")
    p.add_argument("--trace", type=Path, help="trace file (JSONL) for --workload trace")
    p.add_argument("--pods", type=int, default=4, help="number of engines (default 4)")
    p.add_argument(
        "--policies",
        default=",".join(POLICY_NAMES),
        help="comma-separated, from: " + ", ".join(POLICY_NAMES),
    )
    p.add_argument(
        "--config",
        type=Path,
        help="scheduler YAML for prefix-cache, or a shipped one by name: "
        + ", ".join(NAMED_CONFIGS)
        + " (default: embedded default)",
    )
    p.add_argument("--requests", type=int, help="requests to replay (default: workload's/all)")
    p.add_argument("--scale", type=float, default=16.0, help="trace length divisor (default 16)")
    p.add_argument("--speedup", type=float, default=1.0, help="trace time compression (default 1)")
    p.add_argument("--seed", type=int, default=0, help="workload and tie-break seed (default 0)")
    p.add_argument("--scrape-interval-s", type=float, default=0.0,
                   help="metrics refresh period; 0: at every arrival (default)")  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name the pods serve")
    p.add_argument("--json", type=Path, help="write the report as JSON here")
    p.add_argument("--png", type=Path, help="write a chart here")
    add_engine_flags(
        p.add_argument_group("engine (default: the workload's, else EngineConfig's)"),
        unset_by_default=True,
    )


def make_workload(args: argparse.Namespace) -> Workload:
    """The workload the flags name.

    Raises:
        ConfigError: a missing or unreadable trace, or bad sizes.
    """
    if args.requests is not None and args.requests <= 0:
        raise ConfigError(f"--requests must be > 0, got {args.requests}")
    if args.workload == "burst":
        burst = BurstParams() if args.requests is None else BurstParams(num_requests=args.requests)
        return burst_workload(burst, args.seed, args.model)
    if args.workload == "chat":
        chat = ChatParams() if args.requests is None else ChatParams(num_requests=args.requests)
        return chat_workload(chat, args.seed, args.model)
    if args.workload == "multiturn":
        return multiturn_workload(args.seed, args.model, args.requests)
    if args.workload == "tenants":
        return tenants_workload(args.seed, args.model, args.requests)
    if args.workload == "groups":
        groups = (
            GroupsParams() if args.requests is None else GroupsParams(num_requests=args.requests)
        )
        return groups_workload(groups, args.seed, args.model)
    if args.workload == "lora":
        chat = replace(
            MULTITURN_PARAMS, num_requests=args.requests or MULTITURN_PARAMS.num_requests
        )
        return lora_workload(LoraParams(chat=chat), args.seed, args.model)
    if args.workload == "trace":
        if args.trace is None:
            raise ConfigError("--workload trace needs --trace FILE")
        path = args.trace
    else:
        path = args.trace or default_trace_dir() / TRACE_FILES[args.workload]
    return trace_workload(
        path,
        scale=args.scale,
        speedup=args.speedup,
        limit=args.requests,
        name=args.workload,
        model=args.model,
    )


def engine_config(args: argparse.Namespace, workload: Workload) -> EngineConfig:
    """Flags first, then the workload's defaults, then ``EngineConfig``'s."""
    return engine_config_from_args(args, workload.engine_defaults)


def git_sha() -> str | None:
    """The checkout's commit, for the report; None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run(args: argparse.Namespace) -> int:
    try:
        policies = [name.strip() for name in args.policies.split(",") if name.strip()]
        unknown = sorted(set(policies) - set(POLICY_NAMES))
        if unknown or not policies:
            raise ConfigError(f"--policies: unknown {unknown}; known: {', '.join(POLICY_NAMES)}")
        if args.config is None:
            config_source, config_text = DEFAULT_CONFIG_NAME, default_config_text()
        elif str(args.config) in NAMED_CONFIGS and not args.config.exists():
            config_source, config_text = str(args.config), named_config_text(str(args.config))
        else:
            config_source, config_text = str(args.config), _read(args.config)
        scheduler_config = parse_config(config_text, config_source)
        workload = make_workload(args)
        settings = SimSettings(args.pods, engine_config(args, workload), args.scrape_interval_s)
    except (ConfigError, ValueError) as exc:
        print(f"extproc simulate: {exc}", file=sys.stderr)
        return 2
    runs = compare(workload, policies, settings, scheduler_config, args.seed)
    summaries = {r.policy: summarize(r) for r in runs}
    print(f"workload {workload.name}, {args.pods} pods, seed {args.seed}")
    print(format_table(summaries, runs))
    config = {
        "workload": {"name": workload.name, **workload.params},
        "num_pods": settings.num_pods,
        "policies": policies,
        "seed": args.seed,
        "scrape_interval_s": settings.scrape_interval_s,
        "engine": asdict(settings.engine),
        "scheduler_config": {"source": config_source, "text": config_text},
        "git_sha": git_sha(),
    }
    if args.json:
        write_json(args.json, config, summaries)
    if args.png:
        title = f"{workload.name}: {settings.num_pods} pods, seed {args.seed}"
        write_png(args.png, title, summaries)
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration file: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="extproc simulate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
