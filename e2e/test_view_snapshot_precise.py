"""``--view-snapshot`` in precise mode through Envoy: simulated pods publishing KV events,
extproc scoring with precise-prefix-cache alone. Each tenant's prefix is warmed on some
pod; extproc restarted with SIGTERM seeds the pods' token-exact views from the file, so
the next request for each prefix goes to its pod at once (before any event of the pods:
the seeded view, not the approximate one, which no pod's staleness consults). The
control without the file does not."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.support import MODEL, metric, served_by
from extproc.sim.launch import SimPods, Stack, run_stack, spawn_sim_pods
from testkit.factories import precise_only_config, write_tokenizer
from testkit.kv_events import wait_events_trusted
from testkit.waiting import wait_until

pytestmark = pytest.mark.timeout(300)
API = "/v1/completions"
TENANTS = 8  # on 4 pods: the chance that all return to their pods by luck is 4^-8
WORDS = ("hello", "world", "system", "user", "assistant")  # write_tokenizer's vocabulary
SEEDED = "extproc_kv_events_seeded_blocks_total"
BLOCKS = "extproc_kv_events_blocks"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def sim(tokenizer: Path) -> Iterator[SimPods]:
    args = ["--model", MODEL, "--tokenizer", str(tokenizer),
            "--kv-events-endpoint", "tcp://127.0.0.1:*"]  # fmt: skip
    with spawn_sim_pods(4, args=args) as pods:
        yield pods


def config(tokenizer: Path, path: Path) -> Path:
    path.write_text(precise_only_config(MODEL, tokenizer))
    return path


@pytest.fixture
def stack(sim: SimPods, tokenizer: Path, tmp_path: Path) -> Iterator[Stack]:
    args = ["--view-snapshot", str(tmp_path / "view.npz"), "--drain-s", "2",
            "--kv-events-topology", "connect"]  # fmt: skip
    with run_stack(sim.as_pods(), config=config(tokenizer, tmp_path / "precise.yaml"),
                   extproc_args=args) as running:  # fmt: skip
        running.snapshot_path = tmp_path / "view.npz"  # type: ignore[attr-defined]
        wait_events_trusted(sim.as_pods(), sim.reset_cache, [running.metrics_text])
        yield running


def prompt(tenant: int, question: str) -> dict[str, object]:
    """Tenant ``tenant``'s 64-word prefix (four blocks of 16 tokens), then ``question``."""
    words = random.Random(tenant).choices(WORDS, k=64)
    return {"model": MODEL, "prompt": " ".join(words) + " " + question, "max_tokens": 2}


def held_blocks(stack: Stack, sim: SimPods) -> float:
    gpu = (f'medium="GPU",pod="default/{p.name}"' for p in sim.pods)
    return sum(metric(stack, BLOCKS, labels, absent=0) for labels in gpu)


def warm(stack: Stack, sim: SimPods, client: httpx.Client) -> dict[int, str]:
    """Each tenant's prefix served once, and extproc's view of the pods caught up."""
    pods = {t: served_by(client.post(API, json=prompt(t, "hello"))) for t in range(TENANTS)}

    def caught_up() -> bool:
        return all(
            metric(stack, BLOCKS, f'medium="GPU",pod="default/{p.name}"', absent=0)
            == sim.stats(p.name)["engine"]["num_cached_blocks"]
            for p in sim.pods
        )

    wait_until(caught_up, 20, what="extproc's view of the pods' caches")
    return pods


def restart(stack: Stack, client: httpx.Client, remove_file: bool = False) -> None:
    """SIGTERM (the drain writes the file), start again, and wait until Envoy routes
    through the new process (a probe shorter than a block: the pods cache nothing)."""
    stack.extproc.stop()
    path: Path = stack.snapshot_path  # type: ignore[attr-defined]
    assert path.exists()
    if remove_file:
        path.unlink()
    stack.extproc = stack.start_extproc_again()
    probe = {"model": MODEL, "prompt": "up", "max_tokens": 1}
    wait_until(lambda: client.post(API, json=probe).status_code == 200, 30,
               what="requests through the restarted extproc")  # fmt: skip


def test_a_restarted_extproc_sends_each_warmed_prefix_to_its_pod_at_once(
    stack: Stack, sim: SimPods
) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        pods = warm(stack, sim, client)
        held = held_blocks(stack, sim)
        restart(stack, client)
        assert metric(stack, SEEDED) == held > 0
        assert metric(stack, "extproc_kv_events_provisional_blocks") == held
        again = {t: served_by(client.post(API, json=prompt(t, "world"))) for t in pods}
    assert again == pods
    fallbacks = "extproc_precise_prefix_fallbacks_total", 'reason="stale_pod"'
    assert metric(stack, *fallbacks, absent=0) == 0  # scored from the seeded view


def test_without_the_file_the_precise_view_starts_empty(stack: Stack, sim: SimPods) -> None:
    """The control: the same steps with the file removed before the start."""
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        pods = warm(stack, sim, client)
        restart(stack, client, remove_file=True)
        assert metric(stack, SEEDED) == 0
        again = {t: served_by(client.post(API, json=prompt(t, "world"))) for t in pods}
    assert again != pods
