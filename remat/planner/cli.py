"""``remat plan``: plan a zoo model's training step and explain it, or sweep budgets for a Pareto curve.

    remat plan --model gpt2 --budget 0.6 --save plan.json
    remat plan --model gpt2 --pareto --out pareto.png --json pareto.json
    remat plan --model gpt2 --budget 0.4 --link 25GB/s --pareto --out pareto.png

The model is the zoo's tiny variant unless ``--full`` asks for the paper-size one. ``--pareto``
traces the step once, finds every solver's plans once (``remat.planner.frontier``), then picks each
solver's plan at ``--points`` budgets spread evenly from the smallest feasible peak to the plain
step's peak, and runs each distinct plan: the peak of the step's memory is measured with
``remat.memory.track(allocator=True)``, the overhead as the median over ``--repeats`` rounds of the
step's CPU time ÷ the plain step's (each round enough steps to last ``_ROUND_SECONDS``), timed
interleaved in the same process. Progress bars say which point is running, the time elapsed and
the time left. The plot shows predicted and measured peak against overhead.
``--link RATE`` lets plans offload saved tensors over a link of that rate each way (``remat.Link``);
with ``--pareto`` the three-way plans are one more series, ``auto+offload`` (triangles).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from typing import Any

from remat._arguments import advice_in_flags, in_flags, names_in, positive
from remat._errors import RematError, RematValueError, message
from remat._units import parse_bytes
from remat.planner.arguments import Budget, read_budget
from remat.planner.solvers import names

# what ``remat plan --model gpt2 --pareto`` took on the tiny model (benchmarks/plan/README.md)
_TINY_PARETO = "about 65 s of CPU time; longer wall time on a busy machine"
# the tiny model's batch: at the zoo's tiny batch of 2 the embeddings and logits are most of the
# step, and no plan gets below about 0.8 of the plain peak (the default budget is 0.5)
_TINY_BATCH = 8
# CPU seconds each timed round of the sweep lasts at least
_ROUND_SECONDS = 0.05
# --pareto's defaults
_POINTS, _SOLVERS, _REPEATS = 6, ("chain", "greedy", "sqrt", "milp"), 3


def register(subparsers: Any) -> None:
    from remat.zoo import names as models

    parser = subparsers.add_parser(
        "plan",
        help="plan recomputation for a zoo model under a budget, or sweep budgets (--pareto)",
        description="Trace one training step of a zoo model, solve for a plan, explain or sweep it.",
    )
    parser.add_argument("--model", required=True, choices=models(), help="zoo model")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="the model's tiny variant (the default)")
    size.add_argument(
        "--full",
        action="store_true",
        help="the paper-size model (GPT-2 small at batch 8 x 512: tracing alone takes minutes and "
        "GBs, and --pareto far longer, tens of minutes, on 2 CPU cores) instead of the tiny one "
        f"(--pareto: {_TINY_PARETO})",
    )
    parser.add_argument(
        "--batch", type=int, help=f"batch size (default {_TINY_BATCH}, or the zoo's with --full)"
    )
    parser.add_argument("--seq", type=int, help="tokens per sample (text models)")
    parser.add_argument("--image", type=int, help="image side (vision models)")
    parser.add_argument(
        "--budget",
        default=0.5,
        type=_budget,
        help="bytes ('2GB'), a ratio of the plain peak (0.5), or 'min' (the smallest peak a plan reaches)",
    )
    parser.add_argument("--solver", choices=names(), help="without --pareto: the solver (default auto)")
    parser.add_argument("--save", metavar="PLAN.json", help="write the plan (remat.Plan.load reads it)")
    parser.add_argument(
        "--rerun-modules",
        action="store_true",
        help="run a region that is one module call again as that module (remat.plan's rerun_modules)",
    )
    parser.add_argument(
        "--link", type=_link, help="offload too, over a link of this rate each way ('25GB/s')"
    )
    parser.add_argument(
        "--host-budget",
        type=_host_budget,
        help="with --link: bytes the host may hold ('8GB'; default no limit)",
    )
    parser.add_argument(
        "--pareto", action="store_true", help="sweep --points budgets x --solvers and measure each plan"
    )
    parser.add_argument(
        "--points",
        type=_points,
        help=f"with --pareto: budgets per solver, lowest feasible peak to plain (default {_POINTS})",
    )
    parser.add_argument(
        "--solvers",
        type=_solvers,
        help=f"with --pareto: comma-separated solvers (default {','.join(_SOLVERS)})",
    )
    parser.add_argument(
        "--repeats", type=positive, help=f"with --pareto: timing rounds per plan (default {_REPEATS})"
    )
    parser.add_argument("--out", metavar="FILE.png", help="with --pareto: plot the curve")
    parser.add_argument("--json", metavar="FILE", help="with --pareto: write every point as JSON")
    parser.set_defaults(func=run)


def _budget(text: str) -> Budget:
    """The budget, checked before any work (a bad one is an argparse error: one line, exit 2)."""
    try:
        return read_budget(text)
    except RematError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _host_budget(text: str) -> str:
    """The host budget, read before any work (the step is traced first); kept as given."""
    try:
        parse_bytes(text, "plan")
    except RematError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _points(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(
            message("plan", "--points must be a whole number of at least 2", f"got {text!r}", "pass 6")
        )
    return int(text)


def _link(text: str) -> Any:
    from remat.host.link import Link

    try:
        return Link(d2h=text, h2d=text)
    except RematError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _solvers(text: str) -> list[str]:
    return names_in(text, names(), "plan", "solver")


def run(args: argparse.Namespace) -> int:
    import remat
    from remat.planner.api import plan_trace, trace_step

    stray = (
        ["--save"]
        if args.pareto and args.save
        else []
        if args.pareto
        else [f for f in ("--out", "--json") if getattr(args, f[2:])]
    )
    if stray:
        rule = "--out and --json go with --pareto, --save without it"
        raise RematValueError(
            message("plan", rule, f"got {' '.join(stray)}", "leave it out, or add --pareto")
        )
    wrong = [f"--{k}" for k in ("points", "solvers", "repeats") if getattr(args, k) is not None]
    if args.pareto and args.solver is not None or not args.pareto and wrong:  # else left unused
        rule = "--solver picks the plan's solver; --points, --solvers and --repeats shape the --pareto sweep"
        given = "--solver with --pareto" if args.pareto else f"{' '.join(wrong)} without --pareto"
        raise RematValueError(message("plan", rule, f"got {given}", "leave it out, or use the other form"))
    args.solver = args.solver or "auto"
    args.points, args.repeats = args.points or _POINTS, args.repeats or _REPEATS
    args.solvers = args.solvers or list(_SOLVERS)
    if args.host_budget is not None and args.link is None:  # before the step is traced
        rule = "--host-budget bounds what goes to the host over --link"
        raise RematValueError(message("plan", rule, "got no --link", "add --link 25GB/s, or leave it out"))
    if args.pareto and not (args.out or args.json):  # its points go to a picture, a file, or both
        rule = "--pareto writes its sweep to --out (a picture) or --json (every point)"
        raise RematValueError(
            message("plan", rule, "got neither", "add --out pareto.png or --json pareto.json")
        )

    sizes = {k: getattr(args, k) for k in ("batch", "seq", "image") if getattr(args, k) is not None}
    if not args.full:
        sizes.setdefault("batch", _TINY_BATCH)
    wl = remat.zoo.build(args.model, tiny=not args.full, **sizes)

    def loss_fn(model: Any, *inputs: Any) -> Any:
        return wl.loss_fn(model(*inputs))

    from remat._console import console

    with console(stderr=True).status(f"tracing one training step of {args.model}"):
        trace = trace_step(wl.model, wl.inputs, loss_fn)
    if not args.pareto:
        with advice_in_flags(_ADVICE):
            plan = plan_trace(
                trace,
                args.budget,
                solver=args.solver,
                link=args.link,
                host_budget=args.host_budget,
                rerun_modules=args.rerun_modules,
            )
        plan.explain()
        if args.save:
            plan.save(args.save)
        return 0
    points = sweep(trace, wl.model, wl.inputs, loss_fn, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "points": points}, f, indent=1)
    if args.out:
        plot(points, args.model, args.out)
    return 0


# the planner's advice in this command's flags, not the Python API's arguments
_ADVICE = (
    (r"link=remat\.Link\([^)]*\)", "--link 25GB/s"),
    (r"solver='(\w+)'", r"--solver \1"),
    ("host_budget", "--host-budget"),
    ("without link", "without --link"),
)


def _in_flags(text: str) -> str:
    """A planner message's advice in this command's flags (``_ADVICE``)."""
    return in_flags(text, _ADVICE)


def _measure(model: Any, inputs: Any, loss_fn: Any, plan: Any) -> int:
    import remat

    model.zero_grad(set_to_none=True)
    with remat.memory.track(allocator=True) as tracked:
        with plan.apply(model) if plan is not None else contextlib.nullcontext():
            loss = loss_fn(model, *inputs)
        loss.backward()
    return tracked.peak_bytes


def _seconds(model: Any, inputs: Any, loss_fn: Any, plan: Any, steps: int = 1) -> float:
    """CPU seconds of ``steps`` steps, forward and backward, under ``plan`` (None: plain)."""
    start = time.process_time()
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with plan.apply(model) if plan is not None else contextlib.nullcontext():
            loss = loss_fn(model, *inputs)
        loss.backward()
    return time.process_time() - start


def sweep(
    trace: Any, model: Any, inputs: Any, loss_fn: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every solver's plans at ``args.points`` budgets from the smallest feasible peak to the plain
    peak, each distinct plan run and measured; one point per (solver, budget) with a plan."""
    from remat._console import console, progress
    from remat.planner.api import plan_at
    from remat.planner.frontier import frontier
    from remat.planner.offload_search import offload_frontier

    screen = console(stderr=True)
    found = {}
    with progress() as bar:
        task = bar.add_task("finding every solver's plans", total=len(args.solvers))
        for solver in args.solvers:
            bar.update(task, description=f"finding every solver's plans: {solver}")
            found[solver] = frontier(trace, solver, rerun_modules=args.rerun_modules)
            bar.advance(task)
    plain = _measure(model, inputs, loss_fn, None)
    base = next(iter(found.values())).baseline
    low = min(c.pred.peak_bytes for f in found.values() for c in f.candidates)
    budgets = [low + (base - low) * k // (args.points - 1) for k in range(args.points)]
    chosen = []
    series = list(found.items())
    host = None if args.host_budget is None else parse_bytes(args.host_budget, "plan")
    if args.link is not None:  # offload's plans beside recomputation's, on the auto candidates
        auto = found.get("auto") or frontier(trace, "auto", rerun_modules=args.rerun_modules)
        series.append(("auto+offload", offload_frontier(auto, args.link, host)))
    for solver, plans in series:
        for budget in budgets:
            try:
                plan = plan_at(plans, budget)
            except RematError:
                screen.print(f"{solver}: no plan within {budget} bytes (its plans start higher)")
                continue
            chosen.append((solver, budget, plan))
    # a tiny model's step takes a millisecond or two: time enough steps per round for the CPU
    # clock's resolution and the machine's other work to matter little
    steps = max(1, math.ceil(_ROUND_SECONDS / max(_seconds(model, inputs, loss_fn, None), 1e-4)))
    measured: dict[tuple[Any, ...], tuple[int, float]] = {}
    with progress() as bar:
        task = bar.add_task("measuring", total=len(chosen))
        for solver, budget, plan in chosen:
            bar.update(task, description=f"measuring {solver} at {budget / 2**20:.2f} MiB")
            key = (plan.regions, plan.tensors)
            if key not in measured:
                rounds = [
                    _seconds(model, inputs, loss_fn, plan, steps)
                    / _seconds(model, inputs, loss_fn, None, steps)
                    for _ in range(args.repeats)
                ]
                measured[key] = _measure(model, inputs, loss_fn, plan), statistics.median(rounds)
            bar.advance(task)
    return [
        {
            "solver": solver,
            "budget": budget,
            "ratio": budget / base,
            "predicted_peak": plan.predicted_peak_bytes,
            "measured_peak": measured[(plan.regions, plan.tensors)][0],
            "plain_peak": plain,
            "predicted_overhead": plan.predicted_overhead,
            "measured_overhead": measured[(plan.regions, plan.tensors)][1],
            "solve_seconds": plan.solve_seconds,
            "offloaded_bytes": plan.offloaded_bytes,
            "predicted_stall": plan.predicted_stall,
        }
        for solver, budget, plan in chosen
    ]


def plot(points: list[dict[str, Any]], model: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, solver in enumerate(dict.fromkeys(p["solver"] for p in points)):
        mine = sorted((p for p in points if p["solver"] == solver), key=lambda p: p["predicted_peak"])
        colour = f"C{k}"
        marker = "^" if solver == "auto+offload" else "o"  # three-way plans (--link)
        ax.plot(
            [p["predicted_peak"] / 2**20 for p in mine],
            [p["predicted_overhead"] for p in mine],
            f"{marker}--",
            color=colour,
            label=f"{solver} predicted",
        )
        ax.plot(
            [p["measured_peak"] / 2**20 for p in mine],
            [p["measured_overhead"] for p in mine],
            "^-" if marker == "^" else "s-",
            color=colour,
            label=f"{solver} measured",
        )
    ax.set_xlabel("peak of the step's tensors (MiB)")
    ax.set_ylabel("step time ÷ plain step")
    ax.set_title(f"remat plan --pareto: {model}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
