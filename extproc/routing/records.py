"""Records that travel between replicas: what recording a served request needs, without
its prompt.

With several extproc replicas the replica that routed a request is not always the one
that hears how it ended (Envoy sends its access log to one replica of its choosing), and
each replica learns only what it records. So a routed request's record (model, session,
the prompt's block keys of each geometry the recorders use) rides along:

* in the ext_proc reply's dynamic metadata (``wire.record_metadata``), which Envoy's
  access log hands back to whichever replica receives it: ``Carried``;
* on a Redis stream (``routing.sharing``), from the replica that recorded it to all the
  others: ``Shared``; and at the pick, from the replica that routed it, so the others
  credit the pick and count it in flight until its end: ``Started`` (its record also
  holds the pick's credit keys, ``Cycle.credit_keys``, at most ``MAX_CREDIT_BLOCKS``).

The keys are sent as they are (int64, base64 in text): at most ``maxBlocksToMatch`` of
them per geometry whatever the prompt's size (128 keys: 1,368 characters). Everything
read back is validated (``BadRecord`` names the reason); nothing read is trusted to be
well formed.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from extproc.pods import PodId
from extproc.prefix.hashing import Keys
from extproc.scheduling.interfaces import Cycle

MAX_TEXT_CHARS = 1024  # a model name, session key, origin or pod id read back
MAX_GEOMETRIES = 8
MAX_PODS_LISTED = 64  # the pick and its fallbacks
# A pick's credit keys that travel: a prompt longer than this is credited elsewhere for
# its first blocks only (a lower bound of what the pick will hold).
MAX_CREDIT_BLOCKS = 128


class BadRecord(ValueError):
    """A record read back is malformed; ``reason`` is the metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Record(NamedTuple):
    """What the recorders learn from one served request (``Cycle.replayed``); a tuple:
    built per request, more cheaply than a frozen dataclass."""

    model: str
    keys: Mapping[tuple[int, int], Keys]  # (block size, max blocks) -> block keys
    session_key: str | None = None
    credit_keys: Keys | None = None  # a pick's (``Started``): ``Cycle.credit_keys``, capped

    @classmethod
    def of(
        cls, cycle: Cycle, geometries: Iterable[tuple[int, int]], *, credit: bool = False
    ) -> Record:
        """``cycle``'s record; with ``credit``, its pick's credit keys too (capped)."""
        request = cycle.request
        keys = {g: cycle.block_keys(*g) for g in geometries}
        credit_keys = cycle.credit_keys
        if credit and credit_keys is not None:
            credit_keys = credit_keys[:MAX_CREDIT_BLOCKS]
        else:
            credit_keys = None
        return cls(request.model, keys, request.session_key, credit_keys)

    def cycle(self) -> Cycle:
        return Cycle.replayed(self.model, self.session_key, self.keys, self.credit_keys)


@dataclass(frozen=True, slots=True)
class Carried:
    """A record carried by the request itself (the access log's metadata)."""

    record: Record
    pod_by_address: Mapping[str, PodId]  # the pods listed, to tell which one served
    prefill: PodId | None
    origin: str  # the replica that routed it


@dataclass(frozen=True, slots=True)
class Shared:
    """One replica's news for the others: a request ended, recorded on ``pod`` or not."""

    origin: str  # the replica that publishes it (its own entries are skipped)
    request_id: str  # whoever routed it stops counting it in flight
    record: Record | None = None  # None: the request ended without a record
    pod: PodId | None = None
    prefill: PodId | None = None


@dataclass(frozen=True, slots=True)
class Started:
    """One replica's pick, for the others to credit and count in flight until its end."""

    origin: str
    request_id: str
    record: Record  # with the pick's credit keys
    pick: PodId
    pick_tokens: int  # the pick's in-flight tokens (``InFlight.start``)
    prefill: PodId | None = None
    prefill_pod_tokens: int = 0  # the prefill pod's


def encode_key_array(keys: Keys) -> str:
    """Base64 of the little-endian int64 keys (a geometry's in ``encode_keys``; a pick's
    credit keys in a start entry)."""
    return base64.b64encode(keys.astype("<i8", copy=False).tobytes()).decode()


def decode_key_array(encoded: str, max_keys: int, reason: str) -> Keys:
    """``encode_key_array`` read back.

    Raises:
        BadRecord(reason): not base64 of at most ``max_keys`` int64 keys.
    """
    if len(encoded) > 4 * -(-8 * max_keys // 3):
        raise BadRecord(reason, f"more than {max_keys} keys")
    try:
        raw = binascii.a2b_base64(encoded, strict_mode=True)
    except (binascii.Error, ValueError):
        raise BadRecord(reason, "not base64") from None
    if len(raw) % 8:
        raise BadRecord(reason, f"{len(raw)} bytes is not a whole number of int64 keys")
    return np.frombuffer(raw, "<i8").astype(np.int64)


def encode_keys(keys: Mapping[tuple[int, int], Keys]) -> list[str]:
    """``"<block size>:<max blocks>:<base64 of the little-endian int64 keys>"`` each."""
    return [f"{size}:{limit}:{encode_key_array(k)}" for (size, limit), k in keys.items()]


def decode_keys(
    texts: Iterable[str], geometries: Iterable[tuple[int, int]]
) -> dict[tuple[int, int], Keys]:
    """``encode_keys`` read back, for the ``geometries`` recorded here only.

    Raises:
        BadRecord: a malformed entry, or more keys than its geometry allows.
    """
    wanted = set(geometries)
    out: dict[tuple[int, int], Keys] = {}
    for i, text in enumerate(texts):
        if i >= MAX_GEOMETRIES:
            raise BadRecord("keys", f"more than {MAX_GEOMETRIES} key sets")
        size_text, _, rest = text.partition(":")
        limit_text, _, encoded = rest.partition(":")
        if not (size_text.isdigit() and limit_text.isdigit() and encoded):
            raise BadRecord("keys", f"expected size:limit:base64, got {text[:40]!r}")
        geometry = (int(size_text), int(limit_text))
        if geometry not in wanted:
            continue  # a geometry this replica's configuration does not record
        keys = decode_key_array(encoded, geometry[1], "keys")
        if not len(keys):
            raise BadRecord("keys", "0 bytes is not a whole number of int64 keys")
        out[geometry] = keys
    return out


def pod_text(pod: PodId) -> str:
    return f"{pod.namespace}/{pod.name}"


def parse_pod(text: str) -> PodId:
    """``namespace/name`` -> ``PodId``.

    Raises:
        BadRecord: not two non-empty parts.
    """
    namespace, _, name = text.partition("/")
    if not namespace or not name or len(text) > MAX_TEXT_CHARS:
        raise BadRecord("pod", f"expected namespace/name, got {text[:40]!r}")
    return PodId(namespace, name)


def check_text(value: str, field: str, *, empty: bool = False) -> str:
    """``value`` if it is a plausible model/session/origin, else ``BadRecord(field)``."""
    if (not value and not empty) or len(value) > MAX_TEXT_CHARS:
        raise BadRecord(field, f"empty or longer than {MAX_TEXT_CHARS} characters")
    return value
