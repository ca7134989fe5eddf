"""``remat sim``: sweep traces x eviction policies x budget ratios through the simulator.

    remat sim TRACE... --policies dtr,dte,coop --ratios 0.2:0.9:0.1 --json OUT.json --plot OUT.png
    remat sim TRACE... --link 25GB/s     # each run also with swapping to the host over this link

TRACE is a file ``remat.trace.load`` reads (a remat trace or a DTR op log). The policy names come
from the registry (``remat.core.policies.names``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from remat._arguments import names_in, ratio_range
from remat.core.policies import names


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="simulate dynamic rematerialization of traces under budgets",
        description="Run traces under budget ratios with eviction policies; print, save and plot.",
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (remat traces or DTR logs)")
    parser.add_argument(
        "--policies",
        type=lambda spec: names_in(spec, names(), "sim.cli", "eviction policy"),
        default=None,
        help=f"comma-separated, from: {', '.join(names())} (default: dtr,dte,coop; with --memory bytes "
        "those of them that do not read addresses)",
    )
    parser.add_argument(
        "--ratios",
        type=ratio_range,
        default=ratio_range("0.2:0.9:0.1"),
        help="budget ratios of the unconstrained peak: START:STOP:STEP or a,b,c (default 0.2:0.9:0.1)",
    )
    parser.add_argument(
        "--memory",
        choices=("address", "bytes"),
        default="address",
        help="address: allocations need a contiguous block (default); bytes: count bytes, as the DTR paper",
    )
    parser.add_argument(
        "--link",
        type=_link,
        metavar="RATE",
        help="also run every policy swapping victims to the host over a link of RATE each way (e.g. 25GB/s)",
    )
    parser.add_argument("--thrash-limit", type=float, default=2.0, help="stop a run past this overhead")
    parser.add_argument("--json", metavar="OUT", help="write every result as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="draw overhead, fragmentation and search time")
    parser.set_defaults(func=run)


def _link(rate: str) -> object:
    """The link of ``--link``: ``rate`` each way, the default latency."""
    from remat._errors import RematValueError
    from remat._units import parse_rate
    from remat.host.link import Link

    try:
        return Link(d2h=parse_rate(rate, "sim.cli"), h2d=parse_rate(rate, "sim.cli"))
    except RematValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from remat._console import console, progress
    from remat._errors import RematValueError, message
    from remat._units import format_bytes
    from remat.core.policies.registry import resolve
    from remat.sim.result import Outcome
    from remat.sim.simulate import _thrash_limit as thrash_limit
    from remat.sim.simulate import sweep
    from remat.trace import load

    layout = args.memory == "address"
    if args.policies is None:  # the default three, less those that read addresses byte counting lacks
        default = ("dtr", "dte", "coop")
        args.policies = [p for p in default if layout or "layout" not in resolve(p, True, "sim.cli").needs]
    for policy in args.policies:  # before any trace is read, in the command's words
        if not layout and "layout" in resolve(policy, True, "sim.cli").needs:
            rule = "this policy reads addresses, which --memory bytes does not model"
            todo = "pass --memory address, or a policy without layout-aware parts (dtr-eq, coop-no-layout)"
            raise RematValueError(message("sim.cli", rule, f"policy {policy!r}", todo))
    thrash_limit(args.thrash_limit)
    traces = [load(path) for path in args.traces]
    links = [None] if args.link is None else [None, args.link]
    total = len(traces) * len(args.policies) * len(args.ratios) * len(links)
    results = []
    with progress(transient=True) as bar:
        task = bar.add_task("simulating", total=total)
        for link in links:
            results += sweep(
                traces,
                args.policies,
                args.ratios,
                args.thrash_limit,
                layout=layout,
                progress=lambda result: bar.update(
                    task, advance=1, description=f"{result.trace} {result.policy}"
                ),
                link=link,
            )
    costs = ", ".join(sorted({f"{r.trace}: {r.costs} costs" for r in results}))
    table = Table(title=f"remat sim ({args.memory} memory; {costs})")
    for column, attribute in (("trace", "trace"), ("policy", "label")):  # names are never cut short
        table.add_column(column, min_width=max(len(getattr(r, attribute)) for r in results))
    table.add_column("outcome")
    swapped = ("swaps", "host peak", "stall ms") if args.link is not None else ()
    for column in ("ratio", "overhead", "evictions", *swapped, "frag.", "search ms"):
        table.add_column(column, justify="right")
    for r in results:
        overhead = f"{r.overhead:.3f}" if r.outcome is Outcome.OK else ""  # a stopped run has none
        swaps = (str(r.swaps), format_bytes(r.host_peak_bytes), f"{1e3 * r.stall_seconds:.1f}")
        table.add_row(
            r.trace,
            r.label,
            str(r.outcome),
            f"{r.ratio:.2f}",
            overhead,
            str(r.evictions),
            *(swaps if r.link else ("",) * len(swapped)),
            f"{r.fragmentation:.1%}",
            f"{1e3 * r.search_seconds:.1f}",
        )
    console().print(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump([r.to_dict() for r in results], file, indent=1)
    if args.plot:
        from remat.sim.plot import plot_sweep

        plot_sweep(results, args.plot)
    return 0
