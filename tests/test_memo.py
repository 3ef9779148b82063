"""FifoMemo: computed once per key, bounded, oldest entry out first."""

from __future__ import annotations

from extproc.memo import FifoMemo


def test_a_key_is_computed_once_and_the_oldest_goes_first() -> None:
    memo: FifoMemo[int, str] = FifoMemo(2)
    computed: list[int] = []

    def value(key: int) -> str:
        def compute() -> str:
            computed.append(key)
            return f"v{key}"

        return memo.get(key, compute)

    assert [value(1), value(1), value(2), value(3)] == ["v1", "v1", "v2", "v3"]
    assert computed == [1, 2, 3] and len(memo) == 2
    assert 1 not in memo and 2 in memo and 3 in memo
    assert value(1) == "v1" and computed == [1, 2, 3, 1]  # forgotten, so computed again
