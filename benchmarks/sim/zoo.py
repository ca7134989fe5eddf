"""DTR, DTE and Coop on the zoo at paper size (fake-traced), with the Coop ablation; see README.md.

    .venv/bin/python benchmarks/sim/zoo.py [--cache DIR] [--out DIR] [--jobs 2] [--only NAME,...]
        [--policies NAME,...] [--no-ablation] [--report-only]

Traces are captured on fake tensors once and cached (``--cache``, default ``benchmarks/sim/traces``,
ignored by git), and so is every finished simulation (``results.jsonl`` there: a rerun resumes).
Fake tensors have no measured times, so every op is priced by the cost model (``Op.est_cost``,
``a100`` profile, fp32). Prints markdown tables and writes ``zoo.json``,
``zoo_overhead.png`` and ``zoo_fragmentation.png`` to ``--out``. Simulations run in ``--jobs``
processes; search times are host seconds and are noisier when jobs share the cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch
from run import ABLATION, POLICIES, RATIOS  # the same sweep as the DTR logs' (this folder's run.py)

from remat import zoo
from remat.sim import Outcome, SimResult, simulate
from remat.trace.capture import capture
from remat.trace.codec import load, save
from remat.trace.types import Op, Trace

HERE = Path(__file__).parent
# Workloads of the ablation, at 0.3 / 0.5 / 0.7 unless listed here. "-sgd": the step ends with
# SGD with momentum, whose in-place updates are where recomputable in-place should matter.
ABLATED = ["gpt2", "gpt2-sgd", "resnet50-sgd", "bert-large", "densenet121", "bilstm"]
# Below 0.7 every variant thrashes on the BiLSTM, and a run that thrashes takes minutes there.
ABLATION_RATIOS = {"bilstm": (0.7, 0.8, 0.9)}


def workload(name: str, cache: Path) -> Trace:
    """The zoo model ``name`` (``-sgd``: with an SGD step) at its paper size, traced on fake tensors
    (cached), with every op's cost set to its estimate."""
    model_name = name.partition("-sgd")[0]
    spec = zoo.get(model_name)
    path = cache / f"{name}-b{spec.batch}-{spec.input}{spec.size}.jsonl.gz"
    if path.exists():
        trace = load(path)
    else:
        model, inputs, loss_fn = zoo.build(model_name, fake=True)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if name != model_name else None
        trace = capture(model, inputs, loss_fn, optimizer=sgd, name=name, device="a100")
        cache.mkdir(parents=True, exist_ok=True)
        save(trace, path)
    events = tuple(dataclasses.replace(e, cost=e.est_cost) if isinstance(e, Op) else e for e in trace.events)
    return dataclasses.replace(trace, events=events)


_TRACES: dict[str, Trace] = {}  # filled before the workers fork; they inherit it


def _run(job: tuple[str, str, float]) -> tuple[SimResult, float]:
    name, policy, ratio = job
    start = time.perf_counter()
    result = simulate(_TRACES[name], ratio, policy)
    return result, time.perf_counter() - start


Results = dict[tuple[str, str, float], SimResult]


def run_all(
    jobs: Sequence[tuple[str, str, float]], workers: int, store: Path, simulate_missing: bool
) -> Results:
    """Every job's result, from ``store`` (one JSON record a line) or simulated now and appended to
    it, so that an interrupted run resumes. Smaller traces first; a trace's jobs in the given order.
    Without ``simulate_missing``, only what ``store`` holds."""
    done: Results = {}
    if store.exists():
        for line in store.read_text().splitlines():
            record = json.loads(line)
            record["outcome"] = Outcome(record["outcome"])
            record["overhead"] = math.nan if record["overhead"] is None else record["overhead"]
            result = SimResult(**record)
            done[result.trace, result.policy, round(result.ratio, 1)] = result
    if not simulate_missing:
        return done
    todo = sorted((j for j in jobs if j not in done), key=lambda j: len(_TRACES[j[0]].ops))
    with ProcessPoolExecutor(workers) as pool, store.open("a") as out:
        futures = {pool.submit(_run, job): job for job in todo}
        for future in as_completed(futures):
            result, seconds = future.result()
            done[futures[future]] = result
            out.write(json.dumps(result.to_dict()) + "\n")
            out.flush()
            print(f"  {result} [{seconds:.1f} s]", flush=True)
    return done


