"""A GPU card's page-locked KV export buffers (lane/export_buffers.py), with host memory standing in for the
page-locked kind: reuse of a buffer that holds the export, rounding to the granule, at most `keep` idle buffers (the
largest), the others freed."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from lane.export_buffers import ExportBuffers

MB = 1 << 20


class Memory(bytearray):
    """bytearray with a weak reference (to see it freed)."""


def keeper(keep=2):
    made = []

    def alloc(n):
        made.append(n)
        return Memory(n)
    return ExportBuffers(alloc, granule=4 * MB, keep=keep), made


def test_a_given_back_buffer_is_taken_again_by_an_export_it_holds():
    b, made = keeper()
    a, give = b.take((3, MB))
    a[:] = 7
    assert made == [4 * MB] and a.shape == (3, MB) and a.dtype == np.uint8
    give()
    give()  # a second call does nothing
    c, give_c = b.take((2, MB))  # smaller: the same buffer
    assert made == [4 * MB] and c[0, 0] == 7
    d, _ = b.take((2, MB))  # the first is taken: a new one
    assert made == [4 * MB, 4 * MB]
    give_c()
    e, _ = b.take((5, MB))  # larger than any idle one: a new one, rounded up to the granule
    assert made == [4 * MB, 4 * MB, 8 * MB] and e.nbytes == 5 * MB


def test_the_smallest_idle_buffer_that_holds_the_export_is_taken():
    b, made = keeper(keep=3)
    gives = [b.take((n, MB))[1] for n in (1, 5, 9)]  # 4, 8 and 12 MB
    for g in gives:
        g()
    x, _ = b.take((6, MB))
    assert x.base is not None and len(x.base) == 8 * MB and b.idle_bytes == 16 * MB and len(made) == 3


def test_at_most_keep_idle_buffers_stay_the_largest_the_others_are_freed():
    b, _ = keeper(keep=2)
    taken = [b.take((n, MB)) for n in (1, 5, 9)]
    refs = [weakref.ref(a.base) for a, _ in taken]
    for a, give in taken:
        del a
        give()
    del taken
    gc.collect()
    assert [r() is None for r in refs] == [True, False, False] and b.idle_bytes == 20 * MB
    with pytest.raises(ValueError):
        ExportBuffers(lambda n: Memory(n), granule=0)
