# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=False
"""The kernels compiled: the same functions as ``pure.py``, one C loop each."""

from cykhash.khashmaps cimport Int64toInt64Map
from libc.stdint cimport int64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

import numpy as np

from extproc.kernels.pure import BYTES_PER_TOKEN, RANK_FIELD_BITS, Kernels

cdef int64_t FIELD_BITS = RANK_FIELD_BITS  # rank_best's key fields, as C constants
cdef int64_t FIELD = (<int64_t>1) << FIELD_BITS


cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil  # GCC and Clang: the lowest set bit

# xxHash's own C, inlined (XXH_INLINE_ALL, setup.py; the header is vendored in vendor/):
# the Python package hashes one buffer per call and has no C interface, so a chain of
# blocks would cost a Python call, a slice and a concatenation per block.
cdef extern from "xxhash.h" nogil:
    unsigned long long XXH64(const void *data, size_t length, unsigned long long seed)
    unsigned long long XXH3_64bits_withSeed(
        const void *data, size_t length, unsigned long long seed)


def held_lengths(Int64toInt64Map owners, Int64toInt64Map upper_pages,
                 const int64_t[::1] page_keys, const int64_t[::1] keys, dict page_masks,
                 const int64_t[::1] places, int64_t slots_per_page, int64_t[::1] out):
    """``pure.held_lengths``: block by block, a probe of ``upper_pages`` and one of
    ``owners`` per candidate page that may hold it, through cykhash's C interface."""
    cdef int64_t candidates[64]
    cdef int64_t upper = 0, on_pages, mask, key, probe, place, slot
    cdef Py_ssize_t i, num_places = places.shape[0]
    cdef int page, bit
    for page in range(64):
        candidates[page] = 0
    for page_obj, mask_obj in page_masks.items():
        page = page_obj
        if page < 0 or page >= 64 or page >= page_keys.shape[0]:
            raise ValueError(f"page {page} is out of range")
        candidates[page] = mask_obj
        if page:
            upper |= (<int64_t>1) << page
    for i in range(keys.shape[0]):
        key = keys[i]
        on_pages = 0
        if upper and upper_pages.contains(key):
            on_pages = upper_pages.cget(key) & upper
        if candidates[0]:
            on_pages |= 1
        while on_pages:
            page = __builtin_ctzll(<unsigned long long>on_pages)
            on_pages &= on_pages - 1
            probe = key ^ page_keys[page]
            if not owners.contains(probe):
                continue
            mask = owners.cget(probe) & candidates[page]
            while mask:
                bit = __builtin_ctzll(<unsigned long long>mask)
                mask &= mask - 1
                slot = page * slots_per_page + bit
                if slot >= num_places:
                    raise ValueError(f"slot {slot} has no place")
                place = places[slot]
                if place >= 0:
                    out[place] = i + 1


def arriving_blocks(const int64_t[:, ::1] keys, const int64_t[::1] lengths,
                    const int64_t[::1] slots, Py_ssize_t num_rows, const int64_t[:] prompt,
                    Py_ssize_t num_slots):
    """``pure.arriving_blocks``: each row walked to its first difference."""
    cdef int64_t *longest = <int64_t *>calloc(max(1, num_slots), sizeof(int64_t))
    if longest == NULL:
        raise MemoryError()
    cdef Py_ssize_t row, i, end
    cdef dict found = {}
    try:
        for row in range(num_rows):
            end = min(lengths[row], prompt.shape[0])
            i = 0
            while i < end and keys[row, i] == prompt[i]:
                i += 1
            if i > longest[slots[row]]:
                longest[slots[row]] = i
        for i in range(num_slots):
            if longest[i]:
                found[i] = longest[i]
    finally:
        free(longest)
    return found


cdef int _weighted_totals(list scores, list weights, int64_t *totals, Py_ssize_t n) except -1:
    """``totals[i] += weights[j] * scores[j][i]`` for every scores array ``j``: the
    candidates' weighted totals, as ``rank_few`` and ``rank_best`` add them."""
    cdef const int64_t[:] scored
    cdef int64_t weight
    cdef Py_ssize_t i, j
    if len(scores) != len(weights):
        raise ValueError("one weight per scores array")
    for j in range(len(scores)):
        scored = scores[j]
        weight = weights[j]
        if scored.shape[0] != n:
            raise ValueError("one score per position")
        for i in range(n):
            totals[i] += weight * scored[i]
    return 0


