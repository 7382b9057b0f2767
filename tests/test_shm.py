"""A shared-memory segment its creator fills at once (a CPU card's expert pool) takes its pages when created
(stratad/shm.py, reserve): a segment is sparse until written, and a /dev/shm with no room for a page when a process
first writes it kills that process with SIGBUS. Reserved, no room is an OSError naming the segment at creation,
and nothing is left behind; unreserved (the host conversation cache), pages are taken as written."""
from __future__ import annotations

import errno
import os

import pytest

from stratad import shm


@pytest.fixture
def name(tmp_path):
    n = shm.prefix_for(tmp_path) + "test"
    yield n
    shm.unlink(n)


def test_a_reserved_segment_holds_its_pages_an_unreserved_one_none(name):
    size = 8 * 2**20
    seg = shm.Segment(name, size, create=True, reserve=True)
    try:
        assert os.stat(shm.SHM_DIR / name.lstrip("/")).st_blocks * 512 >= size  # allocated, not a hole
        assert seg.size == size
    finally:
        seg.close()
    seg = shm.Segment(name, size, create=True)
    try:
        assert os.stat(shm.SHM_DIR / name.lstrip("/")).st_blocks == 0
    finally:
        seg.close()
    assert not (shm.SHM_DIR / name.lstrip("/")).exists()


def test_no_room_is_an_error_naming_the_segment_and_leaves_nothing(name, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    with pytest.raises(OSError) as e:
        shm.Segment(name, 2**30, create=True, reserve=True)
    assert e.value.errno == errno.ENOSPC
    assert f"no room for 1024.0 MiB more (segment {name}): No space left on device" in str(e.value)
    assert not (shm.SHM_DIR / name.lstrip("/")).exists()
