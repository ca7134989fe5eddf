"""The Plan: what ``remat.plan`` decided for one training step, as plain data that saves and loads.

Why a type apart from the solver's Solution: a Solution speaks of stages and nodes of a problem,
while a user (and the executor) needs the step itself: which tensors autograd saves are kept or
recomputed and why, which ops run inside a recomputed region, and the op sequence the plan was
made for, so that running it on a model that takes another path fails loudly instead of silently
keeping the wrong tensors. A Plan holds no tensors and no model: it applies to any model that runs
the same ops (a copy, a reloaded checkpoint), and its JSON form is stable (``FORMAT``).

Positions: ops are numbered by their position among the ops the model's forward runs (``ops``),
which is what the executor counts; ``TensorDecision.op`` and ``Region`` use those positions.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._files import read_json, writable, write_text
from remat._modules import parameters
from remat._units import format_bytes, whole
from remat.host.link import Link
from remat.manual.fused import ReplayMode
from remat.planner.execute import Check, apply
from remat.planner.explain import render
from remat.planner.offload_execute import apply_offload
from remat.planner.regions import Region, TensorDecision
from remat.policy import Decision

__all__ = ["FORMAT", "Plan"]

FORMAT = "remat.plan/1"


@dataclass(frozen=True)
class Plan:
    """A recomputation plan for one training step (see ``remat.plan``).

    ``predicted_peak_bytes`` is the peak of the bytes the step adds, tensors and kernels' scratch
    buffers (what ``remat.memory.track(allocator=True)`` measures around forward and backward)
    when the plan runs, and
    ``baseline_peak_bytes`` the same with no recomputation; ``predicted_overhead`` is the step's
    compute with the recomputation ÷ without. ``solver``, ``solve_seconds`` and ``gap`` (the
    proven optimality gap of the solver's own model, None for a heuristic) say how the plan was
    found; ``notes`` carries the solver's remarks. ``predicted_held_bytes`` is what the step holds
    when its forward ends, for backward (a pipeline stage holds it per micro-batch in flight).
    ``predicted_executor_overhead`` is the executor's own part of ``predicted_overhead`` (its
    per-op check, tapes, replays and offload bookkeeping ÷ the plain step's compute, NOTE
    [executor cost] in ``remat.planner.cost_model``). ``shapes`` is, per forward op, its first
    result as the trace saw it (``float32[8, 64]``, or empty where unknown): the executor checks
    each op against it, since a plan predicts the memory of the shapes it was made for.
    ``trainable`` is, per parameter of the model it was made for, whether it required grad: which
    tensors autograd saves depends on it, and ``apply`` refuses a model trained otherwise (empty:
    not known, a plan made from a trace). ``device`` is the device type the step was traced on
    (empty: not known): a plan made on ``meta`` predicts no allocator's bytes (no kernel ran), and
    ``apply`` refuses it for a model elsewhere."""

    name: str
    solver: str
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float
    baseline_peak_bytes: int
    peak_at: str
    solve_seconds: float
    gap: float | None
    regions: tuple[Region, ...]
    tensors: tuple[TensorDecision, ...]
    ops: tuple[str, ...]
    modules: tuple[str, ...]
    notes: str = ""
    predicted_held_bytes: int = 0
    link: Link | None = None
    predicted_stall: float = 0.0
    predicted_executor_overhead: float = 0.0
    shapes: tuple[str, ...] = ()
    host_budget: int | None = None  # with ``link``: the host bytes the plan keeps to, and its run
    trainable: tuple[bool, ...] = ()
    device: str = ""

    # -- reading it ---------------------------------------------------------------------------

    @property
    def saved_bytes(self) -> int:
        """Bytes of the saved-for-backward tensors the plan keeps."""
        return sum(t.nbytes for t in self.tensors if t.action is Decision.SAVE)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the saved-for-backward tensors the plan moves to the host."""
        return sum(t.nbytes for t in self.tensors if t.action is Decision.OFFLOAD)

    @property
    def recomputed_bytes(self) -> int:
        """Bytes of the saved-for-backward tensors the plan recomputes."""
        return sum(t.nbytes for t in self.tensors if t.action is Decision.RECOMPUTE)

    def region_of(self, position: int) -> Region | None:
        """The region op ``position`` runs in, or None."""
        position = whole(position)
        if isinstance(position, bool) or not isinstance(position, int):
            rule = "an op's position is a whole number (its index among the traced forward's ops)"
            raise RematTypeError(message("plan.region_of", rule, f"got {position!r}", "pass e.g. 0"))
        for region in self.regions:
            if position in region:
                return region
        return None

    def __str__(self) -> str:
        gap = (
            "a heuristic plan (no bound on how far from the cheapest)"
            if self.gap is None
            else f"at most {self.gap:.2%} costlier than the cheapest plan of the solver's model"
        )
        recomputed = sum(t.action is Decision.RECOMPUTE for t in self.tensors)
        return (
            f"Plan({self.name or 'model'}, {self.solver}: peak {format_bytes(self.predicted_peak_bytes)} "
            f"of budget {format_bytes(self.budget_bytes)} (no recomputation: "
            f"{format_bytes(self.baseline_peak_bytes)}), overhead {self.predicted_overhead:.3f}, "
            f"{recomputed}/{len(self.tensors)} saved tensors recomputed in {len(self.regions)} regions, "
            f"{gap}, solved in {self.solve_seconds:.2f} s)"
            + (f", {self.offload_summary()}" if self.link is not None else "")
        )

    def offload_summary(self) -> str:
        """What the plan moves to the host over its link, and the stall it predicts."""
        moved = sum(t.action is Decision.OFFLOAD for t in self.tensors)
        return (
            f"{moved} saved tensors ({format_bytes(self.offloaded_bytes)}) offloaded over {self.link}, "
            f"predicted stall {self.predicted_stall * 1e3:.3f} ms"
        )

    def explain(self, file: Any = None) -> None:
        """Print (to ``file``, default stdout) a per-module table: what each module saves for
        backward, what the plan keeps, recomputes and offloads, and the regions; then each
        offloaded tensor, when it goes to the host and comes back, and the predicted stall. It
        returns nothing, so that a REPL shows the table once."""
        writable(file, "plan.explain")
        summary = self.offload_summary() if self.link is not None else ""
        render(
            str(self),
            self.tensors,
            self.regions,
            self.modules,
            self.notes,
            self.peak_at,
            file,
            summary,
            (self.predicted_overhead, self.predicted_executor_overhead),
        )

    # -- running it ---------------------------------------------------------------------------

    def apply(
        self, model: nn.Module, replay: ReplayMode = "eager", check: Check = "first"
    ) -> AbstractContextManager[None]:
        """``with plan.apply(model): loss = loss_fn(model, *inputs)``: run the model's forward
        under the plan (backward may run inside or after the block). Each forward is checked op by
        op against the traced step; a model that takes another path raises RecomputationError
        naming the op, the expected and the executed op, and the module. Where every region is
        one call of one module (a layer, an MLP: ``Region.anchor``), only the first forward in each
        setting is (train or eval mode, autocast, argument shapes and dtypes: NOTE [bare forward]
        in ``remat.planner.module_calls``), and later ones run with no Python per op outside the
        taped regions, as ``torch.utils.checkpoint`` does; ``check="every"`` checks every forward.

        ``replay="compiled"``: the regions' runs of deterministic ops replay through
        ``torch.compile``d graphs, fused (see ``remat.scope``), compiled in the first backward. The
        predicted overhead stays that of eager replay, an upper bound of what fusion costs.

        OFFLOAD decisions run through ``remat.host``: the saved outputs of the planned ops wait in
        host memory and come back when backward needs them (``remat.planner.offload_execute``)."""
        now = trainable(model) if isinstance(model, nn.Module) else self.trainable
        if self.trainable and len(now) != len(self.trainable):
            rule = "the plan runs the model it was made for"
            given = f"a model of {len(now)} parameters, planned with {len(self.trainable)}"
            raise RematValueError(message("plan.apply", rule, given, "plan this model (remat.plan)"))
        if self.trainable and now != self.trainable:
            rule = "the model's parameters require grad otherwise than when the plan was made"
            given = f"{sum(now)} of {len(now)} require grad, {sum(self.trainable)} of {len(self.trainable)}"
            hint = "plan again with the parameters frozen as they will train (autograd saves other tensors)"
            raise RematValueError(message("plan.apply", rule, given + " did", hint))
        if self.device == "meta" and isinstance(model, nn.Module):
            real = {t.device.type for t in (*model.parameters(), *model.buffers())} - {"meta"}
            if real:
                rule = "a plan made on the meta device predicts no real memory (no kernel ran)"
                given = f"made on meta, the model's tensors are on {', '.join(sorted(real))}"
                hint = "plan with the model and inputs on the device it trains on"
                raise RematValueError(message("plan.apply", rule, given, hint))
        moved = frozenset(t.op for t in self.tensors if t.action is Decision.OFFLOAD)
        if moved:
            where = (self.regions, self.ops, self.modules, model, replay, moved, self.link, self.shapes)
            return apply_offload(*where, host_budget=self.host_budget)
        return apply(self.regions, self.ops, self.modules, model, replay, shapes=self.shapes, check=check)

    # -- storing it ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The stable serialized form (``FORMAT``)."""
        body = asdict(self)
        body["regions"] = [
            {"name": r.name, "first": r.first, "last": r.last, "save": sorted(r.save)}
            | ({"rerun": r.rerun} if r.rerun else {})
            | ({"anchor": r.anchor} if r.anchor else {})
            for r in self.regions
        ]
        body["tensors"] = [{**asdict(t), "action": t.action.value} for t in self.tensors]
        body["ops"] = list(self.ops)
        body["modules"] = list(self.modules)
        body["shapes"] = list(self.shapes)
        if self.gap is not None and not math.isfinite(self.gap):
            body["gap"] = None
        return {"format": FORMAT, **body}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Plan:
        """The Plan ``to_json`` wrote; a RematValueError for another format."""
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            got = body.get("format") if isinstance(body, dict) else type(body).__name__
            raise RematValueError(
                message("plan.load", f"not a {FORMAT} plan", f"format {got!r}", "load a file plan.save wrote")
            )
        try:
            fields = {k: v for k, v in body.items() if k != "format"}
            fields["regions"] = tuple(
                Region(
                    r["name"],
                    _whole(r["first"]),
                    _whole(r["last"]),
                    _positions(r["save"], _whole(r["first"]), _whole(r["last"])),
                    str(r.get("rerun", "")),
                    str(r.get("anchor", "")),
                )
                for r in fields["regions"]
            )
            fields["tensors"] = tuple(
                TensorDecision(**{**t, "action": Decision(t["action"])}) for t in fields["tensors"]
            )
            for key in ("ops", "modules"):
                if not isinstance(fields[key], list) or not all(isinstance(x, str) for x in fields[key]):
                    raise ValueError(f"{key} must list names: {fields[key]!r}"[:200])
            if not all(isinstance(r.name, str) for r in fields["regions"]):
                raise ValueError("a region's name must be a string")
            fields["ops"] = tuple(fields["ops"])
            fields["modules"] = tuple(fields["modules"])
            fields["shapes"] = tuple(str(x) for x in fields.get("shapes", ()))
            fields["device"] = str(fields.get("device", ""))
            if len(fields["shapes"]) not in (0, len(fields["ops"])) or len(fields["modules"]) != len(
                fields["ops"]
            ):
                raise ValueError("ops, modules and shapes must name the same forward ops")
            ends = [(r.first, r.last) for r in sorted(fields["regions"], key=lambda r: r.first)]
            if any(a > b or b >= len(fields["ops"]) or a < 0 for a, b in ends) or any(
                b >= c for (_, b), (c, _) in zip(ends, ends[1:], strict=False)
            ):
                raise ValueError(
                    f"regions must be disjoint spans of the {len(fields['ops'])} forward ops: {ends}"
                )
            if any(not 0 <= t.op < len(fields["ops"]) for t in fields["tensors"]):
                raise ValueError(
                    f"a tensor's op must be a position among the {len(fields['ops'])} forward ops"
                )
            _scalars(fields)
            fields["trainable"] = tuple(fields.get("trainable", ()))
            fields["link"] = Link(**fields["link"]) if fields.get("link") else None
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as err:
            raise RematValueError(
                message("plan.load", "the plan file is incomplete or damaged", err, "save the plan again")
            ) from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON to ``path``."""
        write_text(path, json.dumps(self.to_json(), indent=1) + "\n", "plan.save")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """The plan ``save`` wrote to ``path``."""
        body = read_json(path, "plan.load", "plan.save")
        return cls.from_json(body)


def _positions(save: Any, first: int, last: int) -> frozenset[int]:
    """A region's kept op positions from a plan file: whole numbers within the region."""
    if not isinstance(save, list) or any(type(i) is not int or not first <= i <= last for i in save):
        raise ValueError(f"a region's save must list op positions from {first} to {last}: {save!r}"[:200])
    return frozenset(save)


