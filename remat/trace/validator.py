"""The consistency rules of a trace: what makes its tensors and events a possible program.

``Checker`` is fed one record at a time with where it came from ("line 7", "event 3"), so that the
codec (``remat.trace.codec``) checks a file while it reads it and names the line at fault, and
``validate`` checks a Trace built in memory (an importer's, a hand-made one) and names the tensor
or event. The rules: ids are unique and in order; nothing is read before it is made or after it is
released; nothing is made or released twice; an alias needs a live storage; saves name known
tensors at positions within the trace.
"""

from __future__ import annotations

import math

from remat._errors import RematTypeError, RematValueError, message
from remat.trace.types import Event, Release, TensorInfo, Trace

__all__ = ["TOTAL_LIMIT", "Checker", "Invalid", "checked", "validate"]

TOTAL_LIMIT = 1 << 60  # bytes, all tensors of a step together (an exabyte; a pool holds 2**62)


class Invalid(Exception):
    """A check failed: ``rule`` (general) and ``detail`` (this record). The codec raises it too,
    for a record it cannot decode, so that both end in one error message."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(rule, detail)
        self.rule = rule
        self.detail = detail


class Checker:
    """Consistency of a trace, fed one record at a time with where it came from ("line 7", "event 3").

    See NOTE [liveness semantics] in ``remat.trace.liveness`` for the memory model the rules protect.
    """

    def __init__(self) -> None:
        self.tensors: list[TensorInfo] = []
        self.where: list[str] = []  # per tensor: where it was declared
        self.made: dict[int, str] = {}  # tensor -> where it came to exist
        self.released: dict[int, str] = {}  # tensor -> where it was released
        self.roots: list[int] = []
        self.handles: list[int] = []  # per root: live handles of its storage
        self.ops = 0
        self.total = 0  # bytes the tensors own

    def tensor(self, t: TensorInfo, where: str) -> None:
        n = len(self.tensors)
        if t.id < n:
            raise Invalid(
                "tensor ids must be unique", f"duplicate tensor id {t.id}, first at {self.where[t.id]}"
            )
        if t.id != n:
            raise Invalid("tensor ids must be 0, 1, 2, ... in order", f"tensor {t.id} where {n} was expected")
        if t.nbytes < 0:
            raise Invalid("nbytes must not be negative", f"tensor {t.id} has nbytes {t.nbytes}")
        self.total += t.nbytes
        if self.total > TOTAL_LIMIT:  # past what an address pool can hold: a damaged size
            raise Invalid(
                "the tensors own at most 2**60 bytes in all", f"tensor {t.id} has nbytes {t.nbytes}"
            )
        root = t.id
        if t.alias_of is not None:
            if not 0 <= t.alias_of < t.id:
                raise Invalid(
                    "alias_of must name an earlier tensor",
                    f"tensor {t.id} aliases unknown tensor {t.alias_of}",
                )
            if t.nbytes != 0:
                raise Invalid(
                    "an alias owns no bytes (its storage's owner does)",
                    f"tensor {t.id} has nbytes {t.nbytes}",
                )
            if t.constant and not self.tensors[t.alias_of].constant:
                raise Invalid(
                    "a constant cannot alias a tensor the step makes",
                    f"constant {t.id} aliases non-constant {t.alias_of}",
                )
            root = self.roots[t.alias_of]
        self.tensors.append(t)
        self.where.append(where)
        self.roots.append(root)
        self.handles.append(0)
        if t.constant:
            self.made[t.id] = where
            self.handles[root] += 1

    def event(self, e: Event, where: str) -> None:
        if isinstance(e, Release):
            self._known(e.tensor, "a release")
            if e.tensor not in self.made:
                raise Invalid("a tensor can be released only after it exists", f"tensor {e.tensor}")
            if e.tensor in self.released:
                raise Invalid(
                    "a tensor can be released only once",
                    f"tensor {e.tensor} was already released at {self.released[e.tensor]}",
                )
            self.released[e.tensor] = where
            self.handles[self.roots[e.tensor]] -= 1
            return
        if e.index != self.ops:
            raise Invalid(
                "ops must be numbered 0, 1, 2, ... in order", f"op {e.index} where {self.ops} was expected"
            )
        self.ops += 1
        if not e.name:
            raise Invalid("an op needs a name", f"op {e.index} has an empty name")
        for value, label in ((e.cost, "cost"), (e.est_cost, "est_cost")):
            if not (math.isfinite(value) and value >= 0):
                raise Invalid("costs must be finite and not negative", f"op {e.index} has {label} {value}")
        if e.scratch < 0:
            raise Invalid("scratch bytes must not be negative", f"op {e.index} has scratch {e.scratch}")
        if e.state < 0:
            raise Invalid("state bytes must not be negative", f"op {e.index} has state {e.state}")
        for t in e.inputs:
            self._known(t, f"op {e.index} ({e.name})")
            if t not in self.made:
                raise Invalid(
                    "an op may read only tensors that exist",
                    f"op {e.index} ({e.name}) reads tensor {t} before it is made",
                )
            if t in self.released:
                raise Invalid(
                    "an op may read only live tensors",
                    f"op {e.index} ({e.name}) reads tensor {t}, released at {self.released[t]}",
                )
        stray = set(e.mutates) - set(e.inputs)
        if stray:
            raise Invalid(
                "an op mutates only tensors among its inputs",
                f"op {e.index} ({e.name}) mutates {sorted(stray)}",
            )
        for t in e.outputs:
            self._known(t, f"op {e.index} ({e.name})")
            if t in self.made:
                raise Invalid(
                    "a tensor is made once, by one op or as a constant",
                    f"op {e.index} ({e.name}) makes tensor {t}, which exists since {self.made[t]}",
                )
            root = self.roots[t]
            if root != t and self.handles[root] == 0:
                raise Invalid(
                    "an alias needs a live storage",
                    f"op {e.index} ({e.name}) makes tensor {t}, an alias of freed storage {root}",
                )
            self.made[t] = where
            self.handles[root] += 1

    def saved(self, ids: frozenset[int], at: tuple[tuple[int, int], ...], ops: int) -> None:
        unknown = sorted(t for t in ids if not 0 <= t < len(self.tensors))
        if unknown:
            raise Invalid("saved tensors must be known tensors", f"unknown ids {unknown[:10]}")
        missing = sorted(ids - {t for t, _ in at}) if at else []
        if missing:
            raise Invalid(
                "when saves are placed, every saved tensor needs a position",
                f"saved tensors {missing[:10]} have no saved_at",
            )
        for t, position in at:
            if t not in ids:
                raise Invalid("saved_at may name only saved tensors", f"tensor {t} is not saved")
            if not 0 <= position <= ops:
                raise Invalid(
                    "a save's position must be a number of ops of the trace",
                    f"tensor {t} saved at {position}, the trace has {ops} ops",
                )

    def _known(self, t: int, who: str) -> None:
        if not 0 <= t < len(self.tensors):
            raise Invalid("events may name only declared tensors", f"{who} names unknown tensor {t}")


def validate(trace: Trace) -> Trace:
    """Check that ``trace`` is consistent (see ``Checker``); return it unchanged, or raise
    ``RematValueError`` naming the tensor or event at fault."""
    return checked(trace, "trace.validate", trace.name if isinstance(trace, Trace) else "trace")


def checked(trace: Trace, api: str, label: str) -> Trace:
    """``validate`` for ``api`` (``"trace.save"``, ``"trace.load"``), naming ``label`` in errors."""
    if not isinstance(trace, Trace):
        raise RematTypeError(
            message(
                api,
                "a trace is a remat.trace.Trace",
                f"got {type(trace).__name__}",
                "pass remat.trace.load's",
            )
        )
    checker = Checker()
    where = "tensor 0"
    try:
        for i, t in enumerate(trace.tensors):
            where = f"tensor {i}"
            checker.tensor(t, where)
        for i, e in enumerate(trace.events):
            where = f"event {i}"
            checker.event(e, where)
        where = "saved"
        checker.saved(trace.saved, trace.saved_at, len(trace.ops))
    except Invalid as err:
        raise RematValueError(
            message(api, err.rule, f"{label}, {where}: {err.detail}", "fix the trace or capture it again")
        ) from None
    return trace
