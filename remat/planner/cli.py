"""``remat plan``: plan a zoo model's training step and explain it, or sweep budgets for a Pareto curve.

    remat plan --model gpt2 --tiny --budget 0.6 --save plan.json
    remat plan --model gpt2 --tiny --pareto --out pareto.png --json pareto.json
    remat plan --model gpt2 --tiny --budget 0.4 --link 25GB/s --pareto --out pareto.png

``--pareto`` plans the step at every ratio in ``--ratios`` with every solver in ``--solvers`` and runs
each plan: the peak of the step's memory is measured with ``remat.memory.track(allocator=True)``, the
overhead as the median over ``--repeats`` rounds of the step's time ÷ the plain step's, timed
interleaved in the same process. The plot shows predicted and measured peak against overhead.
``--link RATE`` lets plans offload saved tensors over a link of that rate each way (``remat.Link``);
with ``--pareto`` the three-way plans are one more series, ``auto+offload`` (triangles).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

from remat._arguments import names_in, ratio_range
from remat._errors import RematError
from remat._units import parse_budget
from remat.planner.solvers import names


def register(subparsers: Any) -> None:
    from remat.zoo import names as models

    parser = subparsers.add_parser(
        "plan",
        help="plan recomputation for a zoo model under a budget, or sweep budgets (--pareto)",
        description="Trace one training step of a zoo model, solve for a plan, explain or sweep it.",
    )
    parser.add_argument("--model", required=True, choices=models(), help="zoo model")
    parser.add_argument("--tiny", action="store_true", help="the model's tiny variant (for a quick look)")
    parser.add_argument("--batch", type=int, help="batch size (default: the zoo's, or 2 with --tiny)")
    parser.add_argument("--seq", type=int, help="tokens per sample (text models)")
    parser.add_argument("--image", type=int, help="image side (vision models)")
    parser.add_argument(
        "--budget", default=0.5, type=_budget, help="bytes ('2GB') or a ratio of the plain peak (0.5)"
    )
    parser.add_argument("--solver", default="auto", choices=names(), help="solver (default auto)")
    parser.add_argument("--save", metavar="PLAN.json", help="write the plan (remat.Plan.load reads it)")
    parser.add_argument(
        "--link", type=_link, help="offload too, over a link of this rate each way ('25GB/s')"
    )
    parser.add_argument(
        "--host-budget", help="with --link: bytes the host may hold ('8GB'; default no limit)"
    )
    parser.add_argument("--pareto", action="store_true", help="sweep --ratios x --solvers and measure each")
    parser.add_argument(
        "--ratios",
        default=_ratios("0.9,0.8,0.7,0.6,0.5,0.4,0.3"),
        type=_ratios,
        help="comma-separated ratios",
    )
    parser.add_argument(
        "--solvers",
        default=["chain", "greedy", "sqrt", "milp"],
        type=_solvers,
        help="comma-separated solvers",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds per plan (default 3)")
    parser.add_argument("--out", metavar="FILE.png", help="with --pareto: plot the curve")
    parser.add_argument("--json", metavar="FILE", help="with --pareto: write every point as JSON")
    parser.set_defaults(func=run)


def _budget(text: str) -> int | float:
    """The budget, checked before any work (a bad one is an argparse error: one line, exit 2)."""
    try:
        return parse_budget(text, "plan")
    except RematError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _link(text: str) -> Any:
    from remat.host.link import Link

    try:
        return Link(d2h=text, h2d=text)
    except RematError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _ratios(text: str) -> list[float]:
    return ratio_range(text, "plan")


def _solvers(text: str) -> list[str]:
    return names_in(text, names(), "plan", "solver")


def run(args: argparse.Namespace) -> int:
    import remat
    from remat.planner.api import plan_trace, trace_step

    sizes = {k: getattr(args, k) for k in ("batch", "seq", "image") if getattr(args, k) is not None}
    wl = remat.zoo.build(args.model, tiny=args.tiny, **sizes)

    def loss_fn(model: Any, *inputs: Any) -> Any:
        return wl.loss_fn(model(*inputs))

    trace = trace_step(wl.model, wl.inputs, loss_fn)
    if not args.pareto:
        plan = plan_trace(
            trace, args.budget, solver=args.solver, link=args.link, host_budget=args.host_budget
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


def _measure(model: Any, inputs: Any, loss_fn: Any, plan: Any) -> int:
    import remat

    model.zero_grad(set_to_none=True)
    with remat.memory.track(allocator=True) as tracked:
        with plan.apply(model) if plan is not None else contextlib.nullcontext():
            loss = loss_fn(model, *inputs)
        loss.backward()
    return tracked.peak_bytes


def _seconds(model: Any, inputs: Any, loss_fn: Any, plan: Any) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with plan.apply(model) if plan is not None else contextlib.nullcontext():
        loss = loss_fn(model, *inputs)
    loss.backward()
    return time.perf_counter() - start


def sweep(
    trace: Any, model: Any, inputs: Any, loss_fn: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Plan and run every (solver, ratio); one point per plan found."""
    from remat._console import console
    from remat._errors import RematError
    from remat.planner.api import plan_trace

    screen = console()
    plain = _measure(model, inputs, loss_fn, None)
    points: list[dict[str, Any]] = []
    series = [(solver, solver, None) for solver in args.solvers]
    series += [("auto+offload", "auto", args.link)] if args.link is not None else []
    for name, solver, link in series:
        for ratio in args.ratios:
            try:
                plan = plan_trace(trace, ratio, solver=solver, link=link, host_budget=args.host_budget)
            except RematError as err:
                screen.print(f"{name} at {ratio}: {err}")
                continue
            peak = _measure(model, inputs, loss_fn, plan)
            rounds = [
                _seconds(model, inputs, loss_fn, plan) / _seconds(model, inputs, loss_fn, None)
                for _ in range(args.repeats)
            ]
            point = {
                "solver": name,
                "ratio": ratio,
                "budget": plan.budget_bytes,
                "predicted_peak": plan.predicted_peak_bytes,
                "measured_peak": peak,
                "plain_peak": plain,
                "predicted_overhead": plan.predicted_overhead,
                "measured_overhead": statistics.median(rounds),
                "solve_seconds": plan.solve_seconds,
                "offloaded_bytes": plan.offloaded_bytes,
                "predicted_stall": plan.predicted_stall,
            }
            screen.print(point)
            points.append(point)
    return points


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
