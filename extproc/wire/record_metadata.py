"""A request's record in the ext_proc reply's dynamic metadata, and read back from
Envoy's access log (``RECORD_NAMESPACE``; ``routing.records`` says why).

The record goes out as its own serialized ``ProcessingResponse`` holding only the
metadata, appended to the route reply's bytes: protobuf merges a message field that
appears twice, so Envoy reads one reply whose metadata has both namespaces, and the
route reply itself stays serialized once per destination list (``RouteHandler``).

Fields of the ``extproc.record`` Struct: ``m`` model, ``k`` key sets
(``records.encode_keys``), ``p`` {address: namespace/name} of the pods listed, ``f``
the prefill pod, ``s`` the session key, ``o`` the replica that routed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from extproc.routing.records import (
    MAX_PODS_LISTED,
    BadRecord,
    Carried,
    Record,
    check_text,
    decode_keys,
    encode_keys,
    parse_pod,
    pod_text,
)
from extproc.routing.router import RouteDecision
from extproc.wire.protocol import RECORD_NAMESPACE


def record_reply(decision: RouteDecision, record: Record, origin: str) -> bytes:
    """The bytes to append to the route reply: its record as dynamic metadata."""
    reply = ep.ProcessingResponse()
    fields = reply.dynamic_metadata.fields[RECORD_NAMESPACE].struct_value.fields
    fields["m"].string_value = record.model
    fields["k"].list_value.extend(encode_keys(record.keys))
    pods = fields["p"].struct_value.fields
    for pod in decision.pods:
        pods[pod.address].string_value = pod_text(pod.id)
    if decision.prefill is not None:
        fields["f"].string_value = pod_text(decision.prefill.id)
    if record.session_key:
        fields["s"].string_value = record.session_key
    fields["o"].string_value = origin
    return bytes(reply.SerializeToString())


def carried_record(
    metadata: base_pb2.Metadata, geometries: Iterable[tuple[int, int]]
) -> Carried | None:
    """The record an access-log entry's dynamic metadata carries, or None without one.

    Raises:
        BadRecord: the record is there but malformed (the reason names the field).
    """
    if RECORD_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[RECORD_NAMESPACE].fields
    pods = _get(fields, "p", "struct_value").struct_value.fields
    if not pods or len(pods) > MAX_PODS_LISTED:
        raise BadRecord("pods", f"{len(pods)} pods listed")
    pod_by_address = {address: parse_pod(_text(value, "p")) for address, value in pods.items()}
    key_texts = [_text(v, "k") for v in _get(fields, "k", "list_value").list_value.values]
    session = _text(fields["s"], "s") if "s" in fields else None
    record = Record(
        check_text(_text(_get(fields, "m", "string_value"), "m"), "model"),
        decode_keys(key_texts, geometries),
        check_text(session, "session") if session is not None else None,
    )
    prefill = parse_pod(_text(fields["f"], "f")) if "f" in fields else None
    origin = check_text(_text(_get(fields, "o", "string_value"), "o"), "origin")
    return Carried(record, pod_by_address, prefill, origin)


def _get(fields: Mapping[str, struct_pb2.Value], name: str, kind: str) -> struct_pb2.Value:
    """``fields[name]``, holding a ``kind``; else ``BadRecord(name)``."""
    if name not in fields:
        raise BadRecord(name, "missing")
    value = fields[name]
    if value.WhichOneof("kind") != kind:
        raise BadRecord(name, f"expected {kind}, got {value.WhichOneof('kind')}")
    return value


def _text(value: struct_pb2.Value, name: str) -> str:
    if value.WhichOneof("kind") != "string_value":
        raise BadRecord(name, f"expected a string, got {value.WhichOneof('kind')}")
    return str(value.string_value)