_COUNTS = ("budget_bytes", "predicted_peak_bytes", "baseline_peak_bytes", "predicted_held_bytes")
_NUMBERS = ("predicted_overhead", "solve_seconds", "predicted_stall", "predicted_executor_overhead")
_TEXTS = ("name", "solver", "peak_at", "notes")


def _whole(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"an op position must be a whole number: {value!r}"[:200])
    return value


def _scalars(fields: dict[str, Any]) -> None:
    """The plan file's figures and names of the types ``Plan`` holds (an edited file may not)."""
    for key in _COUNTS:
        if key in fields and (type(fields[key]) is not int or fields[key] < 0):
            raise ValueError(f"{key} must be a byte count: {fields[key]!r}"[:200])
    for key in (*_NUMBERS, "gap"):
        value = fields.get(key)
        if key not in fields or (key == "gap" and value is None):
            continue
        if not _figure(value):
            raise ValueError(f"{key} must be a finite number, at least 0: {value!r}"[:200])
    for key in _TEXTS:
        if key in fields and not isinstance(fields[key], str):
            raise ValueError(f"{key} must be text: {fields[key]!r}"[:200])
    for t in fields["tensors"]:
        named = all(isinstance(x, str) for x in (t.op_name, t.module, t.reason))
        if (
            type(t.op) is not int
            or type(t.nbytes) is not int
            or t.nbytes < 0
            or not named
            or not _figure(t.seconds)
        ):
            raise ValueError(f"a tensor's entry is damaged: {t!r}"[:200])
    trainable = fields.get("trainable", [])
    if not isinstance(trainable, (list, tuple)) or not all(isinstance(x, bool) for x in trainable):
        raise ValueError(f"trainable must list true or false per parameter: {trainable!r}"[:200])
    host = fields.get("host_budget")
    if host is not None and (type(host) is not int or host <= 0):
        raise ValueError(f"host_budget must be a byte count or null: {host!r}"[:200])


def _figure(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def trainable(model: nn.Module) -> tuple[bool, ...]:
    """Per parameter of ``model``, whether it requires grad (``Plan.trainable``)."""
    return tuple(p.requires_grad for p in parameters(model))
