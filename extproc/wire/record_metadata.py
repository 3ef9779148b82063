"""A request's record in the ext_proc reply's dynamic metadata, and read back from
Envoy's access log (``RECORD_NAMESPACE``; ``routing.records`` says why).

The record goes out as its own serialized ``ProcessingResponse`` holding only the
metadata, appended to the route reply's bytes: protobuf merges a message field that
appears twice, so Envoy reads one reply whose metadata has both namespaces, and the
route reply itself stays serialized once per destination list (``RouteHandler``).

The namespace holds one field, ``r``: a JSON object (one string parses and builds in a
few microseconds, a Struct of nested fields in tens) with ``m`` the model, ``k`` the key
sets (``records.encode_keys``), ``p`` {address: namespace/name} of the pods listed,
``f`` the prefill pod, ``s`` the session key, ``o`` the replica that routed.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.routing.decision import RouteDecision
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
from extproc.wire.protocol import RECORD_KEY, RECORD_NAMESPACE


def record_reply(decision: RouteDecision, record: Record, origin: str) -> bytes:
    """The bytes to append to the route reply: its record as dynamic metadata."""
    fields: dict[str, object] = {
        "m": record.model,
        "k": encode_keys(record.keys),
        "p": {pod.address: pod_text(pod.id) for pod in decision.pods},
        "o": origin,
    }
    if decision.prefill is not None:
        fields["f"] = pod_text(decision.prefill.id)
    if record.session_key:
        fields["s"] = record.session_key
    reply = ep.ProcessingResponse()
    namespace = reply.dynamic_metadata.fields[RECORD_NAMESPACE].struct_value
    namespace.fields[RECORD_KEY].string_value = orjson.dumps(fields).decode()
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
    namespace = metadata.filter_metadata[RECORD_NAMESPACE].fields
    if RECORD_KEY not in namespace or namespace[RECORD_KEY].WhichOneof("kind") != "string_value":
        raise BadRecord("record", f"no string {RECORD_KEY!r} in {RECORD_NAMESPACE}")
    try:
        fields = orjson.loads(namespace[RECORD_KEY].string_value)
    except orjson.JSONDecodeError as exc:
        raise BadRecord("record", f"not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise BadRecord("record", "not a JSON object")
    pods = fields.get("p")
    if not isinstance(pods, dict) or not 0 < len(pods) <= MAX_PODS_LISTED:
        raise BadRecord("pods", f"expected 1 to {MAX_PODS_LISTED} address: pod pairs")
    pod_by_address = {str(address): parse_pod(_text(pod, "pod")) for address, pod in pods.items()}
    key_texts = fields.get("k")
    if not isinstance(key_texts, list):
        raise BadRecord("keys", "expected a list")
    session = fields.get("s")
    record = Record(
        check_text(_text(fields.get("m"), "model"), "model"),
        decode_keys([_text(t, "keys") for t in key_texts], geometries),
        check_text(_text(session, "session"), "session") if session is not None else None,
    )
    prefill = parse_pod(_text(fields["f"], "prefill")) if "f" in fields else None
    origin = check_text(_text(fields.get("o"), "origin"), "origin")
    return Carried(record, pod_by_address, prefill, origin)


def _text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise BadRecord(name, f"expected a string, got {type(value).__name__}")
    return value
