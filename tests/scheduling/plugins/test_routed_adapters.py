"""The adapters a replica routed to each pod lately count as active there
(``lora_rows.RoutedAdapters``): vLLM's metric names only those with requests in flight,
while an adapter stays in its slot after them. lora-affinity and estimated-ttft read them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from extproc.pods import LoraSlots, Pod, PodId, PodMetrics
from extproc.scheduling.interfaces import PluginContext
from extproc.scheduling.plugins.estimated_ttft import EstimatedTTFT, EstimatedTTFTArgs
from extproc.scheduling.plugins.lora_affinity import LoraAffinity
from extproc.scheduling.plugins.lora_rows import RoutedAdapters
from testkit.factories import make_cycle

BASE = "base"
ADAPTERS = ("a", "b", "c")


def pod(name: str, lora: LoraSlots | None = None) -> Pod:
    return Pod(
        PodId("ns", name),
        f"10.0.0.{len(name)}:8000",
        frozenset({BASE, *ADAPTERS}),
        adapters=frozenset(ADAPTERS),
        metrics=PodMetrics(lora=lora),
    )


IDLE_TWO_SLOTS = LoraSlots(max_lora=2)  # the metric of an idle pod: no adapter in flight
PODS = [pod("p0", IDLE_TWO_SLOTS), pod("p1", IDLE_TWO_SLOTS)]


def test_the_last_adapters_routed_to_a_pod_fill_its_slots() -> None:
    routed = RoutedAdapters()
    routed.pods_changed(PODS)
    for adapter in ("a", "b", "c"):
        routed.arriving(adapter, PODS[0].id)
    slots = routed.slots(PODS[0])
    assert slots is not None and slots.running == {"b", "c"}  # its two slots, LRU
    assert not slots.has_free_slot()
    assert routed.slots(PODS[1]) == IDLE_TWO_SLOTS  # nothing routed there


def test_a_base_models_request_takes_no_slot_and_a_pod_without_the_metric_has_one() -> None:
    routed = RoutedAdapters()
    unscraped = pod("new")
    routed.pods_changed([unscraped])
    routed.arriving(BASE, unscraped.id)
    assert routed.slots(unscraped) is None
    routed.arriving("a", unscraped.id)
    assert routed.slots(unscraped) == LoraSlots(frozenset({"a"}), frozenset(), 1)


def test_a_pod_that_leaves_is_forgotten() -> None:
    routed = RoutedAdapters()
    routed.pods_changed(PODS)
    routed.arriving("a", PODS[0].id)
    routed.pods_changed(PODS[1:])
    routed.pods_changed(PODS)
    assert routed.slots(PODS[0]) == IDLE_TWO_SLOTS


def test_lora_affinity_prefers_the_pod_an_adapter_was_just_routed_to() -> None:
    plugin = LoraAffinity.from_args(None, PluginContext(CollectorRegistry()))
    plugin.pods_changed(PODS)
    cycle = make_cycle("hello", model="a")
    assert plugin.score(cycle, PODS) == {PODS[0].id: 80, PODS[1].id: 80}
    plugin.arriving(cycle, PODS[1].id)
    assert plugin.score(cycle, PODS) == {PODS[0].id: 80, PODS[1].id: 100}
    reloaded = LoraAffinity.from_args(None, PluginContext(CollectorRegistry()))
    assert reloaded.adopt(plugin)
    assert reloaded.score(cycle, PODS)[PODS[1].id] == 100


def test_estimated_ttft_prices_no_load_where_the_adapter_was_just_routed() -> None:
    plugin = EstimatedTTFT(EstimatedTTFTArgs(loraLoadMs=50.0), PluginContext(CollectorRegistry()))
    plugin.pods_changed(PODS)
    cycle = make_cycle("hello", model="a")
    plugin.arriving(cycle, PODS[0].id)
    assert plugin.lora_ms(cycle, PODS) == {PODS[0].id: 0.0, PODS[1].id: 50.0}
