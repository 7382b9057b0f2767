#!/usr/bin/env python3
"""Markdown tables from `stratad bench --json` files (engine or seed), for README.md and the perf notes.

    python3 scripts/bench_table.py docs/bench/2026-12-02-h200-engine-a3b-iq3s.json [more.json ...]
    python3 scripts/bench_table.py --ab OUT/ab-*.json   # device_run.sh ab: decode tok/s by tree and context
    python3 scripts/bench_table.py --experts OUT/experts-*.json   # device_run.sh experts-ab: kernel us by tree
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


def tree_docs(paths: list[str], prefix: str) -> dict[str, list[dict]]:
    """device_run.sh's per-tree files PREFIX-TREE-ROUND.json (TREE: this, env, ab1, ab2, ..) -> tree -> documents."""
    docs: dict[str, list[dict]] = {}
    for p in paths:
        m = re.fullmatch(rf"{prefix}-(.+)-(\d+)\.json", Path(p).name)
        if not m:
            raise SystemExit(f"{p}: not a {prefix}-TREE-ROUND.json file")
        docs.setdefault(m.group(1), []).append(json.loads(Path(p).read_text()))
    return docs


def tree_order(trees, first: str = "") -> list[str]:
    """`first` (if present), then ab1, ab2, .., then this tree with AB_ENVS' sets (env1, env2, ..), then this tree."""
    return sorted(trees, key=lambda t: (-1, 0, t) if t == first else (0, int(t[2:]), t)
                  if t[:2] == "ab" and t[2:].isdigit() else (1 if t.startswith("env") else 2, 0, t))


def delta(v: float, base: float) -> str:
    return f" {v / base - 1:+.1%}" if base else ""


def ab_rows(paths: list[str]) -> list[str]:
    """device_run.sh ab's runs (ab-TREE-ROUND.json): each tree's decode tok/s a context (the rounds' median, then
    each round's), and its change against the first tree (ab1, else this tree with AB_ENV: the base)."""
    runs: dict[str, dict[int, list[float]]] = {}
    for tree, docs in tree_docs(paths, "ab").items():
        for d in docs:
            for r in d["results"]:
                runs.setdefault(tree, {}).setdefault(r["context"], []).append(r["decode_tok_s"])
    trees = tree_order(runs)
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
            d = delta(med, base[c]) if t != trees[0] else ""
            cells.append(f"{med:.1f}{d} ({' / '.join(f'{x:.1f}' for x in v)})")
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    return out


def experts_rows(paths: list[str]) -> list[str]:
    """device_run.sh experts-ab's runs (experts-TREE-ROUND.json, gpu_experts_bench's default variant): each tree's
    gate/up and down us at 8 pairs (down also with the decode step's combine, where the run has decode8c) and the
    pair of launches at 8 tokens x 8 (median of every repetition of every round), and the change against this tree
    (the checkout, e.g. main; else ab1)."""
    cols = (("decode8", "us_gate_up", "8 pairs gate/up"), ("decode8", "us_down", "8 pairs down"),
            ("decode8c", "us_down", "8 pairs down + combine"), ("decode8", "us_run", "8 pairs both"),
            ("tok8x8", "us_run", "8x8 both"))
    vals: dict[str, list[float | None]] = {}
    for tree, docs in tree_docs(paths, "experts").items():
        vals[tree] = []
        for case, key, _ in cols:
            xs = [x for d in docs for r in d["results"] if r["variant"] == "default"
                  for x in r["cases"].get(case, {}).get(key, [])]
            vals[tree].append(statistics.median(xs) if xs else None)
    trees = tree_order(vals, first="this")
    out = ["| tree | " + " | ".join(f"{name} us" for _, _, name in cols) + " |", "|---|" + "---|" * len(cols)]
    for t in trees:
        out.append(f"| {t} | " + " | ".join("-" if v is None else f"{v:.2f}{delta(v, b) if t != trees[0] and b else ''}"
                                            for v, b in zip(vals[t], vals[trees[0]])) + " |")
    return out


def main(paths: list[str]) -> int:
    if paths[:1] in (["--ab"], ["--experts"]):
        print("\n".join((ab_rows if paths[0] == "--ab" else experts_rows)(paths[1:])))
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
