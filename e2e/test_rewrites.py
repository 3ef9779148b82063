"""Model rewrites and weighted splits through real Envoy: simulated pods serving
``food-review-v1`` and ``food-review-v2`` (each pod answers 404 for a model it does not
serve and echoes the model it ran), a rule splitting ``food-review`` 90/10 between them.
The pod receives the rewritten model with a right content-length (a wrong one cuts the
JSON or leaves the pod waiting), in both protocols; the split's proportions hold; a
session stays on one target; a bad rule is refused at start-up and at reload."""

from __future__ import annotations

import math
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from e2e.support import MODEL, PREFIX_CONFIG, metric
from e2e.test_gateway_epp import gateway_style
from extproc.pods import Pod
from extproc.sim.launch import (
    EXTPROC_COMMAND,
    SimPods,
    Stack,
    run_stack,
    spawn_sim_pods,
    write_pods_file,
)
from testkit.waiting import wait_until

SPLIT = [
    {
        "matches": [{"model": {"type": "Exact", "value": "food-review"}}],
        "targets": [
            {"modelRewrite": "food-review-v2", "weight": 90},
            {"modelRewrite": "food-review-v1", "weight": 10},
        ],
    }
]
REWRITES = "extproc_model_rewrites_total"
RELOADS = "extproc_config_reloads_total"


def write_config(path: Path, rewrites: object) -> Path:
    doc = yaml.safe_load(PREFIX_CONFIG.read_text())
    path.write_text(yaml.safe_dump({**doc, "modelRewrites": rewrites}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def pods(sim: SimPods) -> Iterator[list[Pod]]:
    """The package's pods (the base model) and one pod of each version."""
    with (
        spawn_sim_pods(1, args=["--model", "food-review-v1"]) as v1,
        spawn_sim_pods(1, args=["--model", "food-review-v2"]) as v2,
    ):
        yield [*sim.as_pods(), *v1.as_pods("v1"), *v2.as_pods("v2")]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("rewrites") / "config.yaml", SPLIT)


@pytest.fixture(scope="module")
def rewrite_stack(pods: list[Pod], config_file: Path) -> Iterator[Stack]:
    with run_stack(pods, config=config_file, extproc_args=["--config-poll-s", "0.2"]) as stack:
        yield stack


def ask(client: httpx.Client, model: str, i: int, session: str | None = None) -> str:
    """One completion; the model the pod ran (it answers 404 for one it does not serve)."""
    headers = {"x-session-id": session} if session else {}
    body = {"model": model, "prompt": f"Review {i}: the soup was cold.", "max_tokens": 2}
    resp = client.post("/v1/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    ran: str = resp.json()["model"]
    return ran


def within_4_sigma(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) <= 4 * math.sqrt(n * p * (1 - p))


def test_the_pod_receives_the_rewritten_model_split_by_weight(rewrite_stack: Stack) -> None:
    with httpx.Client(base_url=rewrite_stack.url, timeout=30) as client:
        ran = Counter(ask(client, "food-review", i) for i in range(200))
        assert set(ran) == {"food-review-v1", "food-review-v2"}
        assert within_4_sigma(ran["food-review-v1"], 200, 0.1), ran
        assert ask(client, MODEL, 0) == MODEL  # no rule: the body goes as it came
    for target, count in ran.items():
        labels = f'model="food-review",target="{target}"'
        assert metric(rewrite_stack, REWRITES, labels) == count


def test_a_session_stays_on_one_target(rewrite_stack: Stack) -> None:
    with httpx.Client(base_url=rewrite_stack.url, timeout=30) as client:
        targets = {
            session: {ask(client, "food-review", i, session) for i in range(8)}
            for session in (f"user-{n}" for n in range(12))
        }
    assert all(len(ran) == 1 for ran in targets.values()), targets


@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_the_gateway_protocol_rewrites_too(
    pods: list[Pod], config_file: Path, body_mode: str
) -> None:
    with (
        run_stack(
            pods,
            config=config_file,
            extproc_args=["--protocol", "epp"],
            envoy_transform=gateway_style(body_mode),
        ) as stack,
        httpx.Client(base_url=stack.url, timeout=30) as client,
    ):
        ran = Counter(ask(client, "food-review", i) for i in range(40))
        assert set(ran) <= {"food-review-v1", "food-review-v2"} and ran["food-review-v2"] > 20
        assert ask(client, MODEL, 0) == MODEL


def test_a_target_no_pod_serves_stops_start_up(pods: list[Pod]) -> None:
    bad = [{"matches": [{"model": "food-review"}], "targets": [{"modelRewrite": "v3"}]}]
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp) / "bad.yaml", bad)
        pods_file = write_pods_file(pods, Path(tmp) / "pods.yaml")
        done = subprocess.run(
            [*EXTPROC_COMMAND, "serve", "--pods", str(pods_file), "--config", str(config),
             "--address", "127.0.0.1", "--grpc-port", "0", "--health-port", "0",
             "--metrics-port", "0"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "modelRewrites[0] (food-review): no known pod serves the target 'v3'" in done.stderr


def test_a_bad_rule_is_refused_at_reload_and_a_good_one_applied(
    rewrite_stack: Stack, config_file: Path
) -> None:
    def reloads(result: str) -> float:
        return metric(rewrite_stack, RELOADS, f'result="{result}"', absent=0.0)

    invalid, applied = reloads("invalid"), reloads("applied")
    try:
        bad = [{**SPLIT[0], "targets": [{"modelRewrite": "food-review-v1", "weight": -5}]}]
        write_config(config_file, bad)
        wait_until(lambda: reloads("invalid") == invalid + 1, what="the bad rule refused")
        log = (rewrite_stack.log_dir / "extproc.log").read_text()
        assert "targets[0].weight must be an integer from 0 to 1000000, got -5" in log
        with httpx.Client(base_url=rewrite_stack.url, timeout=30) as client:
            ran = Counter(ask(client, "food-review", i) for i in range(40))
            assert ran["food-review-v2"] > 20  # the split in force stays
            all_v1 = [{**SPLIT[0], "targets": [{"modelRewrite": "food-review-v1"}]}]
            write_config(config_file, all_v1)
            wait_until(lambda: reloads("applied") == applied + 1, what="the new rule applied")
            assert {ask(client, "food-review", i) for i in range(20)} == {"food-review-v1"}
    finally:
        write_config(config_file, SPLIT)
        wait_until(lambda: reloads("applied") >= applied + 2, what="the split back")
