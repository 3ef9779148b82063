"""Records that travel: the reply's extproc.record metadata, read back from an access-log
entry by a replica that did not route the request, and the ends shared between routers."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from extproc.pods import PodId
from extproc.routing.records import (
    MAX_CREDIT_BLOCKS,
    BadRecord,
    Record,
    Shared,
    Started,
    decode_keys,
    encode_key_array,
    encode_keys,
)
from extproc.routing.router import Router
from extproc.routing.sharing import decode_entry, encode_shared, encode_started
from extproc.scheduling.config import default_config_text
from extproc.wire.access_log import AccessLogHandler
from extproc.wire.one_round import RouteHandler
from extproc.wire.protocol import (
    ATTRIBUTES_KEY,
    DESTINATION_KEY,
    DESTINATION_NAMESPACE,
    PATH_ATTRIBUTE,
    RECORD_KEY,
    RECORD_NAMESPACE,
    REQUEST_ID_ATTRIBUTE,
)
from extproc.wire.record_metadata import carried_record
from testkit.factories import PREFIX_ONLY
from tests.routing.support import GEOMETRY, PODS, body, log_entry, make_router, process


def outcome(router: Router, name: str) -> float:
    value: float = router.metrics.outcome[name].value
    return value


def record_of(reply: ep.ProcessingResponse) -> dict[str, Any]:
    namespace = reply.dynamic_metadata.fields[RECORD_NAMESPACE].struct_value
    return orjson.loads(namespace.fields[RECORD_KEY].string_value)  # type: ignore[no-any-return]


def test_the_reply_routes_and_carries_the_record_in_its_own_namespace() -> None:
    reply = process(make_router(), "r1")
    namespaces = reply.dynamic_metadata.fields
    assert namespaces[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_KEY].string_value
    assert reply.HasField("request_body")  # the route reply and the record, merged
    record = record_of(reply)
    assert record["m"] == "m" and len(record["p"]) == 3 and len(record["k"]) == 1
    assert process(make_router(carry=False), "r1").dynamic_metadata.fields.keys() == {
        DESTINATION_NAMESPACE
    }


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(PREFIX_ONLY, id="prefix-cache"),
        pytest.param(default_config_text(), id="shipped-default-estimated-ttft"),
    ],
)
def test_a_replica_that_did_not_route_records_from_the_metadata(config: str) -> None:
    routing, other = make_router(config=config), make_router(config=config)
    reply = process(routing, "r1")
    served = (
        reply.dynamic_metadata.fields[DESTINATION_NAMESPACE]
        .struct_value.fields[DESTINATION_KEY]
        .string_value.split(",")[1]
    )
    AccessLogHandler(other).complete(log_entry("r1", served, reply.dynamic_metadata))
    assert outcome(other, "recorded_from_metadata") == 1 and outcome(other, "unknown_request") == 0
    scorer = other.scheduler.recorders[0]
    pod = next(p.id for p in PODS if p.address == served)
    assert scorer.index.num_pod_entries(pod) > 0  # type: ignore[attr-defined]
    # The replica that routed it records it itself, from its pending table.
    AccessLogHandler(routing).complete(log_entry("r1", served, reply.dynamic_metadata))
    assert outcome(routing, "recorded") == 1 and len(routing.pending) == 0


def test_without_the_metadata_the_record_is_lost_as_before() -> None:
    routing, other = make_router(carry=False), make_router(carry=False)
    reply = process(routing, "r1")
    AccessLogHandler(other).complete(log_entry("r1", PODS[0].address, reply.dynamic_metadata))
    assert outcome(other, "unknown_request") == 1


Mutation = Callable[[dict[str, Any]], object]


def _mutated(mutate: Mutation) -> struct_pb2.Struct:
    reply = process(make_router(), "r1")
    record = record_of(reply)
    mutate(record)
    namespace = reply.dynamic_metadata.fields[RECORD_NAMESPACE].struct_value
    namespace.fields[RECORD_KEY].string_value = orjson.dumps(record).decode()
    return reply.dynamic_metadata


def _pod_ids(value: str) -> Mutation:
    return lambda record: record["p"].update(dict.fromkeys(record["p"], value))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        pytest.param(lambda r: r.pop("m"), "model", id="model-missing"),
        pytest.param(lambda r: r.update(m=3), "model", id="model-not-text"),
        pytest.param(lambda r: r.update(m=""), "model", id="model-empty"),
        pytest.param(lambda r: r.update(p="x"), "pods", id="pods-not-an-object"),
        pytest.param(lambda r: r.update(p={}), "pods", id="no-pods"),
        pytest.param(_pod_ids("no-slash"), "pod", id="pod-id-malformed"),
        pytest.param(_pod_ids(7), "pod", id="pod-id-not-text"),  # type: ignore[arg-type]
        pytest.param(lambda r: r.update(k="64:128:AAAA"), "keys", id="keys-not-a-list"),
        pytest.param(lambda r: r.update(k=["64:128:not base64!"]), "keys", id="not-base64"),
        pytest.param(lambda r: r.update(k=["64:128:" + "A" * 12]), "keys", id="not-whole-int64"),
        pytest.param(
            lambda r: r.update(k=["64:128:" + base64.b64encode(bytes(8 * 129)).decode()]),
            "keys",
            id="too-many-keys",
        ),
        pytest.param(lambda r: r.update(k=["sixty-four"]), "keys", id="keys-no-geometry"),
        pytest.param(lambda r: r.pop("o"), "origin", id="origin-missing"),
        pytest.param(lambda r: r.update(s="x" * 5000), "session", id="session-too-long"),
        pytest.param(lambda r: r.update(f="x"), "pod", id="prefill-malformed"),
    ],
)
def test_bad_metadata_is_counted_and_logged_never_recorded(mutate: Mutation, reason: str) -> None:
    metadata = _mutated(mutate)
    with pytest.raises(BadRecord) as caught:
        carried_record(_to_metadata(metadata), [GEOMETRY])
    assert caught.value.reason == reason
    other = make_router()
    AccessLogHandler(other).complete(log_entry("r1", PODS[0].address, metadata))
    assert other.metrics.bad_records.labels(reason)._value.get() == 1
    assert outcome(other, "unknown_request") == 1  # not recorded, nothing raised


@pytest.mark.parametrize(
    ("text", "reason"),
    [pytest.param("{not json", "record", id="not-json"), pytest.param("[1]", "record", id="array")],
)
def test_a_record_that_is_not_a_json_object_is_refused(text: str, reason: str) -> None:
    reply = process(make_router(), "r1")
    reply.dynamic_metadata.fields[RECORD_NAMESPACE].struct_value.fields[
        RECORD_KEY
    ].string_value = text
    with pytest.raises(BadRecord) as caught:
        carried_record(_to_metadata(reply.dynamic_metadata), [GEOMETRY])
    assert caught.value.reason == reason


def _to_metadata(struct: struct_pb2.Struct) -> base_pb2.Metadata:
    metadata = base_pb2.Metadata()
    for namespace, value in struct.fields.items():
        metadata.filter_metadata[namespace].CopyFrom(value.struct_value)
    return metadata


def test_a_220_kb_prompt_carries_at_most_max_blocks_keys() -> None:
    router = make_router()
    message = ep.ProcessingRequest(
        request_body=ep.HttpBody(body=body("y" * 220_000), end_of_stream=True)
    )
    attributes = message.attributes[ATTRIBUTES_KEY].fields
    attributes[PATH_ATTRIBUTE].string_value = "/v1/completions"
    attributes[REQUEST_ID_ATTRIBUTE].string_value = "big"
    reply, _ = RouteHandler(router).process(message)
    route_only, _ = RouteHandler(make_router(carry=False)).process(message)
    assert isinstance(reply, bytes) and isinstance(route_only, bytes)
    assert len(reply) - len(route_only) < 1_600  # 128 keys: 1,368 base64 characters


def test_keys_round_trip_and_other_geometries_are_skipped() -> None:
    keys = {GEOMETRY: np.arange(-5, 123, dtype=np.int64), (16, 4): np.array([7], np.int64)}
    back = decode_keys(encode_keys(keys), [GEOMETRY])
    assert list(back) == [GEOMETRY] and np.array_equal(back[GEOMETRY], keys[GEOMETRY])


def test_shared_entries_round_trip() -> None:
    record = Record("m", {GEOMETRY: np.array([1, -2, 3], np.int64)}, "sess")
    shared = Shared("a", "r1", record, PodId("ns", "p0"), PodId("ns", "p1"))
    fields = {k.encode(): v.encode() for k, v in encode_shared(shared).items()}
    back = decode_entry(fields, [GEOMETRY])
    assert (
        isinstance(back, Shared) and back.record is not None and back.record.session_key == "sess"
    )
    assert (back.origin, back.request_id, back.pod, back.prefill) == (
        "a",
        "r1",
        PodId("ns", "p0"),
        PodId("ns", "p1"),
    )
    assert np.array_equal(back.record.keys[GEOMETRY], record.keys[GEOMETRY])
    assert decode_entry({b"o": b"a", b"r": b"r2"}, [GEOMETRY]).record is None
    with pytest.raises(BadRecord):
        decode_entry({b"r": b"r2"}, [GEOMETRY])


def test_started_entries_round_trip_and_malformed_ones_are_refused() -> None:
    credit = np.arange(MAX_CREDIT_BLOCKS, dtype=np.int64)
    record = Record("m", {GEOMETRY: np.array([1, -2], np.int64)}, "sess", credit)
    started = Started("a", "r1", record, PodId("ns", "p0"), 900, PodId("ns", "p1"), 40)
    fields = {k.encode(): v.encode() for k, v in encode_started(started).items()}
    back = decode_entry(fields, [GEOMETRY])
    assert isinstance(back, Started) and back.record.credit_keys is not None
    assert np.array_equal(back.record.credit_keys, credit)
    assert (back.pick, back.pick_tokens, back.prefill, back.prefill_pod_tokens) == (
        PodId("ns", "p0"),
        900,
        PodId("ns", "p1"),
        40,
    )
    too_many = encode_key_array(np.arange(MAX_CREDIT_BLOCKS + 1, dtype=np.int64)).encode()
    for field, value, reason in [
        (b"e", b"begin", "kind"),
        (b"n", b"-1", "tokens"),
        (b"c", too_many, "credit_keys"),
        (b"c", b"not base64!", "credit_keys"),
    ]:
        with pytest.raises(BadRecord) as raised:
            decode_entry({**fields, field: value}, [GEOMETRY])
        assert raised.value.reason == reason


def test_ends_published_by_one_router_are_applied_by_another_without_echo() -> None:
    published_a: list[Shared | Started] = []
    published_b: list[Shared | Started] = []
    a = make_router(sessions=True, share=published_a.append)
    b = make_router(sessions=True, share=published_b.append)
    reply = process(b, "r1", session="s1")  # b routes, a hears the end
    assert [type(p) for p in published_b] == [Started]  # its pick
    published_b.clear()
    pick = b.pending.pop("r1")
    assert pick is not None
    b.pending.add("r1", pick)
    AccessLogHandler(a).complete(log_entry("r1", PODS[2].address, reply.dynamic_metadata))
    assert len(published_a) == 1
    assert isinstance(published_a[0], Shared) and published_a[0].pod == PODS[2].id
    assert b.in_flight.get(pick.pick) == 1
    assert b.apply_shared(published_a[0]) is True
    assert b.in_flight.get(pick.pick) == 0 and len(b.pending) == 0  # ended elsewhere
    assert b.metrics.ended_elsewhere._value.get() == 1
    assert published_b == []  # applied, not published again
    assert b.scheduler.sessions is not None
    binding = b.scheduler.sessions.get("s1")
    assert binding is not None and binding.pod == PODS[2].id  # the session, shared too
    entries = b.scheduler.recorders[0].index.num_pod_entries(PODS[2].id)  # type: ignore[attr-defined]
    assert entries == a.scheduler.recorders[0].index.num_pod_entries(PODS[2].id)  # type: ignore[attr-defined]


def test_a_shared_record_for_an_unknown_pod_is_skipped() -> None:
    router = make_router()
    record = Record("m", {GEOMETRY: np.array([1], np.int64)})
    assert router.apply_shared(Shared("x", "r9", record, PodId("default", "gone"))) is False
    assert router.metrics.shared_unknown_pod["end"]._value.get() == 1


def test_a_failed_end_is_published_whoever_routed_it() -> None:
    published: list[Shared | Started] = []
    a, b = make_router(share=published.append), make_router()
    process(a, "mine")
    reply = process(b, "theirs")
    handler = AccessLogHandler(a)
    handler.complete(log_entry("mine", PODS[0].address, None, code=503))
    handler.complete(log_entry("theirs", PODS[0].address, reply.dynamic_metadata, code=503))
    ends = [p for p in published if isinstance(p, Shared)]
    # Routed here: the others applied its pick; elsewhere: its router counts it in flight.
    assert [(s.request_id, s.record) for s in ends] == [("mine", None), ("theirs", None)]
    pick = b.pending.pop("theirs")
    assert pick is not None
    b.pending.add("theirs", pick)
    b.apply_shared(ends[1])
    assert b.in_flight.get(pick.pick) == 0 and len(b.pending) == 0
