"""Print the README's tables from what run.py and peers.py wrote.

.venv/bin/python benchmarks/plan/tables.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
EAGER = {"plain": "eager, plain", "checkpoint": "eager, `torch.utils.checkpoint` per block"}
NAMES = {"bert": "BERT-Base", "gpt2": "GPT-2 small", "resnet50": "ResNet-50", "unet": "U-Net"}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %".replace("-", "−")


def accuracy(results: dict[str, Any]) -> None:
    for name, m in results["models"].items():
        rows = m["rows"]
        plain = rows[0]
        sizes = " × ".join(f"{k} {v}" for k, v in m["sizes"].items())
        print(
            f"### {NAMES.get(name, name)}, {sizes}: plain step {plain['plain_cpu_seconds']:.1f} s CPU; "
            f"capture {m['capture_seconds']:.0f} s; smallest plan peak {_mib(m['smallest_plan_peak'])}\n"
        )
        print(
            "| strategy | budget | predicted peak | measured peak (ratio) | error | predicted overhead "
            "| measured overhead | error | solve time |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            measured = f"{_mib(r['measured_peak'])} ({r['peak_ratio']:.2f})"
            if "budget" not in r:
                print(f"| {r['strategy']} | | | {measured} | | | {r['measured_overhead']:.3f} | | |")
                continue
            regions = f"remat.plan, {r['regions']} region{'s' if r['regions'] != 1 else ''}"
            print(
                f"| {regions} | {_mib(r['budget'])} | {_mib(r['predicted_peak'])} | {measured} "
                f"| {_pct(r['peak_error'])} | {r['predicted_overhead']:.3f} | {r['measured_overhead']:.3f} "
                f"| {_pct(r['overhead_error'])} | {r['plan_seconds']:.2f} s |"
            )
        print()


def peers(path: Path) -> None:
    data = json.loads(path.read_text())
    rows = data["rows"]
    plain = next(r for r in rows if r["kind"] == "plain")
    compiled = next((r for r in rows if r["kind"] == "compile" and r.get("budget") == 1.0), None)
    sizes = " × ".join(f"{k} {v}" for k, v in data["sizes"].items())
    print(f"### {NAMES.get(data['model'], data['model'])}, {sizes}\n")
    print("| strategy (one process each) | peak RSS of the step | CPU s / step | overhead vs own twin |")
    print("|---|---|---|---|")
    for r in rows:
        if r["kind"] == "plan":
            what = f"remat.plan at the peak of {r['matched']}"
            if r.get("attempt"):
                what += f", planned lower (try {r['attempt'] + 1})"
            if "the minimum is " in r.get("error", ""):
                minimum = r["error"].split("the minimum is ")[1].split(" bytes")[0]
                print(f"| {what} | refused: below its smallest plan, {_mib(int(minimum))} of tensors | | |")
                continue
            what += f" (predicted {_mib(r['predicted_peak'])} of tensors, {r['predicted_overhead']:.3f})"
            twin = plain
        elif r["kind"] == "compile":
            what, twin = f"`torch.compile`, budget {r['budget']}", compiled or plain
        else:
            what = EAGER[r["kind"]]
            twin = plain
        if "peak_rss" not in r:
            print(f"| {what} | failed: {r.get('error', '')} | | |")
            continue
        overhead = r["cpu_seconds"] / twin["cpu_seconds"]
        print(f"| {what} | {_mib(r['peak_rss'])} | {r['cpu_seconds']:.2f} | {overhead:.2f} |")
    print()


def main() -> None:
    accuracy(json.loads((HERE / "results.json").read_text()))
    for path in sorted(HERE.glob("peers_*.json")):
        peers(path)


if __name__ == "__main__":
    main()