def cell(r: SimResult | None, field: str) -> str:
    if r is None:
        return "n/a"
    if r.outcome is Outcome.OOM:
        return "OOM"
    if r.outcome is Outcome.THRASHED:
        return "thr." if field == "overhead" else "-"
    return f"{r.overhead:.3f}" if field == "overhead" else f"{100 * r.fragmentation:.1f}%"


def table(results: Results, names: Sequence[str], policies: Sequence[str], field: str) -> str:
    lines = ["| model | policy | " + " | ".join(f"{x:.1f}" for x in RATIOS) + " |"]
    lines.append("|---|---|" + "---:|" * len(RATIOS))
    for name in names:
        for policy in policies:
            cells = " | ".join(cell(results.get((name, policy, r)), field) for r in RATIOS)
            lines.append(f"| {name} | {policy} | {cells} |")
    return "\n".join(lines)


def rank(r: SimResult) -> float:
    """Overhead, with unfinished runs last (thrashed before out of memory)."""
    return (
        r.overhead if r.outcome is Outcome.OK else math.inf if r.outcome is Outcome.THRASHED else 2 * math.inf
    )


def losses(results: Results, names: Sequence[str], policy: str) -> str:
    """Where ``policy`` ends above the better of dtr and dte (overheads to 3 decimals)."""
    lines = [f"| model | {policy} loses at (its overhead vs the better of dtr, dte) |", "|---|---|"]
    for name in names:
        lost = []
        for ratio in RATIOS:
            mine = results.get((name, policy, ratio))
            others = [results.get((name, p, ratio)) for p in ("dtr", "dte")]
            if mine is None or None in others:
                lost.append(f"{ratio:.1f} (not run)")
                continue
            other = min((r for r in others if r is not None), key=rank)
            if round(rank(mine), 3) > round(rank(other), 3):
                lost.append(
                    f"{ratio:.1f} ({cell(mine, 'overhead')} vs {cell(other, 'overhead')} {other.policy})"
                )
        lines.append(f"| {name} | {', '.join(lost) or 'nowhere'} |")
    return "\n".join(lines)


