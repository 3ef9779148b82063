"""``extproc serve`` as a process: starts on the embedded defaults and a pods file, drains
on SIGTERM, refuses every bad configuration at start-up with a message naming what to fix
(no pods source included)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from extproc.cli import serve
from extproc.cli.app import _check_hold_fits_envoy
from extproc.routing.flow.config import parse_flow_control
from extproc.sim.launch import free_port, start_extproc
from extproc.wire.protocol import EXT_PROC_SERVICE
from testkit.example_pods import EXAMPLE_PODS_FILE


def test_serve_starts_and_drains_on_sigterm(tmp_path: Path) -> None:
    proc = start_extproc(
        EXAMPLE_PODS_FILE, tmp_path, grpc_port=free_port(), metrics_port=free_port()
    )
    assert proc.stop(signal.SIGTERM) == 0
    log = proc.log_tail()
    assert "draining" in log and "stopped" in log and "Traceback" not in log


def test_sigterm_ends_the_process_after_bytes_that_are_not_a_message(tmp_path: Path) -> None:
    """grpcio's stop can wait for ever after a request that failed to deserialize; the
    drain is bounded all the same."""
    grpc_port = free_port()
    proc = start_extproc(
        EXAMPLE_PODS_FILE,
        tmp_path,
        grpc_port=grpc_port,
        metrics_port=free_port(),
        extra_args=["--drain-s", "0.5", "--stale-after-s", "0"],
    )
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        raw = channel.stream_unary(f"/{EXT_PROC_SERVICE}/Process")
        for _ in range(20):
            with pytest.raises(grpc.RpcError):
                raw(iter([b"\xff\xff not a protobuf message"]), timeout=5)
    started = time.monotonic()
    assert proc.stop(signal.SIGTERM, timeout_s=8) == 0, proc.log_tail()
    assert time.monotonic() - started < 5


def test_without_a_pods_source_serve_refuses_to_start_naming_both() -> None:
    """Not the demo's four localhost pods in silence: a file or Kubernetes, said plainly."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXTPROC_")}
    done = subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--grpc-port", "0", "--health-port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("extproc serve: cannot start: no pods to route to"), done.stderr
    assert "--pods FILE" in done.stderr
    assert "--k8s-selector" in done.stderr and "--inference-pool" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--v=4"], id="klog-equals"),
        pytest.param(["--v", "4"], id="klog-space"),
        pytest.param(["-v", "4"], id="short"),
        pytest.param(["-v4"], id="short-joined"),
    ],
)
def test_verbosity_is_accepted_as_kthena_spells_it(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    assert parser.parse_args(["serve", *argv]).v == 4


def test_an_unknown_plugin_is_logged_and_start_up_goes_on(tmp_path: Path) -> None:
    """Kthena's factory.go logs "Failed to get plugin NAME." and builds the rest."""
    config = tmp_path / "c.yaml"
    config.write_text(
        "scheduler:\n  plugins:\n    Filter:\n      enabled: [no-such-filter]\n"
        "    Score:\n      enabled:\n        - {name: prefix-cahce, weight: 1}\n"
        "        - {name: prefix-cache, weight: 1}\n"
    )
    proc = start_extproc(
        EXAMPLE_PODS_FILE,
        tmp_path,
        grpc_port=free_port(),
        metrics_port=free_port(),
        extra_args=["--config", str(config), "--stale-after-s", "0"],
    )
    assert proc.stop(signal.SIGTERM) == 0
    log = proc.log_tail()
    assert "Failed to get plugin no-such-filter." in log
    assert "Failed to get plugin prefix-cahce." in log
    assert "scores ['prefix-cache*1']" in log


def _score(weight: str) -> str:
    return (
        "scheduler:\n  plugins:\n    Score:\n      enabled:\n"
        f"        - name: prefix-cache\n{weight}"
    )


@dataclass(frozen=True)
class Refusal:
    """One bad start-up: flags (``{dir}`` is the case's directory), files to write, the
    message expected on stderr, environment to add."""

    args: tuple[str, ...]
    message: str
    files: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = ()


# Every invalid configuration of the core issue, pods files, and every numeric flag.
REFUSALS: dict[str, Refusal] = {
    "weight-zero": Refusal(
        ("--config", "{dir}/c.yaml"),
        'score plugin "prefix-cache" must set a weight greater than 0, got 0',
        (("c.yaml", _score("          weight: 0\n")),),
    ),
    "weight-negative": Refusal(
        ("--config", "{dir}/c.yaml"),
        "must set a weight greater than 0, got -3",
        (("c.yaml", _score("          weight: -3\n")),),
    ),
    "weight-missing": Refusal(
        ("--config", "{dir}/c.yaml"),
        "{dir}/c.yaml: failed to Load Scheduler: failed to Unmarshal Plugins: "
        'score plugin "prefix-cache" must set a weight greater than 0, got 0',
        (("c.yaml", _score("")),),
    ),
    "weight-not-integer": Refusal(
        ("--config", "{dir}/c.yaml"),
        "weight must be an integer, got 'high'",
        (("c.yaml", _score("          weight: high\n")),),
    ),
    "least-latency-factor-out-of-range": Refusal(
        ("--config", "{dir}/c.yaml"),
        "{dir}/c.yaml: failed to Load Scheduler: failed to Unmarshal PluginsConfig: invalid "
        "least-latency plugin configuration: TTFTTPOTWeightFactor must be a finite value "
        "between 0 and 1, got 1.5",
        (
            (
                "c.yaml",
                "scheduler: {pluginConfig: [{name: least-latency, "
                + "args: {TTFTTPOTWeightFactor: 1.5}}]}\n",
            ),
        ),
    ),
    "unknown-prompt-rendering": Refusal(
        ("--prompt-rendering", "openai"), "argument --prompt-rendering: invalid choice: 'openai'"
    ),
    "config-invalid-yaml": Refusal(
        ("--config", "{dir}/c.yaml"),
        "{dir}/c.yaml: invalid YAML",
        (("c.yaml", "scheduler: [unclosed\n"),),
    ),
    "config-not-a-mapping": Refusal(
        ("--config", "{dir}/c.yaml"),
        "expected a mapping with a 'scheduler' section",
        (("c.yaml", "- just a list\n"),),
    ),
    "config-missing": Refusal(
        ("--config", "{dir}/absent.yaml"), "{dir}/absent.yaml: configuration file not found"
    ),
    "config-is-a-directory": Refusal(
        ("--config", "{dir}"), "{dir}: cannot read the configuration file"
    ),
    "pods-missing": Refusal(("--pods", "{dir}/absent.yaml"), "pods file not found"),
    "pods-invalid-yaml": Refusal(
        ("--pods", "{dir}/p.yaml"), "{dir}/p.yaml: not valid YAML", (("p.yaml", "pods: [\n"),)
    ),
    "pods-bad-address": Refusal(
        ("--pods", "{dir}/p.yaml"),
        "pods[0] 'a': address 'nowhere' is not 'ip:port'",
        (("p.yaml", "pods:\n  - {name: a, address: nowhere, models: [m]}\n"),),
    ),
    "pods-poll-zero": Refusal(("--pods-poll-s", "0"), "poll interval must be positive"),
    "two-pods-sources": Refusal(
        ("--inference-pool", "pool"), "choose one pod source, not --pods and --inference-pool"
    ),
    "grpc-port-too-big": Refusal(
        ("--grpc-port", "99999"), "--grpc-port must be a port number from 0 to 65535, got 99999"
    ),
    "health-port-too-big": Refusal(
        ("--health-port", "70000"), "--health-port must be a port number from 0 to 65535"
    ),
    "metrics-port-negative": Refusal(
        ("--metrics-port", "-1"), "--metrics-port must be a port number from 0 to 65535"
    ),
    "num-fallbacks-negative": Refusal(
        ("--num-fallbacks", "-1"), "--num-fallbacks must be 0 or more, got -1"
    ),
    "max-streams-too-few": Refusal(("--max-streams", "1"), "--max-streams must be 4 or more"),
    "prepare-threads-zero": Refusal(
        ("--prepare-threads", "0"), "--prepare-threads must be 1 or more, got 0"
    ),
    "prepare-queue-zero": Refusal(("--prepare-queue", "0"), "--prepare-queue must be 1 or more"),
    "scrape-budget-over-a-core": Refusal(
        ("--scrape-cpu-budget", "1.5"), "--scrape-cpu-budget must be in (0, 1]"
    ),
    "max-body-bytes-zero": Refusal(
        ("--max-body-bytes", "0"), "--max-body-bytes must be greater than 0, got 0"
    ),
    "scrape-interval-zero": Refusal(
        ("--scrape-interval-s", "0"), "--scrape-interval-s must be greater than 0"
    ),
    "scrape-timeout-negative": Refusal(
        ("--scrape-timeout-s", "-1"), "--scrape-timeout-s must be greater than 0"
    ),
    "models-interval-negative": Refusal(
        ("--models-interval-s", "-1"), "--models-interval-s must be 0 (off) or more"
    ),
    "stale-after-negative": Refusal(
        ("--stale-after-s", "-1"), "--stale-after-s must be 0 (no scraping) or more"
    ),
    "drain-negative": Refusal(("--drain-s", "-1"), "--drain-s must be 0 or more"),
    "session-ttl-negative": Refusal(
        ("--session-ttl-s", "-5"), "--session-ttl-s must be 0 (off) or more"
    ),
    "log-level-unknown": Refusal(("--log-level", "loud"), "--log-level must be one of"),
    "not-a-number": Refusal(("--num-fallbacks", "two"), "invalid int value: 'two'"),
    "env-not-a-number": Refusal(
        (),
        "argument --num-fallbacks: invalid int value: 'abc'",
        env=(("EXTPROC_NUM_FALLBACKS", "abc"),),
    ),
    "unknown-protocol": Refusal(("--protocol", "http"), "invalid choice: 'http'"),
    "grpc-and-health-port-equal": Refusal(
        ("--grpc-port", "{port}", "--health-port", "{port}"),
        "cannot bind the health server to 127.0.0.1:{port}",
    ),
}


@dataclass(frozen=True)
class Outcome:
    returncode: int | None  # None: still running after the timeout (it did not refuse)
    stderr: str
    fill: Callable[[str], str]


def _start(name: str, case: Refusal, base: Path) -> Outcome:
    case_dir = base / name
    case_dir.mkdir()
    for file_name, text in case.files:
        (case_dir / file_name).write_text(text)
    port = str(free_port())

    def fill(s: str) -> str:
        return s.replace("{dir}", str(case_dir)).replace("{port}", port)

    ports = {"--grpc-port": free_port(), "--health-port": free_port(), "--metrics-port": 0}
    for flag in case.args:
        ports.pop(flag, None)
    argv = [  # a valid pods file first: a case's own --pods comes later and wins
        sys.executable, "-m", "extproc", "serve", "--stale-after-s", "0",
        "--pods", str(EXAMPLE_PODS_FILE),
        *(x for flag, value in ports.items() for x in (flag, str(value))),
        *map(fill, case.args),
    ]  # fmt: skip
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=60,  # a loaded machine starts Python slowly
            check=False,
            env={**os.environ, **dict(case.env)},
        )
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else str(exc.stderr)
        return Outcome(None, err, fill)  # subprocess.run killed it
    return Outcome(result.returncode, result.stderr, fill)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every case started at once (each is a whole Python start-up)."""
    base = tmp_path_factory.mktemp("refusals")
    with ThreadPoolExecutor(4) as pool:
        futures = {name: pool.submit(_start, name, case, base) for name, case in REFUSALS.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_bad_configuration_is_refused_at_start_up_with_its_message(
    outcomes: dict[str, Outcome], name: str
) -> None:
    outcome = outcomes[name]
    assert outcome.returncode == 2, f"started or crashed instead:\n{outcome.stderr[-2000:]}"
    assert outcome.fill(REFUSALS[name].message) in outcome.stderr
    assert "Traceback" not in outcome.stderr


def test_serve_warns_when_a_hold_can_outlast_envoys_max_message_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", "extproc.serve"):
        _check_hold_fits_envoy(parse_flow_control({"queue": {"ttlS": 15}}, "c"))
        assert not caplog.records
        _check_hold_fits_envoy(parse_flow_control({"queue": {"bandTtlS": {5: 90}}}, "c"))
    assert "--max-message-timeout-s 92" in caplog.text
