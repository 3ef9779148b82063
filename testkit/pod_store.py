"""One scrape outcome into a ``PodStore``, as the scraper would hand it in a batch."""

from __future__ import annotations

from extproc.datalayer.store import MetricsUpdate, PodStore
from extproc.pods import PodId, PodMetrics


def set_metrics(
    store: PodStore, pod_id: PodId, metrics: PodMetrics | None, reachable: bool = True
) -> None:
    """One pod's scrape outcome (``PodStore.update_metrics`` with a batch of one)."""
    store.update_metrics([MetricsUpdate(pod_id, metrics, reachable)])
