# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=False
"""The kernels compiled: the same functions as ``pure.py``, one C loop each."""

from libc.stdint cimport int64_t

from extproc.kernels.pure import Kernels


cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil  # GCC and Clang: the lowest set bit


def deepest_held(const int64_t[:, ::1] masks, const int64_t[::1] first_slots,
                 const int64_t[::1] places, int64_t[::1] out):
    """``pure.deepest_held``: each page's blocks walked last to first until every slot
    is found."""
    cdef Py_ssize_t page, i
    cdef int64_t seen, new, place
    for page in range(masks.shape[0]):
        seen = 0
        i = masks.shape[1] - 1
        while i >= 0:
            new = masks[page, i] & ~seen
            if new:
                seen |= new
                while new:
                    place = places[first_slots[page] + __builtin_ctzll(<unsigned long long>new)]
                    new &= new - 1
                    if place >= 0:
                        out[place] = i + 1
            i -= 1


KERNELS = Kernels(deepest_held)
