"""estimated-ttft's adapter term: ``lora_ms`` is added to a pod's cost exactly where the
requested adapter is not active, with the wait for a slot where every slot is taken; a
base model's request, and a term alike on every pod, change nothing."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from extproc.pods import LoraSlots, Pod, PodId, PodMetrics
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT, EstimatedTTFTArgs
from extproc.scheduling.podtable import PodTable
from testkit import estimated_ttft
from testkit.factories import make_cycle

BASE, ADAPTER = "base", "sql-lora"
LOAD, SLOT = 50.0, 1000.0


def pod(name: str, lora: LoraSlots | None, *, adapter: bool = True) -> Pod:
    return Pod(
        PodId("ns", name),
        f"10.0.0.{len(name)}:8000",
        frozenset({BASE, ADAPTER}),
        adapters=frozenset({ADAPTER}) if adapter else frozenset(),
        metrics=PodMetrics(lora=lora),
    )


def slots(running: set[str], waiting: set[str] = set(), max_lora: int = 2) -> LoraSlots:  # noqa: B006
    return LoraSlots(frozenset(running), frozenset(waiting), max_lora)


def plugin(load: float = LOAD, slot: float = SLOT) -> EstimatedTTFT:
    args = EstimatedTTFTArgs(loraLoadMs=load, loraSlotWaitMs=slot)
    return EstimatedTTFT(args, PluginContext(CollectorRegistry()))


ACTIVE = pod("active", slots({ADAPTER}))


@pytest.mark.parametrize(
    ("lora", "added"),
    [
        pytest.param(slots({ADAPTER, "b"}), 0.0, id="active"),
        pytest.param(slots({"b"}), LOAD, id="free slot"),
        pytest.param(slots(set(), {ADAPTER}), LOAD, id="waiting, a slot free"),
        pytest.param(None, LOAD, id="no LoRA metric: as a free slot"),
        pytest.param(slots({"b"}, {ADAPTER}), LOAD + SLOT, id="waiting, slots full"),
        pytest.param(slots({"b", "c"}), LOAD + SLOT, id="full, none queued"),
        pytest.param(slots({"b", "c"}, {"d"}), LOAD + 2 * SLOT, id="full, one queued ahead"),
        pytest.param(slots({"b", "c"}, {"b", "d", "e"}), LOAD + 3 * SLOT, id="full, two ahead"),
    ],
)
def test_the_load_and_slot_wait_are_added_where_the_adapter_is_not_active(
    lora: LoraSlots | None, added: float
) -> None:
    other = pod("other", lora)
    pods = [ACTIVE, other]
    with_lora = estimated_ttft.costs(plugin(), make_cycle("hello", model=ADAPTER), pods)
    without = estimated_ttft.costs(plugin(load=0.0), make_cycle("hello", model=ADAPTER), pods)
    assert with_lora[ACTIVE.id] == without[ACTIVE.id]
    assert with_lora[other.id] - without[other.id] == pytest.approx(added)
    table = PodTable(pods)
    rows = estimated_ttft.costs_table(
        plugin(), make_cycle("hello", model=ADAPTER), table, table.all_positions()
    )
    assert rows.tolist() == [with_lora[ACTIVE.id], with_lora[other.id]]


def test_an_active_adapter_outweighs_a_short_queue() -> None:
    """One request queued ahead costs far less than loading the adapter elsewhere."""
    busy = Pod(
        PodId("ns", "busy"),
        "10.0.0.1:8000",
        frozenset({BASE, ADAPTER}),
        adapters=frozenset({ADAPTER}),
        metrics=PodMetrics(waiting=1, running=1, lora=slots({ADAPTER})),
    )
    idle = pod("idle", slots(set()))
    scores = plugin().score(make_cycle("hello", model=ADAPTER), [busy, idle])
    assert scores == {busy.id: 100, idle.id: 0}
    assert plugin(load=0.0).score(make_cycle("hello", model=ADAPTER), [busy, idle]) == {
        busy.id: 0,
        idle.id: 100,
    }


def test_a_base_model_request_costs_the_same_as_without_the_term() -> None:
    pods = [pod("full", slots({"b", "c"})), pod("free", slots(set())), pod("none", None)]
    cycle = make_cycle("hello", model=BASE)
    assert plugin().lora_ms(cycle, pods) is None
    assert estimated_ttft.costs(plugin(), cycle, pods) == estimated_ttft.costs(
        plugin(load=0.0), make_cycle("hello", model=BASE), pods
    )
    table = PodTable(pods)
    assert plugin()._lora_rows(cycle, table, table.all_positions()) is None


def test_a_term_alike_on_every_pod_is_left_out() -> None:
    """Pods without the metric (or all full alike) shift every cost by the same amount,
    which no score reads: the costs are those without the term."""
    pods = [pod("a", None), pod("b", None)]
    costs = estimated_ttft.costs(plugin(), make_cycle("hello", model=ADAPTER), pods)
    assert costs == estimated_ttft.costs(plugin(0.0), make_cycle("hello", model=ADAPTER), pods)


def test_zero_load_time_turns_the_term_off() -> None:
    pods = [ACTIVE, pod("full", slots({"b", "c"}))]
    assert plugin(load=0.0).lora_ms(make_cycle("x", model=ADAPTER), pods) is None


def test_zero_slot_wait_leaves_the_load_alone() -> None:
    full = pod("full", slots({"b", "c"}, {"d"}))
    lora = plugin(slot=0.0).lora_ms(make_cycle("x", model=ADAPTER), [ACTIVE, full])
    assert lora == {ACTIVE.id: 0.0, full.id: LOAD}


def test_explain_shows_the_term() -> None:
    full = pod("full", slots({"b", "c"}))
    terms = {
        t.pod: t.terms for t in plugin().explain(make_cycle("x", model=ADAPTER), [ACTIVE, full])
    }
    assert terms[ACTIVE.id]["lora_ms"] == 0.0
    assert terms[full.id]["lora_ms"] == LOAD + SLOT
    assert terms[full.id]["cost_ms"] - terms[ACTIVE.id]["cost_ms"] == pytest.approx(LOAD + SLOT)


def test_table_column_is_read_again_for_a_new_snapshot() -> None:
    before = PodTable([ACTIVE, pod("other", slots({"b", "c"}))])
    after = PodTable([ACTIVE, pod("other", slots({ADAPTER}))], previous=before)
    scorer = plugin()
    cycle = make_cycle("x", model=ADAPTER)
    first = scorer._lora_rows(cycle, before, before.all_positions())
    second = scorer._lora_rows(cycle, after, after.all_positions())
    assert first is not None and first.tolist() == [0.0, LOAD + SLOT]
    assert second is not None and np.array_equal(second, [0.0, 0.0])


@pytest.mark.parametrize(("value", "used"), [(-5.0, LOAD), (0.0, 0.0), (250.0, 250.0)])
def test_load_time_argument_range(value: float, used: float) -> None:
    """From 0 up (0: off); a negative value logs and uses the default."""
    scorer = EstimatedTTFT.from_args({"loraLoadMs": value}, PluginContext(CollectorRegistry()))
    assert scorer.args.loraLoadMs == used
