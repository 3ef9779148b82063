"""``extproc sim-pods``: serve N simulated vLLM pods on 127.0.0.1 until SIGINT/SIGTERM.

    extproc sim-pods --pods 3 --port 8100 --model sim-llm --time-scale 0.1
    python -m extproc.sim.pods_cli --pods 2 --port 0        # free ports, printed when ready

Pods listen on ports PORT..PORT+N-1 (all free ports with ``--port 0``) and are named
``NAME_PREFIX-0`` .. ``NAME_PREFIX-{N-1}``; the admin port is PORT+N unless
``--admin-port`` says otherwise. When everything listens, one JSON line goes to stdout:
``{"model": ..., "admin_url": ..., "pods": [{"name", "url", "port", "listening",
"kv_events_endpoint", "adapters"}]}``.
Engine settings are the fields of ``EngineConfig`` as flags; ``--error-rate`` and the
other fault flags apply to every pod, or to those ``--fault-pods`` lists.

LoRA adapters, as vLLM takes them (``lora.py``): 4 pods of 2 GPU slots, 16 adapters each::

    extproc sim-pods --pods 4 --port 0 --enable-lora --max-loras 2 \
        --lora-modules $(for i in $(seq 0 15); do printf 'lora-%d=/adapters/%d ' $i $i; done)
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from typing import Any

import orjson

from extproc.errors import ConfigError
from extproc.sim.engine_flags import add_engine_flags, engine_config_from_args
from extproc.sim.faults import Faults
from extproc.sim.lora import parse_lora_module
from extproc.sim.pods import GroupSettings, KvEventsSettings, PodGroup


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pods", type=int, default=2, help="number of pods (default 2)")
    parser.add_argument("--port", type=int, default=8100, help="first pod's port; 0: free ports")
    parser.add_argument("--admin-port", type=int, default=None, help="default: PORT + PODS")
    parser.add_argument("--model", default="sim-llm", help="served model name")
    parser.add_argument("--name-prefix", default="sim", help="pods are PREFIX-0, PREFIX-1, ...")
    parser.add_argument("--default-max-tokens", type=int, default=16,
                        help="output tokens when a request sets no limit")  # fmt: skip
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="render and tokenize prompts with this Hugging Face tokenizer "
                        "(tokenizer.json, tokenizer_config.json) instead of the "
                        "pseudo-tokenizer")  # fmt: skip
    add_engine_flags(parser.add_argument_group("engine"))
    lora = parser.add_argument_group("LoRA adapters (with --enable-lora; see extproc/sim/lora.py)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="adapters every pod serves from the start, as vLLM's: name=path "
                      'or {"name": ..., "path": ...}')  # fmt: skip
    kv = parser.add_argument_group("KV-cache events")
    kv.add_argument("--kv-events-endpoint",
                    help="ZMQ endpoint: tcp://127.0.0.1:5557 connects to a subscriber; "
                    "tcp://127.0.0.1:* binds a free port per pod, for subscribers to "
                    "connect (the ready line names it)")  # fmt: skip
    kv.add_argument("--kv-events-topic", default="kv@{host}:{port}@{model}",
                    help="topic template: {host} {port} {model} {name}")  # fmt: skip
    kv.add_argument("--kv-events-layout", choices=("map", "array"), default="map",
                    help="event encoding: map (vLLM >= 0.2x) or array (older)")  # fmt: skip
    faults = parser.add_argument_group("faults (see extproc/sim/faults.py)")
    faults.add_argument("--error-rate", type=float, default=0.0)
    faults.add_argument("--error-status", type=int, default=500)
    faults.add_argument("--refuse-connections", action="store_true")
    faults.add_argument("--die-mid-stream-after-chunks", type=int, default=None)
    faults.add_argument("--delay-s", type=float, default=0.0)
    faults.add_argument("--metrics", choices=("ok", "error", "garbage"), default="ok",
                        help="what /metrics answers (default ok)")  # fmt: skip
    faults.add_argument("--fault-pods", default=None,
                        help="comma-separated pod indexes the fault flags apply to (default all)")  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> GroupSettings:
    """The group's settings from the parsed flags.

    Raises:
        ConfigError: a setting is invalid; the message names it.
    """
    engine = engine_config_from_args(args)
    try:
        faults = Faults(
            error_rate=args.error_rate,
            error_status=args.error_status,
            refuse_connections=args.refuse_connections,
            die_mid_stream_after_chunks=args.die_mid_stream_after_chunks,
            delay_s=args.delay_s,
            metrics=args.metrics,
        )
        fault_pods = None
        if args.fault_pods:
            fault_pods = frozenset(int(i) for i in args.fault_pods.split(","))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    kv = None
    if args.kv_events_endpoint:
        kv = KvEventsSettings(args.kv_events_endpoint, args.kv_events_topic, args.kv_events_layout)
    return GroupSettings(
        num_pods=args.pods,
        port=args.port,
        admin_port=args.admin_port,
        model=args.model,
        name_prefix=args.name_prefix,
        engine=engine,
        default_max_tokens=args.default_max_tokens,
        faults=faults,
        fault_pods=fault_pods,
        kv_events=kv,
        tokenizer=args.tokenizer,
        lora_modules=tuple(parse_lora_module(m) for m in args.lora_modules),
    )


async def serve(settings: GroupSettings) -> None:
    """Run the pods until SIGINT or SIGTERM, then stop them cleanly."""
    group = PodGroup(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await group.start()
    try:
        sys.stdout.write(orjson.dumps(group.describe()).decode() + "\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        await group.stop()


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        asyncio.run(serve(settings))
    except ConfigError as e:
        print(f"extproc sim-pods: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"extproc sim-pods: {e}", file=sys.stderr)
        return 1
    return 0


DESCRIPTION = """\
Serve simulated vLLM pods on 127.0.0.1 until SIGINT or SIGTERM: OpenAI-style endpoints,
vLLM's /metrics and a simulated prefix cache, to route to without a GPU. When every pod
listens, one JSON line on stdout names them.

Most common:
  extproc sim-pods --pods 4 --port 8100 --model sim-model   examples/pods.yaml's pods
  extproc sim-pods --pods 2 --port 0                        free ports, named on stdout

Documentation: the site `make docs` builds from docs/ (docs/development.md; every flag in
docs/reference/cli.md)."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sim-pods", help="serve simulated vLLM pods", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="extproc sim-pods", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
