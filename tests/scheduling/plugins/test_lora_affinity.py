"""lora-affinity: Kthena's filter (its Go test's table) and the Inference Extension's
adapter-slot scores, per pod and on the table path."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import LoraSlots, Pod, PodId, PodMetrics
from extproc.scheduling.config import build_scheduler, load_config
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.lora_affinity import LoraAffinity
from extproc.scheduling.podtable import PodTable
from testkit.factories import make_cycle

BASE = "base-model"


def pod(
    name: str,
    models: list[str],
    adapters: list[str] | None = None,
    lora: LoraSlots | None = None,
) -> Pod:
    """A pod serving ``models``, of which ``adapters`` (default: all but the base model)
    are LoRA adapters, reporting ``lora`` slots."""
    listed = [m for m in models if m != BASE] if adapters is None else adapters
    return Pod(
        id=PodId("default", name),
        address=f"10.0.0.{len(name)}:8000",
        models=frozenset(models),
        adapters=frozenset(listed),
        metrics=PodMetrics(lora=lora),
    )


def plugin() -> LoraAffinity:
    return LoraAffinity.from_args(None, PluginContext(CollectorRegistry()))


MATCHING = pod("matching", [BASE, "adapter-a"])
OTHER = pod("other", [BASE, "adapter-b"])
EMPTY_MODEL = pod("empty-model", [""], adapters=[])


# Kthena's TestLoraAffinityFilter, case for case.
@pytest.mark.parametrize(
    ("model", "pods", "kept"),
    [
        pytest.param("adapter-a", [], [], id="empty pod list"),
        pytest.param(
            "adapter-a", [MATCHING, OTHER], ["matching"], id="keeps pods containing requested model"
        ),
        pytest.param(
            "missing-adapter", [MATCHING, OTHER], [], id="filters pods without requested model"
        ),
        pytest.param(
            "", [MATCHING, EMPTY_MODEL], ["empty-model"], id="empty model name uses contains"
        ),
    ],
)
def test_filter_keeps_the_pods_whose_model_set_contains_the_model(
    model: str, pods: list[Pod], kept: list[str]
) -> None:
    cycle = make_cycle("hello", model=model)
    assert [p.id.name for p in plugin().filter(cycle, pods)] == kept
    table = PodTable(pods)
    rows = plugin().filter_table(cycle, table, table.all_positions())
    assert [table.ids[r].name for r in rows.tolist()] == kept


def test_filter_table_keeps_only_rows_of_the_given_positions_in_order() -> None:
    pods = [MATCHING, OTHER, pod("third", [BASE, "adapter-a"])]
    table = PodTable(pods)
    rows = plugin().filter_table(make_cycle("x", model="adapter-a"), table, np.array([1, 2]))
    assert rows.tolist() == [2]


def slots(running: set[str], waiting: set[str] = set(), max_lora: int = 2) -> LoraSlots:  # noqa: B006
    return LoraSlots(frozenset(running), frozenset(waiting), max_lora)


ADAPTER = "adapter-a"


# The Inference Extension's scorer: active 1.0, free slot 0.8, waiting 0.6, full 0.0.
@pytest.mark.parametrize(
    ("lora", "score"),
    [
        pytest.param(slots({ADAPTER, "b"}), 100, id="active, slots full"),
        pytest.param(slots({ADAPTER}), 100, id="active"),
        pytest.param(slots(set()), 80, id="free slot, idle pod"),
        pytest.param(slots({"b"}), 80, id="free slot"),
        pytest.param(slots(set(), {ADAPTER}), 80, id="waiting, but a slot is free"),
        pytest.param(slots({"b"}, {ADAPTER}), 60, id="waiting, slots full"),
        pytest.param(slots({"b", "c"}), 0, id="full of other adapters"),
        pytest.param(slots({"b"}, {"c"}), 0, id="full: others running and waiting"),
        pytest.param(slots(set(), max_lora=0), 0, id="no slot at all"),
        pytest.param(None, 80, id="no LoRA metric: as a free slot"),
    ],
)
def test_adapter_request_scores_by_where_the_adapter_stands(
    lora: LoraSlots | None, score: int
) -> None:
    pods = [
        pod("p", [BASE, ADAPTER], lora=lora),
        pod("ref", [BASE, ADAPTER], lora=slots({ADAPTER})),
    ]
    cycle = make_cycle("hello", model=ADAPTER)
    assert plugin().score(cycle, pods) == {pods[0].id: score, pods[1].id: 100}
    table = PodTable(pods)
    assert plugin().score_table(cycle, table, np.array([0])).tolist() == [score]


def test_a_base_model_request_scores_the_same_on_every_pod() -> None:
    pods = [
        pod("active", [BASE, ADAPTER], lora=slots({ADAPTER})),
        pod("full", [BASE, ADAPTER], lora=slots({"b", "c"})),
        pod("free", [BASE, ADAPTER], lora=slots(set())),
        pod("unmeasured", [BASE, ADAPTER]),
    ]
    cycle = make_cycle("hello", model=BASE)
    assert set(plugin().score(cycle, pods).values()) == {100}
    table = PodTable(pods)
    assert plugin().score_table(cycle, table, table.all_positions()).tolist() == [100] * 4


def test_pods_without_lora_metrics_score_the_same_for_an_adapter() -> None:
    pods = [pod(f"p{i}", [BASE, ADAPTER]) for i in range(3)]
    assert len(set(plugin().score(make_cycle("x", model=ADAPTER), pods).values())) == 1


def test_table_scores_follow_a_new_snapshot_of_the_slots() -> None:
    """Scores are kept per snapshot and adapter: a new scrape is read again."""
    before = [pod("p", [BASE, ADAPTER], lora=slots({"b", "c"}))]
    after = [pod("p", [BASE, ADAPTER], lora=slots({ADAPTER, "c"}))]
    cycle = make_cycle("x", model=ADAPTER)
    first = PodTable(before)
    second = PodTable(after, previous=first)
    scorer = plugin()
    assert scorer.score_table(cycle, first, first.all_positions()).tolist() == [0]
    assert scorer.score_table(cycle, second, second.all_positions()).tolist() == [100]


def busy(waiting: int, lora: LoraSlots | None) -> PodMetrics:
    """A pod with ``waiting`` requests queued (and 8 running): the cost model's costliest."""
    return PodMetrics(waiting=waiting, running=8, lora=lora)


