"""Where a kernel's warps wait, instruction by instruction: Nsight Compute's source page (`ncu --import REP --page
source --print-source sass --csv`, collected with the WarpStateStats and SourceCounters sections) summed by opcode
and listed by the instructions holding the most stall samples."""
from __future__ import annotations

import csv
import io
import sys
from collections import defaultdict


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def source_rows(path: str) -> list[dict] | None:
    """The report's source table, a dict a SASS instruction (None: the file has none)."""
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, ln in enumerate(lines) if '"Source"' in ln or ln.startswith("Source,") or
                  '"# Address"' in ln or '"Address"' in ln), None)
    return None if start is None else list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def main(path: str, top: int = 20) -> None:
    rows = source_rows(path)
    if rows is None:
        print(f"{path}: no source table")
        return
    cols = rows[0].keys() if rows else []
    samp = next((c for c in cols if "Stall Sampling (All" in c), None) or \
        next((c for c in cols if "Sampling" in c), None)
    execd = next((c for c in cols if c.startswith("Instructions Executed")), None)
    if samp is None:
        print(f"{path}: no stall sampling column in {list(cols)[:12]}")
        return
    total = sum(_num(r[samp]) for r in rows) or 1.0
    by_op, ins = defaultdict(float), defaultdict(float)
    for r in rows:
        op = (r.get("Source") or "").split()
        op = next((t for t in op if not t.startswith("@")), "?").split(".")[0]
        by_op[op] += _num(r[samp])
        ins[op] += _num(r[execd]) if execd else 0.0
    print(f"{path}: {len(rows)} SASS lines, {int(total)} stall samples")
    print("by opcode: " + ", ".join(f"{op} {100 * s / total:.1f}%" for op, s in
                                    sorted(by_op.items(), key=lambda x: -x[1])[:12]))
    print(f"top {top} instructions (share of samples, executed, SASS):")
    for r in sorted(rows, key=lambda r: -_num(r[samp]))[:top]:
        addr = r.get("# Address") or r.get("Address") or ""
        print(f"  {100 * _num(r[samp]) / total:5.1f}% {int(_num(r[execd])) if execd else 0:9d}  {addr:>6}  "
              f"{(r.get('Source') or '').strip()[:90]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20)
