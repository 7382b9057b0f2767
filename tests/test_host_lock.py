"""Page-locking a host range (lane/host_lock.py) against a stand-in for the CUDA runtime: one registration per
range however many cards use it, mapped where the driver allows, released with the last user, also when a user is
dropped without closing."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from lane import host_lock


class FakeRuntime:
    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, refuse_mapped: bool = False, refuse_all: bool = False):
        self.refuse_mapped, self.refuse_all = refuse_mapped, refuse_all
        self.registered: dict[int, int] = {}

    def hostRegister(self, ptr, nbytes, flags):
        if ptr in self.registered:
            raise self.CUDARuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        if self.refuse_all or (self.refuse_mapped and flags & host_lock.MAPPED):
            raise self.CUDARuntimeError("cudaErrorNotSupported")
        self.registered[ptr] = flags

    def hostUnregister(self, ptr):
        del self.registered[ptr]


class Card:  # a lock's owner
    pass


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(host_lock, "_runtime", lambda: rt)
    return rt


def test_one_registration_for_all_users_released_with_the_last(fake):
    mem = np.zeros(1 << 16, np.uint8)
    a, b = Card(), Card()
    la, lb = host_lock.lock(a, mem), host_lock.lock(b, mem)
    assert la.mapped and lb.mapped and fake.registered == {mem.ctypes.data: host_lock.READ_ONLY | host_lock.MAPPED}
    la.release()
    la.release()  # a second release does nothing
    assert mem.ctypes.data in fake.registered
    del b, lb  # dropped without closing: its finalizer releases
    gc.collect()
    assert fake.registered == {}


def test_copies_only_where_mapping_is_refused(fake):
    fake.refuse_mapped = True
    mem = np.zeros(4096, np.uint8)
    card = Card()
    lk = host_lock.lock(card, mem)
    assert lk is not None and not lk.mapped and fake.registered == {mem.ctypes.data: host_lock.READ_ONLY}
    lk.release()
    assert fake.registered == {}


def test_pageable_when_the_driver_refuses(fake):
    fake.refuse_all = True
    assert host_lock.lock(Card(), np.zeros(4096, np.uint8)) is None and fake.registered == {}
