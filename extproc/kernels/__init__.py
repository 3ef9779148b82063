"""The per-request inner loops, compiled when they can be: a Cython module built with
extproc (``_compiled.pyx``) and its pure reference (``pure.py``, NumPy), giving the same
results (``tests/kernels`` proves them equal on generated inputs).

``pip install .`` compiles the module when a C compiler is there and goes on without it
when not (``setup.py``); then the pure functions run, and ``extproc --version`` and the
start-up log say so (``IMPLEMENTATION``). ``EXTPROC_KERNELS=pure`` chooses the pure path
even where the compiled one is built (CI runs the unit tests both ways).
"""

from __future__ import annotations

import os

from extproc.kernels import pure

KERNELS_ENV = "EXTPROC_KERNELS"


def _select() -> tuple[str, pure.Kernels]:
    """The implementation's description, and its functions."""
    if os.environ.get(KERNELS_ENV, "").strip().lower() == "pure":
        return f"pure Python ({KERNELS_ENV}=pure)", pure.KERNELS
    try:
        from extproc.kernels import _compiled  # type: ignore[attr-defined]  # built by setup.py
    except ImportError:
        return "pure Python (no compiled kernels: extproc was built without a C compiler)", (
            pure.KERNELS
        )
    kernels: pure.Kernels = _compiled.KERNELS
    return "compiled (Cython)", kernels


IMPLEMENTATION, KERNELS = _select()
held_lengths = KERNELS.held_lengths
arriving_blocks = KERNELS.arriving_blocks
rank_few = KERNELS.rank_few
rank_best = KERNELS.rank_best
ttft_costs = KERNELS.ttft_costs
put_all = KERNELS.put_all
chain_xxh3 = KERNELS.chain_xxh3
chain_xxh64 = KERNELS.chain_xxh64
evict_oldest = KERNELS.evict_oldest
