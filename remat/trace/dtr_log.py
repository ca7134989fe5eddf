"""Importer for the op logs of the Dynamic Tensor Rematerialization artifact (Kirisame et al., 2021).

The logs are real workloads that nobody here wrote, with op times measured on a GPU, so they are the
yardstick for the simulator (``remat.sim``): the DTR authors published what their own simulator makes
of them. This module turns one log into a :class:`~remat.trace.types.Trace`, keeping the program as
it was written and leaving every runtime decision (how a mutation is served, when a dead constant may
go) to the runtime that runs it.

The format is one JSON object per line, ``INSTRUCTION`` saying which. These are all the kinds the
artifact's own parser (``simrd/simrd/parse/parse.py``) accepts; ``data/dtr/README.md`` has the table:

- ``CONSTANT x`` then ``MEMORY x n``: a tensor from outside the step (parameter, input, scalar).
  Following the Trace convention, constants exist before the first event.
- ``CALL name ARGS RESULT TIME`` then, per result, ``MEMORY r n`` and ``ALIAS r k``: an op; ``k`` is
  -1 for a fresh storage, else the index of the argument whose storage the result shares.
- ``MUTATE name ARGS MUTATE TIME``: an in-place op writing the arguments at positions ``MUTATE``.
- ``COPY DST SRC``: a new handle ``DST`` to the tensor ``SRC``. It becomes a zero-cost op named
  ``"alias"`` whose output aliases ``SRC``.
- ``COPY_FROM DST SRC``: the live handle ``DST`` now holds ``SRC``'s tensor: the same ``"alias"`` op
  makes ``DST``'s new tensor, then its old one is released.
- ``RELEASE x``: the program dropped handle ``x``.
- ``ANNOTATE START|BACKWARD``: phase marks. ``Op.phase`` is UNKNOWN before START, FORWARD after it,
  BACKWARD from the BACKWARD mark or from the first op whose name contains ``backward``, as the
  artifact decides; the phase never goes back (a later START leaves BACKWARD as it is).

TIME is in nanoseconds and becomes ``Op.cost`` in seconds. ``alias_of`` points at the argument an
output aliases (the immediate source, which is alive when the op runs); follow the chain to reach
the tensor that owns the storage. Every line must be one of these; anything else is an error.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from remat._errors import RematValueError, message
from remat.trace.builder import TraceBuilder
from remat.trace.types import Phase, Trace

_API = "trace.load_dtr_log"
_INSTRUCTIONS = frozenset(
    {"CONSTANT", "MEMORY", "CALL", "MUTATE", "COPY", "COPY_FROM", "RELEASE", "ANNOTATE", "ALIAS"}
)
_NS = 1e-9


def _open(path: str | os.PathLike[str]) -> IO[str]:
    """The log's text, through gzip where its name ends in ``.gz`` (as ``remat.trace.load`` reads)."""
    if os.fspath(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def looks_like_dtr_log(path: str | os.PathLike[str]) -> bool:
    """True when the first non-empty line of ``path`` is a DTR log instruction. Never raises."""
    try:
        with _open(path) as file:
            for line in file:
                if line.strip():
                    record = json.loads(line)
                    return isinstance(record, dict) and record.get("INSTRUCTION") in _INSTRUCTIONS
    except (OSError, EOFError, UnicodeDecodeError, ValueError):
        return False
    return False


def load_dtr_log(path: str | os.PathLike[str]) -> Trace:
    """Read a DTR op log into a Trace (see the module docstring for the mapping)."""
    builder = _Builder()
    number = 0
    try:
        with _open(path) as file:
            for number, line in enumerate(file, start=1):
                if line.strip():
                    builder.feed(number, _parse(number, line))
    except UnicodeDecodeError as error:
        raise _error(number + 1, f"not UTF-8 text ({error.reason} at byte {error.start})") from None
    builder.finish()
    return builder.trace(Path(path).stem, device="cuda", source="dtr")


def _parse(number: int, line: str) -> dict[str, object]:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as error:  # RecursionError: nesting too deep
        raise _error(number, f"not valid JSON ({error})"[:200]) from None
    if not isinstance(record, dict) or record.get("INSTRUCTION") not in _INSTRUCTIONS:
        raise _error(number, f"not a DTR instruction: {line.strip()[:80]!r}")
    return record


def _error(number: int, reason: str) -> RematValueError:
    return RematValueError(
        message(_API, "malformed DTR log line", f"line {number}: {reason}", "check the file is a DTR op log")
    )


@dataclass
class _PendingCall:
    """A CALL whose results still wait for their MEMORY and ALIAS lines."""

    line: int
    name: str
    args: tuple[int, ...]
    results: tuple[str, ...]
    cost: float
    memory: dict[str, int] = field(default_factory=dict)
    alias: dict[str, int] = field(default_factory=dict)

    def complete(self) -> bool:
        return len(self.memory) == len(self.alias) == len(self.results)


class _Builder(TraceBuilder):
    """Accumulates tensors and events while walking the log line by line."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[str, int] = {}
        self.phase = Phase.UNKNOWN
        self.constant: tuple[int, str] | None = None  # a CONSTANT waiting for its MEMORY line
        self.call: _PendingCall | None = None

    def feed(self, number: int, record: dict[str, object]) -> None:
        kind = record["INSTRUCTION"]
        if self.call is not None and kind not in ("MEMORY", "ALIAS"):
            raise _error(self.call.line, f"CALL {self.call.name} lacks MEMORY/ALIAS lines for its results")
        if self.constant is not None and kind != "MEMORY":
            raise _error(self.constant[0], f"CONSTANT {self.constant[1]} is not followed by its MEMORY line")
        if kind == "CONSTANT":
            name = _string(number, record, "NAME")
            self._check_new(number, name)
            self.constant = (number, name)
        elif kind == "MEMORY":
            self._memory(number, record)
        elif kind == "ALIAS":
            self._alias(number, record)
        elif kind == "CALL":
            name = _string(number, record, "NAME")
            self._op_phase(name)
            self.call = _PendingCall(
                line=number,
                name=name,
                args=self._handles(number, record, "ARGS"),
                results=tuple(_strings(number, record, "RESULT")),
                cost=_time(number, record),
            )
            for result in self.call.results:
                self._check_new(number, result)
            if len(set(self.call.results)) != len(self.call.results):
                raise _error(number, "a result name repeats")
            if not self.call.results:
                self._emit_call()
        elif kind == "MUTATE":
            self._mutate(number, record)
        elif kind == "COPY":
            source = self._lookup(number, _string(number, record, "SRC"))
            dst = _string(number, record, "DST")
            self._check_new(number, dst)
            self._handle(dst, source)
        elif kind == "COPY_FROM":
            source = self._lookup(number, _string(number, record, "SRC"))
            dst = _string(number, record, "DST")
            old = self._lookup(number, dst)
            # The new handle is made before the old one goes: SRC may be DST itself, or share its
            # storage, and must still be alive when the alias op reads it.
            self._handle(dst, source)
            self.release(old)
        elif kind == "RELEASE":
            self.release(self._lookup(number, _string(number, record, "NAME")))
        else:  # ANNOTATE
            annotation = _string(number, record, "ANNOTATION")
            if annotation == "START":
                if self.phase is Phase.UNKNOWN:
                    self.phase = Phase.FORWARD
            elif annotation == "BACKWARD":
                self.phase = Phase.BACKWARD
            else:
                raise _error(number, f"unknown annotation {annotation!r} (START or BACKWARD expected)")

    def finish(self) -> None:
        if self.call is not None:
            raise _error(self.call.line, f"CALL {self.call.name} lacks MEMORY/ALIAS lines at the end of file")
        if self.constant is not None:
            raise _error(self.constant[0], f"CONSTANT {self.constant[1]} lacks its MEMORY line")

    def _memory(self, number: int, record: dict[str, object]) -> None:
        name = _string(number, record, "NAME")
        size = _integer(number, record, "MEMORY")
        if size < 0:
            raise _error(number, f"negative MEMORY {size}")
        if self.constant is not None:
            if name != self.constant[1]:
                raise _error(number, f"MEMORY for {name!r} where CONSTANT {self.constant[1]!r} needs one")
            self._new(name, size, constant=True)
            self.constant = None
            return
        pending = self._pending(number, name, "MEMORY")
        pending.memory[name] = size
        if pending.complete():
            self._emit_call()

    def _alias(self, number: int, record: dict[str, object]) -> None:
        name = _string(number, record, "NAME")
        index = _integer(number, record, "ALIAS")
        pending = self._pending(number, name, "ALIAS")
        if not -1 <= index < len(pending.args):
            raise _error(number, f"ALIAS {index} is not -1 nor an argument index of {pending.name}")
        pending.alias[name] = index
        if pending.complete():
            self._emit_call()

    def _pending(self, number: int, name: str, kind: str) -> _PendingCall:
        pending = self.call
        if pending is None or name not in pending.results:
            raise _error(number, f"{kind} for {name!r}, which is not a result of the CALL just before")
        if name in (pending.memory if kind == "MEMORY" else pending.alias):
            raise _error(number, f"a second {kind} line for {name!r}")
        return pending

    def _emit_call(self) -> None:
        call = self.call
        assert call is not None
        outputs = []
        for name in call.results:
            index = call.alias[name]
            if index == -1:
                outputs.append(self._new(name, call.memory[name]))
            else:
                outputs.append(self._new(name, 0, alias_of=call.args[index]))
        self.op(call.name, call.args, tuple(outputs), call.cost, phase=self.phase)
        self.call = None

    def _mutate(self, number: int, record: dict[str, object]) -> None:
        args = self._handles(number, record, "ARGS")
        positions = record.get("MUTATE")
        if not isinstance(positions, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p < len(args) for p in positions
        ):
            raise _error(number, f"MUTATE must list argument positions of ARGS, got {positions!r}")
        mutates = tuple(dict.fromkeys(args[p] for p in positions))
        name = _string(number, record, "NAME")
        self.op(name, args, (), _time(number, record), mutates, self._op_phase(name))

    def _op_phase(self, name: str) -> Phase:
        """The phase of an op called ``name``: the artifact takes an op named like a backward
        kernel (``convolution_backward``) as the start of the backward phase, mark or not."""
        if "backward" in name:
            self.phase = Phase.BACKWARD
        return self.phase

    def _handle(self, name: str, source: int) -> None:
        """Bind ``name`` to a new handle sharing ``source``'s storage (COPY, COPY_FROM)."""
        self.op("alias", (source,), (self._new(name, 0, alias_of=source),), 0.0, phase=self.phase)

    def _new(self, name: str, nbytes: int, alias_of: int | None = None, constant: bool = False) -> int:
        tensor = self.tensor(nbytes, alias_of=alias_of, constant=constant)
        self.ids[name] = tensor
        return tensor

    def _check_new(self, number: int, name: str) -> None:
        if name in self.ids:
            raise _error(number, f"tensor {name!r} is defined twice")

    def _lookup(self, number: int, name: str) -> int:
        try:
            return self.ids[name]
        except KeyError:
            raise _error(number, f"tensor {name!r} is used before it is defined") from None

    def _handles(self, number: int, record: dict[str, object], key: str) -> tuple[int, ...]:
        return tuple(self._lookup(number, name) for name in _strings(number, record, key))


def _string(number: int, record: dict[str, object], key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise _error(number, f"field {key} must be a string, got {value!r}")
    return value


def _strings(number: int, record: dict[str, object], key: str) -> list[str]:
    value = record.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _error(number, f"field {key} must be a list of names, got {value!r}")
    return value


def _integer(number: int, record: dict[str, object], key: str) -> int:
    value = record.get(key)
    if isinstance(value, bool):
        raise _error(number, f"field {key} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise _error(number, f"field {key} must be an integer, got {value!r}")


def _time(number: int, record: dict[str, object]) -> float:
    nanoseconds = _integer(number, record, "TIME")
    if nanoseconds < 0:
        raise _error(number, f"negative TIME {nanoseconds}")
    if nanoseconds > _MOST_NS:
        shown = str(nanoseconds) if nanoseconds < 10**40 else f"of {len(str(nanoseconds))} digits"
        raise _error(number, f"TIME {shown} is more than 10**18 nanoseconds")
    return nanoseconds * _NS


_MOST_NS = 10**18  # about 32 years
