"""Print the README's tables from what run.py and peers.py wrote.

.venv/bin/python benchmarks/plan/tables.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
EAGER = {"plain": "eager, plain", "checkpoint": "eager, `torch.utils.checkpoint` per block"}
NAMES = {
    "bert": "BERT-Base",
    "gpt2": "GPT-2 small",
    "resnet50": "ResNet-50",
    "unet": "U-Net",
    "gpt2-tiny": "GPT-2, tiny (2 layers, width 32)",
    "bert-tiny": "BERT, tiny (2 layers, width 32)",
}


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
        both = "executor_cost" in m  # predicted with and without the executor's own cost
        if both:
            figures = ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in m["executor_cost"].items())
            print(f"Executor cost per op (offload: per tensor), calibrated in the run: {figures}\n")
        extra = " predicted overhead, kernels only | error |" if both else ""
        print(
            "| strategy | budget | predicted peak | measured peak (ratio) | error |"
            f"{extra} predicted overhead | measured overhead | error | solve time |"
        )
        print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if both else ""))
        for r in rows:
            measured = f"{_mib(r['measured_peak'])} ({r['peak_ratio']:.2f})"
            if "budget" not in r:
                blank = " | |" if both else ""
                print(f"| {r['strategy']} | | | {measured} | |{blank} | {r['measured_overhead']:.3f} | | |")
                continue
            regions = f"remat.plan, {r['regions']} region{'s' if r['regions'] != 1 else ''}"
            if r["strategy"].endswith("kernels-only model"):
                regions += " (kernels-only model's pick)"
            before = f" {r['predicted_kernels_only']:.3f} | {_pct(r['kernels_only_error'])} |" if both else ""
            print(
                f"| {regions} | {_mib(r['budget'])} | {_mib(r['predicted_peak'])} | {measured} "
                f"| {_pct(r['peak_error'])} |{before} {r['predicted_overhead']:.3f} "
                f"| {r['measured_overhead']:.3f} | {_pct(r['overhead_error'])} | {r['plan_seconds']:.2f} s |"
            )
        print()


def peers(path: Path) -> None:
    data = json.loads(path.read_text())
    sizes = " × ".join(f"{k} {v}" for k, v in data["sizes"].items())
    print(f"### {NAMES.get(data['model'], data['model'])}, {sizes}; {data['rounds']} rounds\n")
    print(
        "| strategy (one process, interleaved) | peak (allocator) | predicted peak | predicted overhead "
        "| CPU s / step | overhead vs own twin: median (range over rounds) | time ÷ eager plain |"
    )
    print("|---|---|---|---|---|---|---|")
    plain = next(r for r in data["rows"] if r["strategy"] == "plain")
    for r in data["rows"]:
        name = r["strategy"]
        if name.startswith("compile "):
            what = f"`torch.compile`, budget {name.split()[1]}"
        elif name.startswith("plan at "):
            what = "remat.plan at the peak of " + name.removeprefix("plan at ").replace(
                "checkpoint", "per-block checkpoint"
            )
        else:
            what = EAGER[name]
        predicted = ("", "")
        if "predicted_peak" in r:
            predicted = (_mib(r["predicted_peak"]), f"{r['predicted_overhead']:.3f}")
        spread = f"{min(r['overheads']):.2f}–{max(r['overheads']):.2f}"
        if "seconds" in r:  # per round, against the eager plain step of that round
            absolute = statistics.median(t / u for t, u in zip(r["seconds"], plain["seconds"], strict=True))
        else:
            absolute = r["cpu_seconds"] / plain["cpu_seconds"]
        print(
            f"| {what} | {_mib(r['peak'])} | {predicted[0]} | {predicted[1]} | {r['cpu_seconds']:.2f} "
            f"| {r['overhead']:.2f} ({spread}) | {absolute:.2f} |"
        )
    for r in data["refused"]:
        print(
            f"| remat.plan at the peak of {r['matched']} | refused: below its smallest plan, "
            f"{_mib(r['minimum'])} | | | | | |"
        )
    print()


def main() -> None:
    accuracy(json.loads((HERE / "results.json").read_text()))
    for path in sorted(HERE.glob("results_executor*.json")):  # with and without the executor's cost
        accuracy(json.loads(path.read_text()))
    for path in sorted(HERE.glob("peers_*.json")):
        peers(path)


if __name__ == "__main__":
    main()
