"""One stage of a PipelinePlan: its rank, the micro-batches it holds, its ``remat.Plan`` for one
micro-batch and which micro-batches run it, and the costs the pipeline model walks.

Why apart from ``PipelinePlan``: the executor's stage modules (``remat.pipeline.execute``) and the
per-rank table read one stage, and need nothing of the whole plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from remat.pipeline.timeline import Cost
from remat.planner.plan import Plan

__all__ = ["StagePlan"]


@dataclass(frozen=True)
class StagePlan:
    """One stage: on ``rank``, holding up to ``in_flight`` micro-batches; ``plan`` recomputes for
    one micro-batch (None: nothing recomputed), not for the last one when ``except_last``.
    Costs of one micro-batch, measured on the example: ``forward_s``, ``backward_s`` and
    ``recompute_s`` (seconds), ``saved_bytes`` / ``peak_bytes`` under the plan and
    ``plain_saved_bytes`` / ``plain_peak_bytes`` without it; ``output_bytes`` of the stage's
    output (its storage, as the stage holds it), ``sent_bytes`` of it as sent and received (0:
    ``output_bytes``), ``grad_bytes`` of its parameters' gradients, ``transfer_bytes`` held by the
    schedule's sends and receives (``remat.pipeline.timeline``); ``inputs`` and ``outputs``, the
    shape and dtype of what the stage receives and sends for one micro-batch (torch's stage then
    needs no forward to learn them); ``parameters``, the shapes of the stage module's parameters,
    by which a plan loaded onto a model knows it for the one planned."""

    stage: int
    rank: int
    in_flight: int
    plan: Plan | None
    except_last: bool
    forward_s: float
    backward_s: float
    recompute_s: float
    saved_bytes: int
    peak_bytes: int
    plain_saved_bytes: int
    plain_peak_bytes: int
    output_bytes: int
    grad_bytes: int
    transfer_bytes: int
    inputs: tuple[tuple[int, ...], str]
    outputs: tuple[tuple[int, ...], str]
    # the step's peak once its gradients exist, not counting them (NOTE [later backwards] in
    # ``remat.pipeline.measure``); 0: not measured, ``peak_bytes`` stands in
    later_peak_bytes: int = 0
    plain_later_peak_bytes: int = 0
    sent_bytes: int = 0
    parameters: tuple[tuple[int, ...], ...] = ()  # the stage module's parameters' shapes (): not noted

    def bad(self) -> str | None:
        """What of this stage's figures is not of its kind (a plan file edited by hand); None if all is."""
        counts = [
            *("stage", "rank", "in_flight", "saved_bytes", "peak_bytes", "plain_saved_bytes"),
            *("plain_peak_bytes", "output_bytes", "grad_bytes", "transfer_bytes", "later_peak_bytes"),
            *("plain_later_peak_bytes", "sent_bytes"),
        ]
        for name in counts:
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                return f"stage {self.stage!r}: {name} {value!r}"
        for name in ("forward_s", "backward_s", "recompute_s"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                return f"stage {self.stage}: {name} {value!r}"
        if type(self.except_last) is not bool:
            return f"stage {self.stage}: except_last {self.except_last!r}"
        if not all(
            isinstance(p, tuple) and all(type(d) is int and d >= 0 for d in p) for p in self.parameters
        ):
            return f"stage {self.stage}: parameters {self.parameters!r}"[:200]
        for name in ("inputs", "outputs"):
            shape, dtype = getattr(self, name)
            if not all(type(d) is int and d >= 0 for d in shape) or not isinstance(dtype, str):
                return f"stage {self.stage}: {name} {getattr(self, name)!r}"
        return None

    def recomputes(self, microbatch: int, n_microbatches: int) -> bool:
        """Whether ``microbatch`` runs under the plan."""
        return self.plan is not None and not (self.except_last and microbatch == n_microbatches - 1)

    def cost(self, microbatch: int, n_microbatches: int) -> Cost:
        """The pipeline model's cost of this stage on ``microbatch``."""
        if self.recomputes(microbatch, n_microbatches):
            return Cost(
                self.forward_s,
                self.backward_s + self.recompute_s,
                self.recompute_s,
                self.saved_bytes,
                self.peak_bytes,
                self.output_bytes,
                self.grad_bytes,
                self.transfer_bytes,
                self.later_peak_bytes or self.peak_bytes,
                self.sent_bytes or self.output_bytes,
            )
        return Cost(
            self.forward_s,
            self.backward_s,
            0.0,
            self.plain_saved_bytes,
            self.plain_peak_bytes,
            self.output_bytes,
            self.grad_bytes,
            self.transfer_bytes,
            self.plain_later_peak_bytes or self.plain_peak_bytes,
            self.sent_bytes or self.output_bytes,
        )
