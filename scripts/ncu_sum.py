"""Sum Nsight Compute's per-kernel durations (a `--csv --page raw` log with gpu__time_duration.sum) by kernel name:
launches, mean and total microseconds, largest total first; the total over all is what those launches cost run
one at a time (no overlap between kernels, no launch gaps)."""
from __future__ import annotations

import csv
import io
import sys
from collections import defaultdict


def main(path: str) -> None:
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, ln in enumerate(lines) if '"Kernel Name"' in ln), None)
    if start is None:
        print(f"{path}: no kernel rows (ncu failed?)")
        return
    rows = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}
    unit, tot, n = "nsecond", defaultdict(float), defaultdict(int)
    for r in rows:
        v = (r.get("gpu__time_duration.sum") or "").replace(",", "")
        try:
            t = float(v)
        except ValueError:
            unit = v or unit  # the units row
            continue
        name = r["Kernel Name"].split("(")[0]
        tot[name] += t * scale.get(unit, 1e-3)
        n[name] += 1
    all_us = sum(tot.values())
    print(f"{sum(n.values())} launches, {all_us:.1f} us run one at a time")
    for name in sorted(tot, key=tot.get, reverse=True):
        print(f"{tot[name]:10.1f} us {100 * tot[name] / all_us:5.1f}% {n[name]:5d} x {tot[name] / n[name]:7.2f} us  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
