#!/usr/bin/env python3
"""Markdown tables from `stratad bench --json` files (engine or seed), for README.md and the perf notes.

    python3 scripts/bench_table.py docs/bench/2026-12-02-h200-engine-a3b-iq3s.json [more.json ...]
    python3 scripts/bench_table.py --ab OUT/ab-*.json   # device_run.sh ab: decode tok/s by tree and context
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def engine_rows(d: dict) -> list[str]:
    """The README's engine table; columns a run did not record (older JSON) read as -."""
    def col(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"

    out = ["| experts on the card | context | decode tok/s | floor tok/s | of floor | prefill tok/s | "
           "prefill of floor | TTFT s | next turn TTFT s (fresh read) | on the card | CPU GB/s | bus GB/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        turn = f"{col(r, 'next_turn_ttft_s', '.2f')} ({col(r, 'next_turn_ttft_fresh_s', '.1f')})"
        out.append(f"| {r['cache_fraction']:.0%} | {r['context'] // 1024}K | {r['decode_tok_s']:.0f} | "
                   f"{r['floor_tok_s']:.0f} | {r['fraction_of_floor']:.0%} | {r['prefill_tok_s']:.0f} | "
                   f"{col(r, 'prefill_fraction_of_floor', '.0%')} | {r['ttft_s']:.2f} | {turn} | "
                   f"{r['hit_rate']:.0%} | {col(r, 'cpu_expert_gb_s', '.1f')} | {col(r, 'bus_expert_gb_s', '.1f')} |")
    return out


def seed_rows(d: dict) -> list[str]:
    out = [f"{d['cards']}, {d['cache_fraction_per_card']:.1%} of the experts per card, {d['prompt_tokens']}-token "
           f"prompts ({d.get('note', 'one card per device')})", "",
           "| mode | chat | on some card | own / peer / CPU | decode tok/s | TTFT s |", "|---|---|---|---|---|---|"]
    for mode, chats in d["modes"].items():
        for c in chats:
            out.append(f"| {mode} | {c['topic']} | {c['share_some_card']:.3f} | {c['share_own_card']:.2f} / "
                       f"{c['share_peer']:.2f} / {c['share_cpu']:.3f} | {c['decode_tok_s']:.1f} | {c['ttft_s']:.2f} |")
    return out


def ab_rows(paths: list[str]) -> list[str]:
    """device_run.sh ab's runs (ab-TREE-ROUND.json): each tree's decode tok/s a context (the rounds' median, then
    each round's), and its change against the first tree (ab1, else this tree with AB_ENV: the base)."""
    runs: dict[str, dict[int, list[float]]] = {}
    for p in paths:
        m = re.fullmatch(r"ab-(.+)-(\d+)\.json", Path(p).name)
        if not m:
            raise SystemExit(f"{p}: not an ab-TREE-ROUND.json file")
        for r in json.loads(Path(p).read_text())["results"]:
            runs.setdefault(m.group(1), {}).setdefault(r["context"], []).append(r["decode_tok_s"])
    # ab1, ab2, .. (ab1: the base), then this tree with AB_ENV set ("env"), then this tree
    trees = sorted(runs, key=lambda t: (0, int(t[2:]), t) if t[:2] == "ab" and t[2:].isdigit()
                   else (1 if t == "env" else 2, 0, t))
    contexts = sorted({c for t in runs.values() for c in t})
    base = {c: statistics.median(runs[trees[0]].get(c, [0])) for c in contexts}
    out = ["| tree | " + " | ".join(f"{c // 1024}K decode tok/s (runs)" for c in contexts) + " |",
           "|---|" + "---|" * len(contexts)]
    for t in trees:
        cells = []
        for c in contexts:
            v = runs[t].get(c)
            if not v:
                cells.append("-")
                continue
            med = statistics.median(v)
            delta = f" {med / base[c] - 1:+.1%}" if base[c] and t != trees[0] else ""
            cells.append(f"{med:.1f}{delta} ({' / '.join(f'{x:.1f}' for x in v)})")
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    return out


def main(paths: list[str]) -> int:
    if paths[:1] == ["--ab"]:
        print("\n".join(ab_rows(paths[1:])))
        return 0
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        hw = d.get("hardware", {})
        print(f"{p}: {d.get('date', '?')}, {hw.get('device', hw.get('cpu', '?'))}")
        print("\n".join(engine_rows(d) if d["scenario"] == "engine" else seed_rows(d)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