cdef object _in_order(const int64_t[::1] positions, const Py_ssize_t *order, Py_ssize_t n):
    """A new array of ``positions[order[k]]`` for ``k`` below ``n``."""
    cdef Py_ssize_t k
    ranked = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] out = ranked
    for k in range(n):
        out[k] = positions[order[k]]
    return ranked


cdef inline bint _ranks_before(Py_ssize_t a, Py_ssize_t b, const int64_t *totals,
                               const int64_t *load, const double *tiebreak):
    """Whether ``a`` goes before ``b``: a higher total, then less load, then the draw."""
    if totals[a] != totals[b]:
        return totals[a] > totals[b]
    if load[a] != load[b]:
        return load[a] < load[b]
    return tiebreak[a] < tiebreak[b]


def rank_few(list scores, list weights, const int64_t[::1] positions,
             const int64_t[::1] busy, const int64_t[::1] routed, random):
    """``pure.rank_few``: the totals, loads and draws in one pass, then an insertion sort
    (stable, as ``np.lexsort``; for the few candidates it is called with)."""
    cdef Py_ssize_t n = positions.shape[0], i, at
    cdef int64_t row
    cdef int64_t *totals = <int64_t *>calloc(max(1, n), sizeof(int64_t))
    cdef int64_t *load = <int64_t *>calloc(max(1, n), sizeof(int64_t))
    cdef double *tiebreak = <double *>calloc(max(1, n), sizeof(double))
    cdef Py_ssize_t *order = <Py_ssize_t *>calloc(max(1, n), sizeof(Py_ssize_t))
    if totals == NULL or load == NULL or tiebreak == NULL or order == NULL:
        free(totals); free(load); free(tiebreak); free(order)
        raise MemoryError()
    try:
        _weighted_totals(scores, weights, totals, n)
        for i in range(n):
            row = positions[i]
            load[i] = busy[row] if busy[row] >= routed[row] else routed[row]
        for i in range(n):
            tiebreak[i] = random()
        for i in range(n):
            at = i
            while at > 0 and _ranks_before(i, order[at - 1], totals, load, tiebreak):
                order[at] = order[at - 1]
                at -= 1
            order[at] = i
        return _in_order(positions, order, n)
    finally:
        free(totals); free(load); free(tiebreak); free(order)


def rank_best(list scores, list weights, const int64_t[::1] positions,
              const int64_t[::1] busy, const int64_t[::1] routed,
              const int64_t[::1] shuffled, Py_ssize_t limit):
    """``pure.rank_best``: the totals, loads and packed keys in one pass, then the
    ``limit`` smallest keys kept by insertion (``limit`` is a few: the pick and its
    fallbacks)."""
    cdef Py_ssize_t n = positions.shape[0], i, at, count = 0
    cdef int64_t row, top, load, key
    cdef int64_t *keys
    cdef int64_t *best_keys
    cdef Py_ssize_t *best
    if limit > n:
        limit = n
    if limit <= 0:
        return np.empty(0, dtype=np.int64)
    if shuffled.shape[0] != n:
        raise ValueError("shuffled must be a permutation of the positions' indices")
    if n >= FIELD:
        return None
    keys = <int64_t *>calloc(n, sizeof(int64_t))
    best_keys = <int64_t *>malloc(limit * sizeof(int64_t))
    best = <Py_ssize_t *>malloc(limit * sizeof(Py_ssize_t))
    if keys == NULL or best_keys == NULL or best == NULL:
        free(keys); free(best_keys); free(best)
        raise MemoryError()
    try:
        _weighted_totals(scores, weights, keys, n)
        top = keys[0]
        for i in range(1, n):
            if keys[i] > top:
                top = keys[i]
        for i in range(n):
            keys[i] = top - keys[i]  # behind the best
            if keys[i] >= FIELD:
                return None
            row = positions[i]
            load = busy[row] if busy[row] >= routed[row] else routed[row]
            if load < 0 or load >= FIELD:
                return None
            keys[i] = (keys[i] << (2 * FIELD_BITS)) | (load << FIELD_BITS)
        for i in range(n):
            at = shuffled[i]
            if at < 0 or at >= n:
                raise ValueError("shuffled must be a permutation of the positions' indices")
            keys[at] |= i
        for i in range(n):
            key = keys[i]
            if count == limit and key >= best_keys[limit - 1]:
                continue
            at = count if count < limit else limit - 1
            while at > 0 and key < best_keys[at - 1]:
                best_keys[at] = best_keys[at - 1]
                best[at] = best[at - 1]
                at -= 1
            best_keys[at] = key
            best[at] = i
            if count < limit:
                count += 1
        return _in_order(positions, best, limit)
    finally:
        free(keys); free(best_keys); free(best)