def adapter_pods(metrics: list[PodMetrics]) -> list[Pod]:
    return [replace(pod(f"p{i}", [BASE, ADAPTER]), metrics=m) for i, m in enumerate(metrics)]


def default_first(pods: list[Pod]) -> str:
    """The pod the shipped default ranks first for an adapter's request, the same each time
    (a tie would be drawn at random)."""
    scheduler = build_scheduler(load_config(), CollectorRegistry())
    firsts = {
        scheduler.schedule(make_cycle("hello", model=ADAPTER), pods)[0].id.name for _ in range(8)
    }
    assert len(firsts) == 1
    return firsts.pop()


# The shipped default weighs lora-affinity 6 against estimated-ttft's 1: a step between two
# states (20 points) outweighs the cost model's whole range (100), so the adapter's state
# on a pod ranks it first, even where the cost model finds that pod the costliest.
@pytest.mark.parametrize(
    ("metrics", "first"),
    [
        pytest.param(
            [busy(12, slots({ADAPTER})), PodMetrics(lora=slots(set()))],
            "p0",
            id="active beats an idle pod's free slot: no second copy",
        ),
        pytest.param(
            [busy(12, slots({ADAPTER})), PodMetrics(lora=None)],
            "p0",
            id="active beats an idle pod without the metric",
        ),
        pytest.param(
            [busy(60, slots({"b"})), PodMetrics(lora=slots({"c", "d"}))],
            "p0",
            id="a free slot beats slots full of other adapters",
        ),
        pytest.param(
            [busy(60, slots({"b"}, {ADAPTER})), PodMetrics(lora=slots({"c", "d"}, {"e"}))],
            "p0",
            id="queued for a slot beats slots full without it",
        ),
    ],
)
def test_the_default_ranks_an_adapters_pods_by_its_state_first(
    metrics: list[PodMetrics], first: str
) -> None:
    assert default_first(adapter_pods(metrics)) == first


@pytest.mark.parametrize(
    "metrics",
    [
        pytest.param([busy(12, slots({ADAPTER})), PodMetrics(lora=slots({ADAPTER}))], id="active"),
        pytest.param([busy(12, slots(set())), PodMetrics(lora=slots({"b"}))], id="free slot"),
        pytest.param([busy(12, slots({"b", "c"})), PodMetrics(lora=slots({"d", "e"}))], id="full"),
    ],
)
def test_the_default_leaves_pods_in_one_state_to_the_cost_model(
    metrics: list[PodMetrics],
) -> None:
    """Control: the busy pod loses to the idle one in the same state."""
    assert default_first(adapter_pods(metrics)) == "p1"
