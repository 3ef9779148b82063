"""Waiting until extproc's view of the pods' KV events can be trusted, for the tests and
benchmarks that route on precise prefixes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client.parser import text_string_to_metric_families

from extproc.pods import Pod

EVENTS_TIMEOUT_S = 60.0


def wait_events_trusted(
    pods: Sequence[Pod],
    flush: Callable[[int], None],
    metrics: Sequence[Callable[[], str]],
    timeout_s: float = EVENTS_TIMEOUT_S,
) -> None:
    """Until every extproc (its ``/metrics`` page, one callable each) has KV events from
    every pod and no stale view. A subscriber joins late (ZMQ drops what was sent
    before), so its first batch from a running pod shows a gap and the view goes stale;
    a cleared cache's ``AllBlocksCleared`` makes the view exact again. So each round
    flushes one such batch out of every pod (``flush(i)``), then reads the pages.

    Raises:
        TimeoutError: some view is still missing or stale after ``timeout_s``.
    """
    names = [str(p.id) for p in pods]
    deadline = time.monotonic() + timeout_s
    while True:
        for i in range(len(pods)):
            flush(i)
        time.sleep(0.3)
        missing = [n for page in (m() for m in metrics) for n in _untrusted(page, names)]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no trusted KV-events view of {sorted(set(missing))}")


def _untrusted(page: str, pods: list[str]) -> list[str]:
    """The pods of ``pods`` this extproc has no events from, or all if a view is stale."""
    received: set[str] = set()
    stale = 0.0
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "extproc_kv_events_batches_received_total" and sample.value > 0:
                received.add(sample.labels["pod"])
            elif sample.name == "extproc_kv_events_stale_pods":
                stale = sample.value
    return list(pods) if stale else [p for p in pods if p not in received]
