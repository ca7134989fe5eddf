"""Figures of a sweep: overhead and fragmentation against the budget ratio, search time against size.

matplotlib is imported when a figure is drawn, not when remat is imported.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from remat.sim.result import Outcome, SimResult


def plot_sweep(results: Sequence[SimResult], path: str | os.PathLike[str]) -> None:
    """Write a PNG: per trace, overhead (top) and fragmentation (bottom) against the budget ratio,
    one line per policy through the finished runs, and the runs that did not finish marked at the
    top of the overhead panel (x: thrashed, v: out of memory) in the policy's colour; last column,
    the mean time spent finding victims per allocation that had to evict, against the number of
    tensors of each trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter
    from matplotlib.transforms import blended_transform_factory

    traces = list(dict.fromkeys(r.trace for r in results))
    policies = list(dict.fromkeys(r.label for r in results))  # a policy with swapping apart
    columns = len(traces) + 1
    fig, axes = plt.subplots(2, columns, figsize=(4 * columns, 7), squeeze=False)
    for column, trace in enumerate(traces):
        top, bottom = axes[0][column], axes[1][column]
        edge = blended_transform_factory(top.transData, top.transAxes)  # x: ratio, y: panel height
        for k, policy in enumerate(policies):
            mine = sorted(
                (r for r in results if r.trace == trace and r.label == policy), key=lambda r: r.ratio
            )
            runs = [r for r in mine if r.outcome is Outcome.OK]
            ratios = [r.ratio for r in runs]
            colour = f"C{k}"
            top.plot(ratios, [r.overhead for r in runs], marker="o", color=colour, label=policy)
            bottom.plot(ratios, [100 * r.fragmentation for r in runs], marker="o", color=colour, label=policy)
            for outcome, mark in ((Outcome.THRASHED, "x"), (Outcome.OOM, "v")):
                failed = [r.ratio for r in mine if r.outcome is outcome]
                top.scatter(
                    failed, [0.97 - 0.03 * k] * len(failed), marker=mark, color=colour, transform=edge
                )
        costs = sorted({r.costs for r in results if r.trace == trace})
        top.set_title(f"{trace} ({', '.join(costs)} costs)")
        top.set_ylabel("overhead (compute / base)")
        bottom.set_ylabel("fragmentation (% of budget free)")
        bottom.set_xlabel("budget ratio")
        top.legend(fontsize="small", title="x thrashed, v OOM", title_fontsize="x-small")
    search = axes[0][-1]
    drawn = False
    for policy in policies:
        points: dict[int, list[float]] = {}
        for r in results:
            if r.label == policy and r.evicting_allocations and r.search_per_allocation > 0:
                points.setdefault(r.tensors, []).append(r.search_per_allocation)
        sizes = sorted(points)
        search.plot(sizes, [1e3 * sum(points[n]) / len(points[n]) for n in sizes], marker="o", label=policy)
        drawn = drawn or bool(sizes)
    if drawn:  # a log scale needs a positive value: no run that evicted, no search to draw
        search.set_xscale("log")
        search.set_yscale("log")
    else:
        search.text(0.5, 0.5, "no run evicted", ha="center", va="center", transform=search.transAxes)
    search.xaxis.set_minor_formatter(NullFormatter())
    search.set_xlabel("tensors in the trace")
    search.set_ylabel("search time per evicting allocation (ms)")
    search.set_title("victim search")
    search.legend(fontsize="small")
    axes[1][-1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