def ttft_costs(const int64_t[::1] held, tuple prompt, const int64_t[::1] positions,
               const int64_t[::1] requests, const int64_t[::1] tokens,
               const int64_t[::1] waiting, const int64_t[::1] running,
               const double[::1] written, const double[::1] sessions,
               const double[::1] session_bytes, const double[::1] capacity, prices,
               int64_t[::1] uncached_out, double[::1] costs_out, int64_t[::1] scores_out):
    """``pure.ttft_costs``: the same float operations in the same order, a row at a time
    (``-ffp-contract=off``: no fused multiply-add)."""
    cdef int64_t units = prompt[0], units_per_token = prompt[1], num_tokens = prompt[2]
    cdef double prefill = prices[0], queued_ms = prices[1], running_ms = prices[2]
    cdef double written_ms = prices[3], min_match = prices[4], margin = prices[5]
    cdef double ratio = prices[6], session_ms = prices[7]
    cdef Py_ssize_t n = positions.shape[0], i
    cdef int64_t row, in_flight, queued, longest = 0
    cdef double mean, most = 0.0, scale, total = 0.0, est, low, high
    cdef double held_bytes = 0.0, capacity_sum = 0.0, capacity_min = 0.0, weight
    cdef double bytes_per_token = BYTES_PER_TOKEN
    for i in range(n):
        row = positions[i]
        uncached_out[i] = -((held[i] - units) // units_per_token)  # floor, as Python
        in_flight = requests[row]
        queued = waiting[row] + max(0, in_flight - waiting[row] - running[row])
        mean = <double>tokens[row] / <double>in_flight if in_flight > 0 else <double>num_tokens
        costs_out[i] = (
            prefill * (<double>queued * mean + <double>uncached_out[i])
            + queued_ms * <double>(1 + queued)
            + running_ms * <double>running[row]
        )
        if written[row] > most:
            most = written[row]
        if held[i] > longest:
            longest = held[i]
        if session_ms > 0:
            total += sessions[row]
            held_bytes += session_bytes[row]
            capacity_sum += capacity[row]
            if i == 0 or capacity[row] < capacity_min:
                capacity_min = capacity[row]
    if most > 0:
        scale = written_ms / (most * <double>max(1, num_tokens))
        for i in range(n):
            costs_out[i] += scale * written[positions[i]] * <double>uncached_out[i]
    if longest > 0 and <double>longest / <double>max(1, units) >= min_match:
        for i in range(n):
            if held[i] == longest:
                est = costs_out[i]
                low = est / ratio
                costs_out[i] = est - margin if est - margin <= low else low
    if session_ms > 0:
        scale = max(1.0, total / <double>max(1, n))
        if n > 0 and capacity_min > 0:  # pure.session_weight
            weight = min(1.0, scale * held_bytes / bytes_per_token / capacity_sum)
            if weight < 1.0:
                session_ms = session_ms * weight
        for i in range(n):
            costs_out[i] += session_ms * sessions[positions[i]] / scale
    if n == 0:
        return
    low, high = costs_out[0], costs_out[0]
    for i in range(1, n):
        if costs_out[i] < low:
            low = costs_out[i]
        if costs_out[i] > high:
            high = costs_out[i]
    for i in range(n):
        scores_out[i] = 100 if high == low else <int64_t>(100.0 * (high - costs_out[i]) / (high - low))


def put_all(Int64toInt64Map table, const int64_t[:] keys, const int64_t[:] values):
    """``pure.put_all``: one insert a key, through cykhash's C interface."""
    cdef Py_ssize_t i
    for i in range(keys.shape[0]):
        table.cput(keys[i], values[i])


def evict_oldest(Int64toInt64Map entries, Int64toInt64Map owners, Int64toInt64Map upper_pages,
                 const int64_t[::1] ring, const int64_t[::1] tags, Py_ssize_t head,
                 Py_ssize_t size, int64_t base, int64_t lru_key, int64_t page_key, int64_t bit,
                 int page, Py_ssize_t count):
    """``pure.evict_oldest``: the ring walked from its head, an entry at a time, through
    cykhash's C interface."""
    cdef dict by_tag = {}
    cdef int64_t key, entry, owner_key, mask, pages
    cdef int64_t page_bit = (<int64_t>1) << page
    while count > 0 and head < size:
        key = ring[head]
        entry = key ^ lru_key
        if entries.contains(entry) and entries.cget(entry) == base + head:
            entries.discard(entry)
            owner_key = key ^ page_key
            mask = (owners.cget(owner_key) if owners.contains(owner_key) else 0) & ~bit
            if mask:
                owners.cput(owner_key, mask)
            else:
                owners.discard(owner_key)
                if page:
                    pages = (upper_pages.cget(key) if upper_pages.contains(key) else 0) & ~page_bit
                    if pages:
                        upper_pages.cput(key, pages)
                    else:
                        upper_pages.discard(key)
            tag = tags[head]
            by_tag[tag] = by_tag.get(tag, 0) + 1
            count -= 1
        head += 1
    return head, by_tag


def chain_xxh3(bytes data, Py_ssize_t step, Py_ssize_t num, root, bytes first_extra,
               bytes extra):
    """``pure.chain_xxh3``: each block and its extra bytes copied into one buffer and
    hashed by xxHash's C (slices past the data's end are short or empty, as in Python)."""
    cdef const unsigned char *source = data
    cdef Py_ssize_t size = len(data), i, start, end, tail
    cdef Py_ssize_t longest = max(len(first_extra), len(extra))
    cdef unsigned long long parent = root
    cdef const unsigned char *tail_bytes
    cdef unsigned char *buffer = <unsigned char *>malloc(max(1, step) + longest)
    cdef list keys = []
    if buffer == NULL:
        raise MemoryError()
    try:
        for i in range(num):
            start, end = min(i * step, size), min((i + 1) * step, size)
            tail_bytes = <const unsigned char *>(first_extra if i == 0 else extra)
            tail = len(first_extra) if i == 0 else len(extra)
            if tail == 0:
                parent = XXH3_64bits_withSeed(source + start, end - start, parent)
            else:
                memcpy(buffer, source + start, end - start)
                memcpy(buffer + end - start, tail_bytes, tail)
                parent = XXH3_64bits_withSeed(buffer, end - start + tail, parent)
            keys.append(parent)
    finally:
        free(buffer)
    return keys


def chain_xxh64(bytes data, Py_ssize_t block_size, Py_ssize_t max_blocks, start):
    """``pure.chain_xxh64``: the previous key's decimal digits and the block's bytes
    written into one buffer and hashed by xxHash's C."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    cdef const unsigned char *source = data
    # the blocks there are, at most max_blocks (counted first: no product that overflows)
    cdef Py_ssize_t count = min((len(data) + block_size - 1) // block_size, max(0, max_blocks))
    cdef Py_ssize_t end = min(len(data), count * block_size), i, offset, length, digits
    cdef unsigned long long prev = start, rest
    cdef unsigned char decimal[20]  # 2**64 - 1 has 20 digits
    cdef unsigned char *buffer = <unsigned char *>malloc(20 + block_size)
    out = np.empty(count, dtype=np.int64)
    cdef int64_t[::1] keys = out
    if buffer == NULL:
        raise MemoryError()
    try:
        for i in range(count):
            digits = 20
            rest = prev
            while True:
                digits -= 1
                decimal[digits] = 48 + rest % 10  # b"0" + the digit
                rest //= 10
                if rest == 0:
                    break
            memcpy(buffer, decimal + digits, 20 - digits)
            offset = i * block_size
            length = min(block_size, end - offset)
            memcpy(buffer + 20 - digits, source + offset, length)
            prev = XXH64(buffer, 20 - digits + length, 0)
            keys[i] = <int64_t>prev
    finally:
        free(buffer)
    return out


KERNELS = Kernels(held_lengths, arriving_blocks, rank_few, rank_best, ttft_costs, put_all,
                  chain_xxh3, chain_xxh64, evict_oldest)
