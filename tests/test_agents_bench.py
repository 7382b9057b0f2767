"""`stratad bench --scenario agents` end to end on two CPU cards at small sizes (figures are measured, not
asserted: only what the run must show)."""
from __future__ import annotations

import json
import subprocess
import sys


def test_agents_bench_tiny(tiny_model_path, tmp_path):
    out = tmp_path / "agents.json"
    r = subprocess.run([sys.executable, "-m", "stratad.cli", "bench", "--scenario", "agents", "--model",
                        str(tiny_model_path), "--history", "160", "--turns", "1", "--new-tokens", "16",
                        "--kv-cache-host", "8MiB", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["scenario"] == "agents" and d["hardware"]["cores"] >= 1
    turns = d["turns"]
    assert len(turns["with_cache"]) == len(turns["without_cache"]) == 3 and len(turns["kept_on_lane"]) == 1
    # with the cache every follow-up starts from the history (whole blocks of it); without, the conversation
    # that lost its lane to the third reads everything again
    assert all(t["cached_tokens"] >= 160 for t in turns["with_cache"])
    assert any(t["cached_tokens"] == 0 for t in turns["without_cache"])
    k = d["kv_cache"]
    assert k["hits"] >= 1 and k["tokens_served"] >= 160 and k["bytes_limit"] <= 8 << 20
    assert set(d["median_follow_up_ttft_s"]) == {"with_cache", "without_cache", "kept_on_lane"}
    assert d["speedup"] > 0 and d["fraction"] > 0
