"""Where a Plan recomputes: the regions of the forward's ops, and the decision for each saved tensor.

Why apart from the Plan: the executor (``remat.planner.execute``), the table (``remat.planner.explain``)
and the search (``remat.planner.search``) read these parts of a plan, and the Plan itself calls the
first two; holding the parts here lets every arrow point one way (plan -> execute, explain ->
regions). Positions are those of ``Plan.ops``: an op's place among the ops the model's forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat._units import format_bytes
from remat.policy import Decision

__all__ = ["Region", "TensorDecision", "one_call"]


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
    inputs at its first use in backward, except the outputs of the ops in ``save``."""

    name: str
    first: int
    last: int
    save: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "save", frozenset(self.save))

    def __contains__(self, position: object) -> bool:
        return isinstance(position, int) and self.first <= position <= self.last

    def __str__(self) -> str:
        kept = f", keeps {len(self.save)} op outputs" if self.save else ""
        return f"{self.name}: ops {self.first}-{self.last}{kept}"


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def one_call(modules: Sequence[str], first: int, last: int) -> str:
    """NOTE [one call] The module whose call issued exactly positions ``first`` .. ``last`` of a
    forward whose ops came from ``modules`` (one module path per position), or "": the deepest
    module every op of the run belongs to, when the ops just before and after belong to no part of
    it, and none of the run's ops comes from a child with a number for a name (a module list, such
    as ``nn.ModuleList``, is never called; an ``nn.Sequential``, which is, is passed over with it).
    Such a region that keeps nothing runs as that module's re-run (``remat.planner.rerun``) and is
    predicted so (``remat.planner.region_model``). A module list with named children
    (``nn.ModuleDict``) or a module whose children its parent calls one by one looks like a call
    here: its region records a tape and measures what the tape holds, not what was predicted. A
    module called twice in a row, each call a part of the run, looks the same here too and is
    refused when it runs."""
    if not 0 <= first <= last < len(modules):
        return ""
    parts = modules[first].split(".")
    for path in modules[first + 1 : last + 1]:
        other = path.split(".")
        n = 0
        while n < min(len(parts), len(other)) and parts[n] == other[n]:
            n += 1
        parts = parts[:n]
    module = ".".join(parts)
    if not module or any(
        p.split(".")[len(parts)].isdigit() for p in modules[first : last + 1] if p != module
    ):
        return ""  # numbered children: perhaps a list of modules, which nobody calls
    before = first > 0 and _inside(modules[first - 1], module)
    after = last + 1 < len(modules) and _inside(modules[last + 1], module)
    return "" if before or after else module
