"""The trace file format (JSON Lines, versioned): write, read and validate.

One JSON object a line, so that a trace can be streamed, diffed, grepped and cut by hand, and so
that every error names the line at fault. The layout (docs/trace-format.md has the full
description): a header line, then one line per tensor in id order, then one line per event in
program order::

    {"format": "remat-trace", "version": 1, "name": "gpt2", "device": "cpu", "source": "capture", ...}
    {"tensor": 0, "nbytes": 4096, "constant": true, "shape": [32, 32], "dtype": "float32"}
    {"tensor": 1, "nbytes": 0, "alias_of": 0, "shape": [32, 32], "dtype": "float32"}
    {"op": 0, "name": "aten.t.default", "inputs": [0], "outputs": [1], "phase": "forward"}
    {"release": 1}

Reading validates everything (``_Checker``): types and fields, ids, and that the events make a
possible program: nothing is read before it is made or after it is released, nothing is made or
released twice. ``validate`` applies the same checks to a Trace built in memory (an importer's),
``save`` refuses to write a trace that would not read back, and ``load`` also reads a DTR op log
through ``remat.trace.dtr_log``.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
from pathlib import Path
from typing import IO, Any, Literal

from remat._errors import RematValueError, message
from remat.trace.types import Event, Op, Phase, Release, TensorInfo, Trace

__all__ = ["FORMAT", "VERSION", "load", "save", "validate"]

FORMAT = "remat-trace"
VERSION = 1

_TENSOR_FIELDS = {"tensor", "nbytes", "alias_of", "constant", "shape", "dtype", "saved", "saved_at"}
_OP_FIELDS = {
    "op",
    "name",
    "inputs",
    "outputs",
    "mutates",
    "cost",
    "est_cost",
    "phase",
    "module",
    "random",
    "scratch",
    "state",
}
_HEADER_FIELDS = {"format", "version", "name", "device", "source", "tensors", "events"}
_PHASES = {p.value: p for p in Phase}


class _Invalid(Exception):
    """A check failed: ``rule`` (general) and ``detail`` (this record)."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(rule, detail)
        self.rule = rule
        self.detail = detail


