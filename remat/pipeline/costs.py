"""What the pipeline model walks: each stage's ``Cost`` on one micro-batch and what each action of a
schedule costs a rank beyond its stage's compute (``ActionCost``), and the check that a walk's
figures are whole (``check``: one cost per stage and micro-batch, every figure finite and not
negative; a negative time made a shorter step, a NaN one a NaN step)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from remat._errors import RematTypeError, RematValueError, message
from remat.pipeline.schedule import Schedule

__all__ = ["ActionCost", "Cost", "check"]


@dataclass(frozen=True)
class Cost:
    """What one stage costs on one micro-batch: ``forward_s``, ``backward_s`` (the recomputation
    included, ``recompute_s`` of it), ``saved_bytes`` held from its forward to its backward,
    ``peak_bytes``, the one-micro-batch step peak, ``output_bytes`` of the stage's output as it
    holds it (a contiguous slice keeps its whole storage), ``grad_bytes`` of its parameters'
    gradients and ``transfer_bytes`` held by the schedule's sends and receives;
    ``later_peak_bytes``, the step's peak beside gradients that exist already (counted apart once
    the stage's first backward made them), not counting them; ``sent_bytes`` of the output as
    sent, received and merged (its elements; None: ``output_bytes``)."""

    forward_s: float
    backward_s: float
    recompute_s: float
    saved_bytes: int
    peak_bytes: int
    output_bytes: int
    grad_bytes: int
    transfer_bytes: int
    later_peak_bytes: int | None = None  # None: ``peak_bytes``
    sent_bytes: int | None = None

    @property
    def sent(self) -> int:
        """Bytes of the output as sent, received and merged."""
        return self.output_bytes if self.sent_bytes is None else self.sent_bytes

    def bad(self) -> str | None:
        """The first figure that is no number (a bool is none), negative or not finite (seconds),
        or no whole number (bytes; the two optional ones may be None), as ``name=value``; else None."""
        return _first_bad(self)


@dataclass(frozen=True)
class ActionCost:
    """What running the schedule costs a rank beyond its stages' compute, in seconds: per
    ``forward_s`` and per ``backward_s`` action (torch's stage code, the autograd call), per
    ``send_s`` and ``receive_s`` of a tensor to or from another rank, and ``step_s`` once per step
    (splitting the batch, merging the outputs); a message crosses the link between two ranks in
    ``latency_s`` plus ``byte_s`` per byte (NOTE [per-action cost] in ``remat.pipeline.timeline``).
    All zero: op times only."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    send_s: float = 0.0
    receive_s: float = 0.0
    latency_s: float = 0.0
    byte_s: float = 0.0
    step_s: float = 0.0

    def bad(self) -> str | None:
        """The first figure that is no number (a bool is none), negative or not finite, as
        ``name=value``, or None."""
        return _first_bad(self)

    def __str__(self) -> str:
        return (
            f"ActionCost(forward {self.forward_s * 1e3:.3f} ms, backward {self.backward_s * 1e3:.3f} ms, "
            f"send {self.send_s * 1e3:.3f} ms, receive {self.receive_s * 1e3:.3f} ms, "
            f"link {self.latency_s * 1e3:.3f} ms + {self.byte_s * 1e9:.3f} ns/byte, "
            f"step {self.step_s * 1e3:.3f} ms)"
        )


def _first_bad(figures: Cost | ActionCost) -> str | None:
    """The first field of ``figures`` that is no number (a bool is none), negative or not finite,
    or, unless its name ends in ``_s`` (seconds), no whole number, as ``name=value``; a field whose
    default is None may be None. None where every one is sound."""
    for f in fields(figures):
        value = getattr(figures, f.name)
        if value is None and f.default is None:
            continue
        kinds = (int, float) if f.name.endswith("_s") else (int,)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < 0:
            return f"{f.name}={value!r}"
    return None


def check(schedule: object, costs: object, per_action: object) -> None:
    """Refuse what ``walk`` cannot walk: a schedule that is none, costs that are not one tuple of
    ``Cost`` per micro-batch for each of its stages, a figure negative or not finite."""
    if not isinstance(schedule, Schedule):
        raise RematTypeError(
            message(
                "pipeline.walk",
                "schedule must be a Schedule",
                type(schedule).__name__,
                "pass remat.pipeline.build(...)",
            )
        )
    p, m = schedule.n_stages, schedule.n_microbatches
    shape = f"{p} stages x {m} micro-batches"
    rows = costs if isinstance(costs, tuple | list) else None
    if rows is None or len(rows) != p or any(not isinstance(r, tuple | list) or len(r) != m for r in rows):
        given = (
            type(costs).__name__
            if rows is None
            else f"{len(rows)} rows of {[len(r) if isinstance(r, tuple | list) else '?' for r in rows]}"
        )
        raise RematValueError(
            message(
                "pipeline.walk",
                f"costs are one Cost per stage and micro-batch ({shape})",
                given,
                "pass costs[stage][microbatch]",
            )
        )
    for s, row in enumerate(rows):
        for k, cost in enumerate(row):
            if not isinstance(cost, Cost):
                raise RematTypeError(
                    message(
                        "pipeline.walk",
                        "each cost is a Cost",
                        f"costs[{s}][{k}] is {type(cost).__name__}",
                        "pass remat.pipeline.Cost(...)",
                    )
                )
            if (bad := cost.bad()) is not None:
                raise RematValueError(
                    message(
                        "pipeline.walk",
                        "a cost's seconds and bytes are finite and not negative",
                        f"costs[{s}][{k}]: {bad}",
                        "pass measured figures",
                    )
                )
    if per_action is not None and not isinstance(per_action, ActionCost):
        raise RematTypeError(
            message(
                "pipeline.walk",
                "per_action must be an ActionCost or None",
                type(per_action).__name__,
                "pass remat.pipeline.calibrate()'s figures",
            )
        )
    if per_action is not None and (bad := per_action.bad()) is not None:
        raise RematValueError(
            message(
                "pipeline.walk",
                "per_action's figures are finite and not negative",
                bad,
                "pass remat.pipeline.calibrate()'s figures",
            )
        )
