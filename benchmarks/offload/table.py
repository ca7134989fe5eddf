"""The README's table from the results ``run.py`` wrote.

PYTHONPATH=. .venv/bin/python benchmarks/offload/table.py benchmarks/offload/results_*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def main(paths: list[str]) -> None:
    seen: dict[
        tuple[Any, ...], dict[str, Any]
    ] = {}  # files of partial runs may repeat a row: the first is kept
    for path in paths:
        rows = json.loads(Path(path).read_text())
        if not all("costs" in row and "link_GBps" in row for row in rows):  # gpu.py's rows
            print(f"{path}: not run.py's results (gpu.py's: see the README); skipped", file=sys.stderr)
            continue
        for row in rows:
            seen.setdefault((row["model"], row["costs"], row["fraction"], row["link_GBps"]), row)
    rows = sorted(
        seen.values(),
        key=lambda r: (r["model"], r["costs"] != "measured CPU", -r["fraction"], r["link_GBps"]),
    )
    head = ["model", "op times", "device peak", "link", "recompute-only", "three-way", "less", "to host"]
    print("| " + " | ".join([*head, "stall", "plan"]) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        alone, both = r["recompute_overhead"] - 1, r["three_way_overhead"] - 1
        less = f"{1 - both / alone:.0%}" if alone > 0 else "-"
        cells = [
            r["model"],
            r["costs"],
            f"{r['recompute_peak'] / 2**20:.0f} MiB (f={r['fraction']:g})",
            f"{r['link_GBps']} GB/s",
            f"{alone:+.2%}",
            f"{both:+.2%}",
            less,
            f"{r['three_way_offloaded_bytes'] / 2**20:.0f} MiB",
            f"{r['three_way_stall_s'] * 1e3:.3f} ms",
            r["three_way_solver"],
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