class _Checker:
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

    def tensor(self, t: TensorInfo, where: str) -> None:
        n = len(self.tensors)
        if t.id < n:
            raise _Invalid(
                "tensor ids must be unique", f"duplicate tensor id {t.id}, first at {self.where[t.id]}"
            )
        if t.id != n:
            raise _Invalid(
                "tensor ids must be 0, 1, 2, ... in order", f"tensor {t.id} where {n} was expected"
            )
        if t.nbytes < 0:
            raise _Invalid("nbytes must not be negative", f"tensor {t.id} has nbytes {t.nbytes}")
        root = t.id
        if t.alias_of is not None:
            if not 0 <= t.alias_of < t.id:
                raise _Invalid(
                    "alias_of must name an earlier tensor",
                    f"tensor {t.id} aliases unknown tensor {t.alias_of}",
                )
            if t.nbytes != 0:
                raise _Invalid(
                    "an alias owns no bytes (its storage's owner does)",
                    f"tensor {t.id} has nbytes {t.nbytes}",
                )
            if t.constant and not self.tensors[t.alias_of].constant:
                raise _Invalid(
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
                raise _Invalid("a tensor can be released only after it exists", f"tensor {e.tensor}")
            if e.tensor in self.released:
                raise _Invalid(
                    "a tensor can be released only once",
                    f"tensor {e.tensor} was already released at {self.released[e.tensor]}",
                )
            self.released[e.tensor] = where
            self.handles[self.roots[e.tensor]] -= 1
            return
        if e.index != self.ops:
            raise _Invalid(
                "ops must be numbered 0, 1, 2, ... in order", f"op {e.index} where {self.ops} was expected"
            )
        self.ops += 1
        if not e.name:
            raise _Invalid("an op needs a name", f"op {e.index} has an empty name")
        for value, label in ((e.cost, "cost"), (e.est_cost, "est_cost")):
            if not (math.isfinite(value) and value >= 0):
                raise _Invalid("costs must be finite and not negative", f"op {e.index} has {label} {value}")
        if e.scratch < 0:
            raise _Invalid("scratch bytes must not be negative", f"op {e.index} has scratch {e.scratch}")
        if e.state < 0:
            raise _Invalid("state bytes must not be negative", f"op {e.index} has state {e.state}")
        for t in e.inputs:
            self._known(t, f"op {e.index} ({e.name})")
            if t not in self.made:
                raise _Invalid(
                    "an op may read only tensors that exist",
                    f"op {e.index} ({e.name}) reads tensor {t} before it is made",
                )
            if t in self.released:
                raise _Invalid(
                    "an op may read only live tensors",
                    f"op {e.index} ({e.name}) reads tensor {t}, released at {self.released[t]}",
                )
        stray = set(e.mutates) - set(e.inputs)
        if stray:
            raise _Invalid(
                "an op mutates only tensors among its inputs",
                f"op {e.index} ({e.name}) mutates {sorted(stray)}",
            )
        for t in e.outputs:
            self._known(t, f"op {e.index} ({e.name})")
            if t in self.made:
                raise _Invalid(
                    "a tensor is made once, by one op or as a constant",
                    f"op {e.index} ({e.name}) makes tensor {t}, which exists since {self.made[t]}",
                )
            root = self.roots[t]
            if root != t and self.handles[root] == 0:
                raise _Invalid(
                    "an alias needs a live storage",
                    f"op {e.index} ({e.name}) makes tensor {t}, an alias of freed storage {root}",
                )
            self.made[t] = where
            self.handles[root] += 1

    def saved(self, ids: frozenset[int], at: tuple[tuple[int, int], ...], ops: int) -> None:
        unknown = sorted(t for t in ids if not 0 <= t < len(self.tensors))
        if unknown:
            raise _Invalid("saved tensors must be known tensors", f"unknown ids {unknown[:10]}")
        missing = sorted(ids - {t for t, _ in at}) if at else []
        if missing:
            raise _Invalid(
                "when saves are placed, every saved tensor needs a position",
                f"saved tensors {missing[:10]} have no saved_at",
            )
        for t, position in at:
            if t not in ids:
                raise _Invalid("saved_at may name only saved tensors", f"tensor {t} is not saved")
            if not 0 <= position <= ops:
                raise _Invalid(
                    "a save's position must be a number of ops of the trace",
                    f"tensor {t} saved at {position}, the trace has {ops} ops",
                )

    def _known(self, t: int, who: str) -> None:
        if not 0 <= t < len(self.tensors):
            raise _Invalid("events may name only declared tensors", f"{who} names unknown tensor {t}")


def validate(trace: Trace) -> Trace:
    """Check that ``trace`` is consistent (see ``_Checker``); return it unchanged, or raise
    ``RematValueError`` naming the tensor or event at fault."""
    return _validate(trace, "trace.validate", trace.name or "trace")


def _validate(trace: Trace, api: str, label: str) -> Trace:
    checker = _Checker()
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
    except _Invalid as err:
        raise RematValueError(
            message(api, err.rule, f"{label}, {where}: {err.detail}", "fix the trace or capture it again")
        ) from None
    return trace


def save(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` to ``path`` (gzip-compressed if the name ends in ``.gz``), after validating it."""
    _validate(trace, "trace.save", trace.name or "trace")
    with _open(Path(path), "w") as f:
        header = {
            "format": FORMAT,
            "version": VERSION,
            "name": trace.name,
            "device": trace.device,
            "source": trace.source,
            "tensors": len(trace.tensors),
            "events": len(trace.events),
        }
        f.write(_dumps(header))
        at: dict[int, list[int]] = {}
        for tid, position in trace.saved_at:
            at.setdefault(tid, []).append(position)
        for t in trace.tensors:
            f.write(_dumps(_tensor_record(t, t.id in trace.saved, at.get(t.id, []))))
        for e in trace.events:
            f.write(_dumps({"release": e.tensor} if isinstance(e, Release) else _op_record(e)))


def load(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file written by ``save``, or a DTR op log; both are validated."""
    p = Path(path)
    if not p.is_file():
        raise RematValueError(message("trace.load", "no such file", str(p), "pass the path of a trace file"))
    with _open(p, "r") as f:
        first = f.readline()
    header: object = None
    with contextlib.suppress(json.JSONDecodeError):
        header = json.loads(first)
    if isinstance(header, dict) and "format" in header:
        return _read(p)
    try:
        from remat.trace import dtr_log  # imported here: reading our own files does not need it
    except ImportError:
        dtr_log = None  # type: ignore[assignment]
    if dtr_log is not None and dtr_log.looks_like_dtr_log(p):
        return _validate(dtr_log.load_dtr_log(p), "trace.load", str(p))
    raise RematValueError(
        message(
            "trace.load",
            f'line 1 must be a header with "format": "{FORMAT}", or the file a DTR op log',
            f"{p} line 1: {first[:80].strip()!r}",
            "pass a file written by remat.trace.save or a DTR log",
        )
    )


def _read(path: Path) -> Trace:
    checker = _Checker()
    tensors: list[TensorInfo] = []
    events: list[Event] = []
    saved: set[int] = set()
    saved_at: list[tuple[int, int]] = []
    header: dict[str, Any] = {}
    where = "line 1"
    try:
        with _open(path, "r") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"line {lineno}"
                record = _parse_line(line)
                if lineno == 1:
                    header = _header(record)
                elif "tensor" in record:
                    if events:
                        raise _Invalid(
                            "tensor lines must come before event lines", f"tensor {record['tensor']}"
                        )
                    t = _tensor(record)
                    checker.tensor(t, where)
                    tensors.append(t)
                    if record.get("saved", False):
                        saved.add(t.id)
                    saved_at.extend((t.id, position) for position in _positions(record, t.id))
                elif "op" in record or "release" in record:
                    e = _op(record) if "op" in record else _release(record)
                    checker.event(e, where)
                    events.append(e)
                else:
                    raise _Invalid(
                        'each line after the header is a "tensor", "op" or "release"',
                        f"keys {sorted(record)}",
                    )
            where = "end of file"
            if not header:
                raise _Invalid("the file must start with a header line", "the file is empty")
            checker.saved(frozenset(saved), tuple(saved_at), sum(isinstance(e, Op) for e in events))
            for key, got in (("tensors", len(tensors)), ("events", len(events))):
                if header[key] != got:
                    raise _Invalid(
                        "the header's counts must match the file (is it truncated?)",
                        f"header announces {header[key]} {key}, the file has {got}",
                    )
    except _Invalid as err:
        raise RematValueError(
            message(
                "trace.load",
                err.rule,
                f"{path} {where}: {err.detail}",
                "fix the file or capture the step again",
            )
        ) from None
    except (OSError, UnicodeDecodeError, EOFError) as err:
        raise RematValueError(
            message("trace.load", "the file could not be read", f"{path} {where}: {err}", "check the file")
        ) from None
    return Trace(
        tuple(tensors),
        tuple(events),
        frozenset(saved),
        name=header["name"],
        device=header["device"],
        source=header["source"],
        saved_at=tuple(saved_at),
    )


# -- records ------------------------------------------------------------------------------------


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"


def _positions(record: dict[str, Any], tid: int) -> list[int]:
    positions = record.get("saved_at", [])
    if not (isinstance(positions, list) and all(_is_count(p) for p in positions)):
        raise _Invalid("saved_at must be a list of op counts", f"tensor {tid} has saved_at {positions!r}")
    return positions


def _tensor_record(t: TensorInfo, saved: bool, saved_at: list[int]) -> dict[str, Any]:
    record: dict[str, Any] = {"tensor": t.id, "nbytes": t.nbytes}
    if t.alias_of is not None:
        record["alias_of"] = t.alias_of
    if t.constant:
        record["constant"] = True
    if t.shape is not None:
        record["shape"] = list(t.shape)
    if t.dtype is not None:
        record["dtype"] = t.dtype
    if saved:
        record["saved"] = True
    if saved_at:
        record["saved_at"] = saved_at
    return record


def _op_record(op: Op) -> dict[str, Any]:
    record: dict[str, Any] = {
        "op": op.index,
        "name": op.name,
        "inputs": list(op.inputs),
        "outputs": list(op.outputs),
    }
    if op.mutates:
        record["mutates"] = list(op.mutates)
    if op.cost:
        record["cost"] = op.cost
    if op.est_cost:
        record["est_cost"] = op.est_cost
    record["phase"] = op.phase.value
    if op.module:
        record["module"] = op.module
    if op.random:
        record["random"] = True
    if op.scratch:
        record["scratch"] = op.scratch
    if op.state:
        record["state"] = op.state
    return record


def _parse_line(line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise _Invalid(
            "each line must be one JSON object", f"not JSON: {err.msg} at column {err.colno}"
        ) from None
    if not isinstance(record, dict):
        raise _Invalid("each line must be one JSON object", f"got a {type(record).__name__}")
    return record


def _header(record: dict[str, Any]) -> dict[str, Any]:
    if record.get("format") != FORMAT:
        raise _Invalid(
            f'line 1 must be the header, with "format": "{FORMAT}"', f"format {record.get('format')!r}"
        )
    if record.get("version") != VERSION:
        raise _Invalid(
            f"unsupported format version (this remat reads version {VERSION})",
            f"version {record.get('version')!r}",
        )
    _fields(record, _HEADER_FIELDS, "header")
    for key in ("name", "device", "source"):
        _typed(record, key, str, "header")
    for key in ("tensors", "events"):
        _count(record, key, "header")
    return record


def _tensor(record: dict[str, Any]) -> TensorInfo:
    _fields(record, _TENSOR_FIELDS, "tensor line")
    tid = _count(record, "tensor", "tensor line")
    what = f"tensor {tid}"
    shape = record.get("shape")
    if shape is not None and not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
        raise _Invalid("shape must be a list of non-negative integers", f"{what} has shape {shape!r}")
    alias_of = record.get("alias_of")
    if alias_of is not None and not _is_count(alias_of):
        raise _Invalid("alias_of must be a tensor id", f"{what} has alias_of {alias_of!r}")
    dtype = record.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise _Invalid("dtype must be a string", f"{what} has dtype {dtype!r}")
    return TensorInfo(
        id=tid,
        nbytes=_typed(record, "nbytes", int, what),
        alias_of=alias_of,
        constant=_typed(record, "constant", bool, what, False),
        shape=tuple(shape) if shape is not None else None,
        dtype=dtype,
    )


def _op(record: dict[str, Any]) -> Op:
    _fields(record, _OP_FIELDS, "op line")
    index = _count(record, "op", "op line")
    what = f"op {index}"
    phase = record.get("phase", Phase.UNKNOWN.value)
    if phase not in _PHASES:
        raise _Invalid(f"phase must be one of {', '.join(_PHASES)}", f"{what} has phase {phase!r}")
    return Op(
        index=index,
        name=_typed(record, "name", str, what),
        inputs=_ids(record, "inputs", what),
        outputs=_ids(record, "outputs", what),
        mutates=_ids(record, "mutates", what, required=False),
        cost=_number(record, "cost", what),
        est_cost=_number(record, "est_cost", what),
        phase=_PHASES[phase],
        module=_typed(record, "module", str, what, ""),
        random=_typed(record, "random", bool, what, False),
        scratch=_typed(record, "scratch", int, what, 0),
        state=_typed(record, "state", int, what, 0),
    )


def _release(record: dict[str, Any]) -> Release:
    _fields(record, {"release"}, "release line")
    tensor = record["release"]
    if not _is_count(tensor):
        raise _Invalid("a release names one tensor id", f"release {tensor!r}")
    return Release(tensor)


def _fields(record: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(record) - allowed)
    if unknown:
        raise _Invalid(f"unknown field in a {what}", f"{', '.join(map(repr, unknown))}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(record: dict[str, Any], key: str, what: str) -> int:
    value = record.get(key)
    if not _is_count(value):
        raise _Invalid(f'"{key}" must be a non-negative integer', f"{what} has {key} {value!r}")
    return int(value)  # type: ignore[arg-type]


_MISSING = object()


def _typed(record: dict[str, Any], key: str, kind: type, what: str, default: Any = _MISSING) -> Any:
    if key not in record:
        if default is _MISSING:
            raise _Invalid(f'"{key}" is required', f"{what} has no {key}")
        return default
    value = record[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _Invalid(f'"{key}" must be of type {kind.__name__}', f"{what} has {key} {value!r}")
    return value


def _number(record: dict[str, Any], key: str, what: str) -> float:
    value = record.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid(f'"{key}" must be a number of seconds', f"{what} has {key} {value!r}")
    return float(value)


def _ids(record: dict[str, Any], key: str, what: str, required: bool = True) -> tuple[int, ...]:
    if key not in record and not required:
        return ()
    value = record.get(key)
    if not isinstance(value, list) or not all(_is_count(v) for v in value):
        raise _Invalid(f'"{key}" must be a list of tensor ids', f"{what} has {key} {value!r}")
    return tuple(value)


def _open(path: Path, mode: Literal["r", "w"]) -> IO[str]:
    if path.suffix != ".gz":
        return open(path, mode, encoding="utf-8", newline="\n")
    if mode == "w":
        return gzip.open(path, "wt", encoding="utf-8", newline="\n")
    return gzip.open(path, "rt", encoding="utf-8", newline="\n")
