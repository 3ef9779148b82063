"""A ``PrefixIndex``'s invariants, checked from its storage (for tests and debugging)."""

from __future__ import annotations

from extproc.prefix.index import PrefixIndex


def verify_index(index: PrefixIndex) -> None:
    """Raise ``AssertionError`` unless every map agrees with the LRU rings: O(entries);
    call it while no other thread uses the index."""
    storage = index.storage
    total = 0
    owners_expected: dict[int, int] = {}
    uppers_expected: dict[int, int] = {}
    for pod, lru in storage.lru_by_pod.items():
        assert storage.pod_by_slot[lru.slot] == pod
        live = storage.live_keys(lru).tolist()
        assert len(live) == len(set(live)) == lru.live, (pod, len(live), lru.live)
        assert lru.live <= index.max_entries_per_pod
        total += lru.live
        for key in live:
            owner_key = key ^ storage.page_keys[lru.page]
            owners_expected[owner_key] = owners_expected.get(owner_key, 0) | lru.bit
            if lru.page:
                uppers_expected[key] = uppers_expected.get(key, 0) | (1 << lru.page)
    assert total == storage.num_entries == len(storage.entries), (total, len(storage.entries))
    assert dict(storage.owners.items()) == owners_expected
    assert dict(storage.upper_pages.items()) == uppers_expected
