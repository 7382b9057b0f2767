"""Open time and resident memory of a full-size model file, and the coordinator's start work on it, without the
disk for one: `--preset a235b` is ~100 GB of IQ3_S experts, so the file is written sparse (metadata, tokenizer
and tensor table real, every tensor's bytes a hole that reads as zeros: stratad.model.sparse), optionally as
llama.cpp split shards. tests/test_model_open_scale.py (slow) asserts the open's bounds on the same file.

    .venv/bin/python scripts/model_open_bench.py --preset a235b --dir /work/tmp-a235b [--split-max-size 50000000000]

Prints JSON: the file size, then, measured in a fresh process, ModelFile's open (seconds, resident memory before
and after: the mapping is not read), the header hash, the tokenizer, the slot size and the card pool's first
placement (CardPool construction with every lane ready), i.e. what the coordinator does before its lanes start.
The zeros are no model to serve: the lanes' start (which reads weights) is not part of this.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from stratad.model.config import PRESETS  # noqa: E402
from stratad.model.sparse import resident_bytes, write_sparse  # noqa: E402


def rss_mb() -> float:
    return resident_bytes() / 2**20


def measure(path: str, n_cards: int) -> dict:
    from coordinator.pool import CardPool
    from stratad.model.gguf_file import ModelFile
    from stratad.model.slot_layout import slot_bytes

    out = {"rss_before_mb": round(rss_mb(), 1)}
    t0 = time.perf_counter()
    m = ModelFile(path)
    out["open_s"] = round(time.perf_counter() - t0, 3)
    out["rss_after_open_mb"] = round(rss_mb(), 1)
    out["mapped_gb"] = round(m.mapping.nbytes / 1e9, 2)
    out["shards"] = len(m.shards)
    t0 = time.perf_counter()
    _ = m.header_hash
    out["header_hash_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    _ = m.tokenizer
    out["tokenizer_s"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    sb = slot_bytes(m)
    out["slot_bytes"] = sb
    out["slot_bytes_s"] = round(time.perf_counter() - t0, 3)
    c = m.config
    shape = (c.n_layer, c.n_expert)

    class Ready:
        pool, device, slots_total = "pool", "cpu", 1 << 30

    t0 = time.perf_counter()
    pool = CardPool([c.n_layer * c.n_expert // n_cards] * n_cards, shape, np.ones(shape), "/stratad-bench-none-",
                    lambda lane, msg: True, mutual_help=True, rejoin_idle_s=30, replan_interval_s=2, replan_min_gain=0.02)
    for i in range(n_cards):
        pool.lane_ready(i, False, Ready)
    out["card_pool_s"] = round(time.perf_counter() - t0, 3)
    out["rss_end_mb"] = round(rss_mb(), 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="a235b", choices=sorted(PRESETS))
    ap.add_argument("--expert-quant", default="IQ3_S")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--split-max-size", type=int, default=0)
    ap.add_argument("--cards", type=int, default=8)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(measure(a.measure, a.cards)))
        return 0
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    files = write_sparse(d / f"{a.preset}-sparse.gguf", a.preset, a.expert_quant, a.split_max_size)
    rep = {"preset": a.preset, "files": files, "bytes": sum(os.path.getsize(f) for f in files),
           "disk_bytes": sum(os.stat(f).st_blocks * 512 for f in files), "write_s": round(time.perf_counter() - t0, 2)}
    r = subprocess.run([sys.executable, __file__, "--dir", a.dir, "--cards", str(a.cards), "--measure", files[0]],
                       capture_output=True, text=True, check=True)
    rep |= json.loads(r.stdout)
    print(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
