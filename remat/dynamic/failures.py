"""How a region's failure reads: thrashing and running out of room, told in the user's terms (the
budget, the reserve, the op that failed) with what to do about it."""

from __future__ import annotations

from typing import Protocol

from remat._errors import RematValueError, message
from remat._units import format_bytes
from remat.core.driver import Thrashed
from remat.core.policies.base import EvictionPolicy
from remat.core.pool import OutOfMemory
from remat.dynamic.engine import Engine
from remat.dynamic.keep import API


class Limits(Protocol):
    """What the errors say of the region (:class:`~remat.dynamic.region.Dynamic`)."""

    budget: int
    reserve: int
    arriving: int
    policy: EvictionPolicy
    thrash_limit: float

    @property
    def capacity(self) -> int: ...

    def least_budget(self, needed: int) -> int: ...


def explain(failure: BaseException, engine: Engine, region: Limits) -> Exception:
    """``failure`` (:class:`~remat.core.driver.Thrashed` or
    :class:`~remat.core.pool.OutOfMemory`) of ``engine``'s region as the error the user gets."""
    budget = format_bytes(region.budget)
    op = f"op {engine.ops} ({engine.current})" if engine.current else "the end of the region"
    if isinstance(failure, Thrashed):
        meter = engine.backend.meter
        return RematValueError(
            message(
                API,
                f"the budget makes policy {region.policy.name!r} thrash: recomputation passed "
                f"thrash_limit={region.thrash_limit}",
                f"budget {budget}; {meter.recompute_ops} recomputations costing "
                f"{meter.recompute_cost * 1e3:.1f} ms for {meter.base_cost * 1e3:.1f} ms of first runs, "
                f"stopped at {op}" + ("" if engine.current else ", handing back what the program holds"),
                "raise the budget, or thrash_limit if this overhead is acceptable (where an op's "
                "inputs and what remakes them do not fit beside each other, no limit is enough)"
                + (
                    ""
                    if engine.current
                    else "; or keep fewer of the region's tensors past its end (each evicted one is rebuilt "
                    "there with the dead tensors its recomputation reads: an input gradient of a "
                    "double backward is the whole first backward again)"
                ),
            )
        )
    assert isinstance(failure, OutOfMemory)
    if engine.current:
        what = f"what op {engine.ops} ({engine.current}) needs"
    elif failure.whole:
        what = "what the program holds at its end"
    else:  # one allocation of a recomputation restoring it, beside what is pinned then
        what = "a recomputation that restores what the program holds at its end, beside what it pins,"
    if failure.needed > region.capacity:
        least = region.least_budget(failure.needed)
        later = "" if failure.whole or engine.current else " (or more: another recomputation may need more)"
        # the generator states the region keeps count as constants: 5,056 bytes a random op on CPU
        states = sum(record.op.state for record in engine.runtime.graph.records)
        drawn = f", {states} bytes of them generator states kept to draw random ops again" if states else ""
        return RematValueError(
            message(
                API,
                f"the budget cannot hold {what} at once: it needs at least "
                f"{failure.needed} bytes = {format_bytes(failure.needed)} beside the reserve{drawn}",
                f"budget {region.budget} bytes ({budget}), reserve {region.reserve} bytes"
                + (f", {region.arriving} bytes set aside for arriving constants" if region.arriving else ""),
                f"pass a budget of at least {least} bytes{later}",
            )
        )
    other = "" if region.policy.name.startswith("coop") else ", use policy 'coop'"
    return RematValueError(
        message(
            API,
            f"{op} found no contiguous room: the free memory is split by pinned pieces",
            f"budget {budget}, {failure}",
            f"raise the budget{other} or pass layout=False",
        )
    )
