"""bench.instructions' pure parts: variants, callgrind dumps, callgrind_annotate rows."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.instructions import Variant, parse_annotate, thread_totals

ANNOTATE = """\
--------------------------------------------------------------------------------
513,459,053 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                   file:function
--------------------------------------------------------------------------------
68,726,226 (13.38%)  /tmp/build/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault [/lib/libpython3.11.so]
 9,296,838 ( 1.81%)  ./string/memmove-vec-unaligned-erms.S:__memcpy_avx_unaligned_erms [/lib/libc.so.6]
 6,156,616 ( 1.20%)  ???:_upb_Decoder_DecodeMessage'2 [google/_upb/_message.abi3.so]
"""


def test_a_variant_names_its_config_and_optionally_a_checkout(tmp_path: Path) -> None:
    plain = Variant.parse("now=default")
    assert (plain.name, plain.config, plain.checkout) == ("now", "default", None)
    assert plain.config_path() is None
    assert plain.command(tmp_path / "out")[-2:] == ["-m", "extproc"]
    other = Variant.parse(f"old=bench/configs/least-request.yaml@{tmp_path}")
    assert other.checkout == tmp_path
    assert other.config_path() == Path("bench/configs/least-request.yaml").resolve()
    assert str(tmp_path) in other.command(tmp_path / "out")[-1]
    floor = Variant.parse("no-routing=trivial")
    assert floor.command(tmp_path / "out")[-2:] == ["-m", "bench.trivial_picker"]
    assert floor.config_path() is None
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=CONFIG"):
        Variant.parse("no-config")


def test_thread_totals_read_only_the_named_dump(tmp_path: Path) -> None:
    out = tmp_path / "callgrind.out"
    (tmp_path / "callgrind.out.1-01").write_text("desc: Trigger: dump measured\ntotals: 120\n")
    (tmp_path / "callgrind.out.1-02").write_text("desc: Trigger: dump measured\ntotals: 7\n")
    (tmp_path / "callgrind.out-01").write_text("desc: Trigger: Program termination\ntotals: 9\n")
    totals = thread_totals(out, "measured")
    assert sorted(totals.values()) == [7, 120]


def test_annotate_rows_become_counts_and_short_function_names() -> None:
    assert parse_annotate(ANNOTATE) == [
        (68_726_226, "ceval.c:_PyEval_EvalFrameDefault"),
        (9_296_838, "memmove-vec-unaligned-erms.S:__memcpy_avx_unaligned_erms"),
        (6_156_616, "???:_upb_Decoder_DecodeMessage'2"),
    ]