def plot(results: Results, names: Sequence[str], policies: Sequence[str], field: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 4
    rows = math.ceil(len(names) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for policy in policies:
            runs = [results.get((name, policy, r)) for r in RATIOS]
            done = [r for r in runs if r is not None and r.outcome is Outcome.OK]
            values = [r.overhead if field == "overhead" else 100 * r.fragmentation for r in done]
            ax.plot([r.ratio for r in done], values, marker="o", label=policy)
        ax.set_title(f"{name} ({len(_TRACES[name].tensors):,} tensors)")
        ax.set_xlabel("budget ratio")
        ax.set_ylabel("overhead (compute / base)" if field == "overhead" else "fragmentation (%)")
        if field != "overhead":
            ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlim(0.15, 0.95)
    for ax in axes.flat[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize="small")
    fig.suptitle("finished runs only; a missing point thrashed (overhead > 2) or ran out of memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default=str(HERE / "traces"), help="where fake traces are kept")
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations at once")
    parser.add_argument("--only", help="comma-separated zoo names (default: the whole zoo)")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated policies of the sweep"
    )
    parser.add_argument("--no-ablation", action="store_true", help="skip the Coop ablation")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="tables and figures from the stored results; n/a where none",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    out, cache = Path(args.out), Path(args.cache)
    names = args.only.split(",") if args.only else list(zoo.names())
    policies = args.policies.split(",")
    ablated = [] if args.no_ablation else [n for n in ABLATED if n.partition("-sgd")[0] in names]
    machine = platform.processor() or platform.machine()
    print(f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, {machine}")

    start = time.perf_counter()
    print("\n## Workloads (fp32, fake tensors, costs from the a100 profile)\n")
    print(
        "| model | size | ops | tensors | peak with constants | estimated step |\n"
        "|---|---|---:|---:|---:|---:|"
    )
    for name in dict.fromkeys([*names, *ablated]):
        trace = _TRACES[name] = workload(name, cache)
        spec = zoo.get(name.partition("-sgd")[0])
        print(
            f"| {name} | batch {spec.batch}, {spec.input} {spec.size} | {len(trace.ops):,} | "
            f"{len(trace.tensors):,} | {trace.peak_bytes / 2**30:.2f} GiB | {1e3 * trace.total_cost:.0f} ms |"
        )
    print(f"\ntracing (or loading) took {time.perf_counter() - start:.0f} s")

    # Coop and the baselines before the variant and the ablation, in case the run is cut short.
    jobs = [(n, p, r) for p in policies for n in names for r in RATIOS]
    jobs += [(n, p, r) for n in ablated for p in ABLATION for r in ABLATION_RATIOS.get(n, (0.3, 0.5, 0.7))]
    jobs = list(dict.fromkeys(jobs))
    start = time.perf_counter()
    results = run_all(jobs, args.jobs, cache / "results.jsonl", not args.report_only)
    missing = [job for job in jobs if job not in results]
    if not args.report_only:
        print(
            f"\n{len(jobs)} simulations took {time.perf_counter() - start:.0f} s with {args.jobs} processes"
        )
    elif missing:
        print(f"\n{len(missing)} of {len(jobs)} simulations not run: " + ", ".join(map(str, missing)))

    print(f"\n## Overhead\n\n{table(results, names, policies, 'overhead')}")
    print(f"\n## Fragmentation\n\n{table(results, names, policies, 'fragmentation')}")
    print(f"\n## Where Coop loses\n\n{losses(results, names, 'coop')}")
    if "coop-total" in policies:
        print(f"\n{losses(results, names, 'coop-total')}")
    print("\n## Coop ablation (overhead; fragmentation)\n")
    print("| model | ratio | " + " | ".join(ABLATION) + " |\n|---|---|" + "---|" * len(ABLATION))
    for name in ablated:
        for ratio in ABLATION_RATIOS.get(name, (0.3, 0.5, 0.7)):
            row = [results.get((name, p, ratio)) for p in ABLATION]
            print(
                f"| {name} | {ratio} | "
                + " | ".join(f"{cell(r, 'overhead')}; {cell(r, 'fragmentation')}" for r in row)
                + " |"
            )
    print("\n## Victim search per evicting allocation (median over the ratios that finished)\n")
    print("| model | tensors | " + " | ".join(policies) + " |\n|---|---:|" + "---:|" * len(policies))
    for name in names:
        cells = []
        for policy in policies:
            runs = [results.get((name, policy, r)) for r in RATIOS]
            done = [r.search_per_allocation for r in runs if r is not None and r.outcome is Outcome.OK]
            cells.append(f"{1e3 * float(np.median(done)):.2f} ms" if done else "-")
        print(f"| {name} | {len(_TRACES[name].tensors):,} | " + " | ".join(cells) + " |")

    plot(results, names, policies, "overhead", out / "zoo_overhead.png")
    plot(results, names, policies, "fragmentation", out / "zoo_fragmentation.png")
    records = [results[job].to_dict() for job in jobs if job in results]
    (out / "zoo.json").write_text(
        json.dumps(records, indent=1, default=lambda x: None if math.isnan(x) else x)
    )


if __name__ == "__main__":
    main()
