"""atheris (libFuzzer for Python) on the body parser and the prompt renderer.

    python -m tests.fuzz.fuzz_request -runs=3000 -max_total_time=20 CORPUS_DIR...

The first input byte picks the API; the second picks the mode: the rest of the input as
the raw body (bytes libFuzzer mutates, seeded with ``seeds/``), or a JSON request built
from it field by field (``FuzzedDataProvider``), which reaches deep into the renderer
without having to guess valid JSON. ``oracle.check_body`` decides what is a crash.
A crash makes libFuzzer write the input (``-artifact_prefix``) and exit non-zero; put it
in ``regressions/`` and ``tests/fuzz/test_fuzz.py`` replays it for good.
"""

from __future__ import annotations

import sys
from typing import Any

import atheris

with atheris.instrument_imports(include=["extproc"]):
    import orjson

    from extproc.request.render import Rendering
    from tests.fuzz.oracle import FIELDS, PATHS, check_body

MAX_DEPTH = 5
RENDERINGS = tuple(Rendering)


def _value(fdp: atheris.FuzzedDataProvider, depth: int) -> Any:
    kind = fdp.ConsumeIntInRange(0, 8 if depth < MAX_DEPTH else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeInt(8)
    if kind == 3:
        return fdp.ConsumeRegularFloat()
    if kind == 4:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    if kind == 5:
        return fdp.PickValueInList(list(FIELDS))
    if kind == 6:
        return [_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    return {_key(fdp): _value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 4))}


def _key(fdp: atheris.FuzzedDataProvider) -> str:
    if fdp.ConsumeBool():
        return str(fdp.PickValueInList(list(FIELDS)))
    key: str = fdp.ConsumeUnicodeNoSurrogates(6)
    return key


def structured_body(fdp: atheris.FuzzedDataProvider) -> bytes:
    """A JSON object with the parser's fields, most of them present, of any shape."""
    request: dict[str, Any] = {}
    if fdp.ConsumeProbability() < 0.8:
        request["model"] = "m" if fdp.ConsumeBool() else _value(fdp, MAX_DEPTH)
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        request[_key(fdp)] = _value(fdp, 1)
    try:
        return orjson.dumps(request)
    except (orjson.JSONEncodeError, TypeError):
        return b"{}"


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    path = PATHS[data[0] % len(PATHS)]
    rendering = RENDERINGS[data[1] // 2 % len(RENDERINGS)]
    if data[1] % 2 == 0:
        check_body(path, data[2:], rendering)
    else:
        check_body(path, structured_body(atheris.FuzzedDataProvider(data[2:])), rendering)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
