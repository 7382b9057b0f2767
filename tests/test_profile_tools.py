"""The device scripts' arithmetic that runs on the host (no GPU): the decode timeline's critical path."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from gpu_decode_profile import step_stats  # noqa: E402


def test_step_stats_critical_path_lead_and_busy_time():
    """Two steps of kernel records (ns): a kernel's path is its end past the latest end before it, its lead how
    long before that end it started (PDL); a gap with no kernel running is in the span, not in the busy time."""
    recs = [(0, 1000, "embed_rows"), (500, 4000, "a"), (3000, 5000, "b"), (6000, 7000, "b"),  # idle 5000-6000
            (10000, 10500, "embed_rows"), (10200, 12500, "a"), (12500, 13000, "b")]
    st = step_stats(sorted(recs), {"a": {"blocks": 7, "smem": 100}})
    assert st["steps"] == 2
    assert st["span_ms"] == pytest.approx((7000 + 3000) / 2 / 1e6)
    assert st["busy_ms"] == pytest.approx((6000 + 3000) / 2 / 1e6)
    a, b, e = st["kernels"]["a"], st["kernels"]["b"], st["kernels"]["embed_rows"]
    assert a["path_us"] == pytest.approx((3.0 + 2.0) / 2) and a["lead_us"] == pytest.approx((0.5 + 0.3) / 2)
    assert b["path_us"] == pytest.approx((1.0 + 2.0 + 0.5) / 2) and b["lead_us"] == pytest.approx(1.0 / 2)
    assert b["launches"] == 1.5 and e["path_us"] == pytest.approx(0.75) and a["blocks"] == 7
    assert sum(k["path_us"] for k in st["kernels"].values()) == pytest.approx(st["span_ms"] * 1e3)
    assert list(st["kernels"])[0] == "a"  # by path, longest first
    with pytest.raises(RuntimeError, match="no decode step"):
        step_stats([(0, 5, "a")], {})
