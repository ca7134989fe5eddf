"""Where a Plan recomputes: the regions of the forward's ops, and the decision for each saved tensor.

Why apart from the Plan: the executor (``remat.planner.execute``), the table (``remat.planner.explain``)
and the search (``remat.planner.search``) read these parts of a plan, and the Plan itself calls the
first two; holding the parts here lets every arrow point one way (plan -> execute, explain ->
regions). Positions are those of ``Plan.ops``: an op's place among the ops the model's forward runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat._units import format_bytes
from remat.policy import Decision

__all__ = ["Region", "TensorDecision"]


@dataclass(frozen=True)
class TensorDecision:
    """One tensor autograd saves for backward: made by forward op ``op`` (a position in
    ``Plan.ops``) in ``module``; SAVE (kept from the forward) or RECOMPUTE (made again in
    backward), and why. ``seconds`` is what running its op again costs (the trace's time for it,
    or the cost model's estimate): the price of recomputing it, paid or spared."""

    op: int
    op_name: str
    module: str
    nbytes: int
    action: Decision
    reason: str
    seconds: float = 0.0

    def __str__(self) -> str:
        size = format_bytes(self.nbytes)
        return (
            f"op {self.op} {self.op_name} ({self.module}), {size}, {self.seconds * 1e3:.2f} ms to "
            f"recompute: {self.action.value} ({self.reason})"
        )


@dataclass(frozen=True)
class Region:
    """Forward ops ``first`` .. ``last`` (positions, inclusive) run as one recomputed region:
    what autograd saves inside it is dropped after the forward and replayed from the region's
    inputs at its first use in backward, except the outputs of the ops in ``save``. Where
    ``rerun`` names a module, the region is that module's one call and runs as the module called
    again (NOTE [module re-run] in ``remat.planner.rerun_regions``). ``anchor`` names the module
    whose one call in the traced step is exactly the region's ops, where there is one: a forward
    run bare reaches the region through that call (NOTE [bare forward] in
    ``remat.planner.module_calls``)."""

    name: str
    first: int
    last: int
    save: frozenset[int] = frozenset()
    rerun: str = ""
    anchor: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "save", frozenset(self.save))

    def __contains__(self, position: object) -> bool:
        return isinstance(position, int) and self.first <= position <= self.last

    def __str__(self) -> str:
        kept = f", keeps {len(self.save)} op outputs" if self.save else ""
        again = f", runs {self.rerun} again" if self.rerun else ""
        return f"{self.name}: ops {self.first}-{self.last}{kept}{again}"
