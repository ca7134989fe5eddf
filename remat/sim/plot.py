"""Figures of a sweep: overhead and fragmentation against the budget ratio, search time against size.

matplotlib is imported when a figure is drawn, not when remat is imported.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from remat.sim.result import Outcome, SimResult


def plot_sweep(results: Sequence[SimResult], path: str | os.PathLike[str]) -> None:
    """Write a PNG: per trace, overhead (top) and fragmentation (bottom) against the budget ratio,
    one line per policy, finished runs only; last column, the mean time spent finding victims per
    allocation that had to evict, against the number of tensors of each trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    traces = list(dict.fromkeys(r.trace for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    columns = len(traces) + 1
    fig, axes = plt.subplots(2, columns, figsize=(4 * columns, 7), squeeze=False)
    for column, trace in enumerate(traces):
        top, bottom = axes[0][column], axes[1][column]
        for policy in policies:
            runs = sorted(
                (r for r in results if r.trace == trace and r.policy == policy and r.outcome is Outcome.OK),
                key=lambda r: r.ratio,
            )
            ratios = [r.ratio for r in runs]
            top.plot(ratios, [r.overhead for r in runs], marker="o", label=policy)
            bottom.plot(ratios, [100 * r.fragmentation for r in runs], marker="o", label=policy)
        top.set_title(trace)
        top.set_ylabel("overhead (compute / base)")
        bottom.set_ylabel("fragmentation (% of budget free)")
        bottom.set_xlabel("budget ratio")
        top.legend(fontsize="small")
    search = axes[0][-1]
    for policy in policies:
        points: dict[int, list[float]] = {}
        for r in results:
            if r.policy == policy and r.evicting_allocations:
                points.setdefault(r.tensors, []).append(r.search_per_allocation)
        sizes = sorted(points)
        search.plot(sizes, [1e3 * sum(points[n]) / len(points[n]) for n in sizes], marker="o", label=policy)
    search.set_xscale("log")
    search.set_yscale("log")
    search.xaxis.set_minor_formatter(NullFormatter())
    search.set_xlabel("tensors in the trace")
    search.set_ylabel("search time per evicting allocation (ms)")
    search.set_title("victim search")
    search.legend(fontsize="small")
    axes[1][-1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
