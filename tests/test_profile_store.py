"""The saved expert profile (coordinator/profile_store.py) is a cache: a file damaged anywhere (bit rot, a copy cut
short, another program's .npy) is ignored with a warning, whatever numpy's reader raises on it, and the daemon
starts from its routing warm-up instead of failing."""
from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import profile_store

SHAPE = (4, 16)


def saved(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


GOOD = saved(np.full(SHAPE, 1 / 64))


def test_a_good_profile_loads(tmp_path):
    p = tmp_path / "profile.npy"
    profile_store.save(p, np.full(SHAPE, 1 / 64))
    assert np.array_equal(profile_store.load(p, SHAPE), np.full(SHAPE, 1 / 64))


@pytest.mark.parametrize("data", [b"", GOOD[:10], GOOD[:60], GOOD[:-8], GOOD.replace(b"'descr'", b"'descr"),
                                  GOOD.replace(b"}", b"{"), saved(np.full(SHAPE, "x")), saved(np.full(SHAPE, -1.0)),
                                  saved(np.full(SHAPE, np.nan)), saved(np.ones((2, 3)))],
                         ids=["empty", "magic", "header cut", "data cut", "quote", "brace", "strings", "negative",
                              "nan", "shape"])
def test_a_damaged_profile_is_ignored(tmp_path, caplog, data):
    p = tmp_path / "profile.npy"
    p.write_bytes(data)
    assert profile_store.load(p, SHAPE) is None
    assert "starting without it" in caplog.text


@settings(max_examples=300, deadline=None, database=None)
@given(edits=st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.binary(min_size=1, max_size=4)), min_size=1,
                      max_size=3))
def test_any_damage_gives_the_profile_or_none(tmp_path_factory, edits):
    b = bytearray(GOOD)
    for at, new in edits:
        b[at:at + len(new)] = new
    p = tmp_path_factory.mktemp("prof") / "profile.npy"
    p.write_bytes(bytes(b))
    got = profile_store.load(p, SHAPE)
    assert got is None or (got.shape == SHAPE and got.dtype == np.float64)
