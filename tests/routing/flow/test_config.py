"""The flowControl section: defaults, and every bad value stops start-up, named."""

from __future__ import annotations

import pytest

from extproc.errors import ConfigError
from extproc.routing.flow.config import FlowConfig, parse_flow_control
from extproc.scheduling.config import parse_config


def test_no_section_is_off_and_an_empty_one_is_on_with_the_defaults() -> None:
    assert parse_flow_control(None, "f") == FlowConfig()
    assert not FlowConfig().enabled
    on = parse_flow_control({}, "f")
    assert on.enabled and on.max_waiting == 1 and on.max_kv_usage == 0.9
    assert on.trusted_headers == frozenset() and on.ttl_s == 15
    assert parse_flow_control({"saturation": {"maxWaiting": 0}}, "f").max_waiting == 0
    reserve = parse_flow_control({"saturation": {"reservedSlots": 2, "reservedFor": 50}}, "f")
    assert (reserve.reserved_slots, reserve.reserved_for) == (2, 50)
    assert (on.reserved_slots, on.reserved_for) == (0, 1)
    assert on.batch_slots is None
    assert parse_flow_control({"saturation": {"batchSlots": 256}}, "f").batch_slots == 256


def test_the_section_reaches_the_routing_layer_through_the_scheduler_config() -> None:
    text = """
scheduler:
  plugins: {Filter: {enabled: []}, Score: {enabled: [{name: least-request, weight: 1}]}}
flowControl:
  trustedHeaders: [x-gateway-inference-objective]
  objectives: {critical: 100, batch: -1}
  queue: {ttlS: 3, bandTtlS: {"100": 30}}
"""
    config = parse_config(text, "c.yaml")
    flow = parse_flow_control(config.flow_control, config.source)
    assert flow.objectives == {"critical": 100, "batch": -1}
    assert flow.ttl_for(100) == 30 and flow.ttl_for(0) == 3 and flow.longest_ttl_s == 30


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"enabled": "yes"}, "flowControl.enabled"),
        ({"saturation": {"maxWaitng": 3}}, "unknown key 'maxWaitng'"),
        ({"saturation": {"maxKvUsage": 1.5}}, "maxKvUsage must be in (0, 1]"),
        ({"queue": {"ttlS": 0}}, "queue.ttlS must be a number greater than 0"),
        ({"saturation": {"maxWaiting": -1}}, "maxWaiting must be a number 0 or more"),
        ({"saturation": {"reservedSlots": -2}}, "reservedSlots must be a number 0 or more"),
        ({"saturation": {"reservedFor": "high"}}, "reservedFor must be an integer"),
        ({"saturation": {"batchSlots": 0}}, "batchSlots must be an integer of 1 or more"),
        ({"saturation": {"batchSlots": 2.5}}, "batchSlots must be an integer of 1 or more"),
        ({"queue": {"maxRequests": "many"}}, "queue.maxRequests"),
        ({"objectives": {"critical": "high"}}, "objectives.critical must be an integer"),
        ({"trustedHeaders": ["X-Tenant"]}, "not a lowercase header name"),
        ({"fairness": {"bodyField": ""}}, "fairness.bodyField"),
        ({"bogus": 1}, "unknown key 'bogus'"),
        ([], "flowControl must be a mapping"),
    ],
)
def test_a_bad_value_stops_start_up_naming_it(section: object, named: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_flow_control(section, "c.yaml")
    assert named in str(raised.value) and "c.yaml" in str(raised.value)
