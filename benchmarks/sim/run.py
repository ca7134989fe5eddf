"""Simulated dynamic rematerialization on the DTR logs and on synthetic chains; see README.md.

    .venv/bin/python benchmarks/sim/run.py [--logs DIR] [--out DIR] [--no-100k] [--only SECTION,...]

Prints markdown tables and writes ``results.json``, ``sweep.png``, ``swap.png`` and ``scaling.png`` to
``--out``. ``--only`` runs some of the sections (paper, sweep, swap, timing, ablation, scaling); the
others keep their records in ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np

from remat import Link
from remat.sim import SimResult, simulate, sweep
from remat.sim.plot import plot_sweep
from remat.sim.synthetic import training_step
from remat.trace import load
from remat.trace.types import Trace

HERE = Path(__file__).parent
LOGS = ("resnet32-56", "transformer-10", "lstm-128")
PAPER = {
    "resnet32-56": (1.18, 1.11, 1.02),
    "transformer-10": (1.12, 1.06, 1.02),
    "lstm-128": (1.30, 1.07, 1.03),
}
RATIOS = [round(0.2 + 0.1 * i, 1) for i in range(8)]
POLICIES = ["dtr", "dte", "coop", "coop-per-byte", "coop-total"]
ABLATION = [
    "coop",
    "coop-total",
    "coop-no-layout",
    "coop-no-opguided",
    "coop-no-inplace",
    "coop-per-byte",
    "coop-exact",
    "dtr-eq",
]


def cell(r: SimResult, field: str) -> str:
    if r.outcome.value == "oom":
        return "OOM"
    if r.outcome.value == "thrashed":
        return ">2 (thrashed)" if field == "overhead" else "-"
    return f"{r.overhead:.3f}" if field == "overhead" else f"{100 * r.fragmentation:.1f}%"


def table(results: list[SimResult], field: str) -> str:
    lines = ["| trace | policy | " + " | ".join(f"{x:.1f}" for x in RATIOS) + " |"]
    lines.append("|---|---|" + "---:|" * len(RATIOS))
    for trace in LOGS:
        for policy in POLICIES:
            row = [r for r in results if r.trace == trace and r.policy == policy]
            lines.append(f"| {trace} | {policy} | " + " | ".join(cell(r, field) for r in row) + " |")
    return "\n".join(lines)


Records = list[dict[str, object]]
SECTIONS = ("paper", "sweep", "swap", "timing", "ablation", "scaling")
SWAPPED = ["dtr", "dte", "coop"]
LINKS = ("8GB/s", "25GB/s", "64GB/s")


def swap_table(results: list[SimResult]) -> str:
    """Overhead; swaps / recomputations, per trace, policy and link (no link: recomputation only)."""
    lines = ["| trace | policy | link | " + " | ".join(f"{x:.1f}" for x in RATIOS) + " |"]
    lines.append("|---|---|---|" + "---:|" * len(RATIOS))
    for trace in LOGS:
        for policy in SWAPPED:
            for link in ["", *LINKS]:
                row = [
                    r
                    for r in results
                    if r.trace == trace
                    and r.policy == policy
                    and (r.link != "") == (link != "")
                    and (not link or r.link == str(Link(link, link)))
                ]
                cells = [
                    cell(r, "overhead") + (f"; {r.swaps}/{r.recomputations}" if r.link and r.swaps else "")
                    for r in row
                ]
                lines.append(f"| {trace} | {policy} | {link or '-'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--logs", default=str(Path(__file__).resolve().parents[2] / "data" / "dtr"))
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument(
        "--no-100k", action="store_true", help="skip the 100k-tensor chain (minutes per policy)"
    )
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    args = parser.parse_args()
    only = set(args.only.split(","))
    if only - set(SECTIONS):
        parser.error(f"unknown sections {sorted(only - set(SECTIONS))}; choose among {', '.join(SECTIONS)}")
    out = Path(args.out)
    machine = platform.processor() or platform.machine()
    print(f"python {platform.python_version()}, numpy {np.__version__}, {machine}")
    traces = [load(Path(args.logs) / f"{name}.log") for name in LOGS]
    kept = out / "results.json"  # the sections not run keep their records
    records: dict[str, Records] = json.loads(kept.read_text()) if kept.exists() else {}
    if "paper" in only:
        records["paper"] = paper(traces)
    if "sweep" in only or "swap" in only:
        results = sweep(traces, POLICIES, RATIOS)
        records["sweep"] = [r.to_dict() for r in results]
        print(f"\n## Overhead, address pool\n\n{table(results, 'overhead')}")
        print("\n## Fragmentation (mean free bytes / budget when an evicting allocation succeeded)\n")
        print(table(results, "fragmentation"))
        plot_sweep(results, out / "sweep.png")
    if "swap" in only:
        records["swap"] = swapping(traces, results, out)
    if "timing" in only:
        records["timing"] = timing(Path(args.logs))
    if "ablation" in only:
        records["ablation"] = ablation(traces)
    if "scaling" in only:
        records["scaling"] = scaling(args.no_100k, out)
    kept.write_text(json.dumps(records, indent=1, default=lambda x: None if math.isnan(x) else x))


def paper(traces: list[Trace]) -> Records:
    print("\n## DTR with byte counting against the DTR paper (ratios 0.3 / 0.5 / 0.8)\n")
    print("| trace | paper | remat `dtr` (bytes) | remat `dtr` (addresses) |\n|---|---|---|---|")
    repro = []
    for trace in traces:
        counted = [simulate(trace, r, "dtr", layout=False) for r in (0.3, 0.5, 0.8)]
        addressed = [simulate(trace, r, "dtr", layout=True) for r in (0.3, 0.5, 0.8)]
        repro += counted + addressed
        paper = " / ".join(f"{x:.2f}" for x in PAPER[trace.name])
        ours = " / ".join(f"{r.overhead:.3f}" for r in counted)
        addr = " / ".join(f"{r.overhead:.3f}" for r in addressed)
        print(f"| {trace.name} | {paper} | {ours} | {addr} |")
    return [r.to_dict() for r in repro]


def swapping(traces: list[Trace], results: list[SimResult], out: Path) -> Records:
    swapped = [r for r in results if r.policy in SWAPPED]
    for rate in LINKS:
        swapped += sweep(traces, SWAPPED, RATIOS, link=Link(rate, rate))
    print(f"\n## Swapping victims to the host (overhead; swaps/recomputations)\n\n{swap_table(swapped)}")
    plot_sweep(
        [r for r in swapped if not r.link or r.link == str(Link("25GB/s", "25GB/s"))], out / "swap.png"
    )
    return [r.to_dict() for r in swapped if r.link]


def timing(logs: Path) -> Records:
    """CPU seconds of this process as well as wall seconds: the machine is shared, and CPU time is
    what the sweep costs when it has a core to itself."""
    print("\n## One log, eight ratios: seconds, load included, one process (wall / CPU)\n")
    print("| trace | load | dtr-eq | dte | coop | dtr-eq + dte + coop, with load | exact dtr |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    records: Records = []
    for name in LOGS:
        wall, cpu = time.perf_counter(), time.process_time()
        fresh = load(logs / f"{name}.log")  # a new object: nothing cached from above
        seconds = {"load": time.perf_counter() - wall, "load_cpu": time.process_time() - cpu}
        for policy in ("dtr-eq", "dte", "coop", "dtr"):
            wall, cpu = time.perf_counter(), time.process_time()
            sweep([fresh], [policy], RATIOS)
            seconds[policy], seconds[f"{policy}_cpu"] = time.perf_counter() - wall, time.process_time() - cpu
        records.append({"trace": name, **seconds})
        parts = ("load", "dtr-eq", "dte", "coop")
        shown = [f"{seconds[k]:.1f} / {seconds[k + '_cpu']:.1f}" for k in parts]
        three = sum(seconds[k] for k in parts), sum(seconds[k + "_cpu"] for k in parts)
        shown += [f"{three[0]:.1f} / {three[1]:.1f}", f"{seconds['dtr']:.1f} / {seconds['dtr_cpu']:.1f}"]
        print(f"| {name} | " + " | ".join(shown) + " |", flush=True)
    return records


def ablation(traces: list[Trace]) -> Records:
    print("\n## Coop ablation (overhead; fragmentation)\n")
    print("| trace | ratio | " + " | ".join(ABLATION) + " |\n|---|---|" + "---|" * len(ABLATION))
    results = []
    for trace in traces:
        for ratio in (0.3, 0.5, 0.7):
            row = [simulate(trace, ratio, policy) for policy in ABLATION]
            results += row
            cells = " | ".join(f"{cell(r, 'overhead')}; {cell(r, 'fragmentation')}" for r in row)
            print(f"| {trace.name} | {ratio} | {cells} |", flush=True)
    return [r.to_dict() for r in results]


def scaling(no_100k: bool, out: Path) -> Records:
    print("\n## Search time against the number of tensors (synthetic chains, ratio 0.5)\n")
    print(
        "| tensors | policy | overhead | evicting allocations | search per allocation | total search | run |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    results = []
    for layers in (170, 1700) if no_100k else (170, 1700, 17000):
        chain = training_step(layers)
        for policy in ["dtr", "dtr-eq", "dte", "coop"]:
            start = time.perf_counter()
            r = simulate(chain, 0.5, policy)
            run = time.perf_counter() - start
            results.append(r)
            print(
                f"| {r.tensors} | {policy} | {r.overhead:.3f} | {r.evicting_allocations} | "
                f"{1e3 * r.search_per_allocation:.3f} ms | {r.search_seconds:.2f} s | {run:.1f} s |",
                flush=True,
            )
    plot_sweep(results, out / "scaling.png")
    return [r.to_dict() for r in results]


if __name__ == "__main__":
    main()
