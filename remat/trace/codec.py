"""The trace file format (JSON Lines, versioned): write and read.

One JSON object a line, so that a trace can be streamed, diffed, grepped and cut by hand, and so
that every error names the line at fault. The layout (docs/trace-format.md has the full
description): a header line, then one line per tensor in id order, then one line per event in
program order::

    {"format": "remat-trace", "version": 2, "name": "gpt2", "device": "cpu", "source": "capture", ...}
    {"tensor": 0, "nbytes": 4096, "constant": true, "shape": [32, 32], "dtype": "float32"}
    {"tensor": 1, "nbytes": 0, "alias_of": 0, "shape": [32, 32], "dtype": "float32"}
    {"op": 0, "name": "aten.t.default", "inputs": [0], "outputs": [1], "phase": "forward"}
    {"release": 1}

Reading decodes each line (types and fields, here) and checks it as it comes with
``remat.trace.validator`` (ids, and that the events make a possible program); ``save`` refuses to
write a trace that would not read back, and ``load`` also reads a DTR op log through
``remat.trace.dtr_log``.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import tempfile
import zlib
from pathlib import Path
from typing import IO, Any, Literal

from remat._errors import RematTypeError, RematValueError, message
from remat._files import path_of
from remat.trace import records
from remat.trace.fields import typed
from remat.trace.records import FORMAT, VERSION
from remat.trace.types import Event, Op, Release, TensorInfo, Trace
from remat.trace.validator import Checker, Invalid, checked

__all__ = ["FORMAT", "VERSION", "load", "save"]


def save(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` to ``path`` (gzip-compressed if the name ends in ``.gz``), after validating it;
    a trace whose file would not read back is refused, and ``path`` left as it was."""
    try:
        checked(trace, "trace.save", trace.name if isinstance(getattr(trace, "name", None), str) else "trace")
    except (TypeError, ValueError, OverflowError) as err:
        if isinstance(err, (RematValueError, RematTypeError)):
            raise
        raise _mistyped(err) from None
    target = Path(os.path.realpath(path_of(path, "trace.save")))  # a link: the file it names, written
    if target.is_dir() or not target.parent.is_dir() or (target.exists() and not target.is_file()):
        raise RematValueError(
            message(
                "trace.save",
                "the path names a file (or none yet) in a folder that exists",
                str(path) + (" (not a regular file)" if target.exists() and not target.is_dir() else ""),
                "pass a file path such as step.jsonl",
            )
        )
    # written beside it, read back, and renamed over it: a trace that fails halfway (a field of a
    # type the file cannot hold) or would not read back leaves a file already at ``path`` as it was
    try:
        handle, name = tempfile.mkstemp(prefix=".partial-", suffix=target.suffix, dir=target.parent)
    except OSError as err:  # a folder this process may not write in
        raise _unwritten(path, err) from None
    os.close(handle)
    partial = Path(name)  # the same suffix: gzip or not
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, target.stat().st_mode & 0o777 if target.exists() else 0o666 & ~umask)
    try:
        _write(trace, partial, target.name)
        _read(partial)
        os.replace(partial, target)
    except OSError as err:  # the disk full, the file not ours to replace
        raise _unwritten(path, err) from None
    except RematValueError as err:  # the file would not read back: what ``load`` says of it
        said = str(err).removeprefix("remat.trace.load: ").replace(str(partial), "the file")
        raise _mistyped(ValueError(said)) from None
    except (AttributeError, TypeError, ValueError, OverflowError) as err:
        raise _mistyped(err) from None
    finally:
        partial.unlink(missing_ok=True)


def _unwritten(path: object, err: OSError) -> RematValueError:
    return RematValueError(
        message(
            "trace.save",
            "the trace is written to its path",
            f"{path}: {err.strerror or type(err).__name__}",
            "pass a path in a folder this process may write in, on a disk with room",
        )
    )


def _mistyped(err: Exception) -> RematValueError:
    return RematValueError(
        message(
            "trace.save",
            "every field of the trace must be of its documented type (the file must read back)",
            f"{type(err).__name__}: {err}"[:300],
            "build the trace's Op and TensorInfo records with the types remat.trace.types gives",
        )
    )


def _write(trace: Trace, path: Path, name: str) -> None:
    with _open(path, "w", name) as f:
        header = {
            "format": FORMAT,
            "version": VERSION,
            "name": trace.name,
            "device": trace.device,
            "source": trace.source,
            "tensors": len(trace.tensors),
            "events": len(trace.events),
        }
        if trace.calls:
            header["calls"] = dict(trace.calls)
        if trace.call_inputs:
            header["call_inputs"] = {name: list(ids) for name, ids in trace.call_inputs}
        if trace.let_go:
            header["let_go"] = [list(pair) for pair in trace.let_go]
        if trace.unseen_bytes:
            header["unseen_bytes"] = trace.unseen_bytes
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
    p = path_of(path, "trace.load")
    if not p.is_file():
        rule = "a trace is a file, not a folder" if p.is_dir() else "no such file"
        raise RematValueError(message("trace.load", rule, str(p), "pass the path of a trace file"))
    try:
        with _open(p, "r") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        rule = "a trace is text (JSON lines), gzip-compressed where its name ends in .gz"
        raise RematValueError(
            message(
                "trace.load",
                rule,
                f"{p}: {err}"[:300],
                "pass a file written by remat.trace.save or a DTR log",
            )
        ) from None
    header: object = None
    with contextlib.suppress(ValueError, RecursionError):  # not JSON: a DTR log, or neither
        header = json.loads(first)
    if isinstance(header, dict) and "format" in header:
        return _read(p)
    try:
        from remat.trace import dtr_log  # imported here: reading our own files does not need it
    except ImportError:
        dtr_log = None  # type: ignore[assignment]
    if dtr_log is not None and dtr_log.looks_like_dtr_log(p):
        return checked(dtr_log.load_dtr_log(p), "trace.load", str(p))
    raise RematValueError(
        message(
            "trace.load",
            f'line 1 must be a header with "format": "{FORMAT}", or the file a DTR op log',
            f"{p} line 1: {first[:80].strip()!r}",
            "pass a file written by remat.trace.save or a DTR log",
        )
    )


def _read(path: Path) -> Trace:
    checker = Checker()
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
                record = records.parse_line(line)
                if lineno == 1:
                    header = records.header(record)
                elif "tensor" in record:
                    if events:
                        raise Invalid(
                            "tensor lines must come before event lines", f"tensor {record['tensor']}"
                        )
                    t = records.tensor(record)
                    checker.tensor(t, where)
                    tensors.append(t)
                    if typed(record, "saved", bool, f"tensor {t.id}", False):
                        saved.add(t.id)
                    saved_at.extend((t.id, position) for position in records.positions(record, t.id))
                elif "op" in record or "release" in record:
                    e = records.op(record) if "op" in record else records.release(record)
                    checker.event(e, where)
                    events.append(e)
                else:
                    raise Invalid(
                        'each line after the header is a "tensor", "op" or "release"',
                        f"keys {sorted(record)}",
                    )
            where = "end of file"
            if not header:
                raise Invalid("the file must start with a header line", "the file is empty")
            for key, got in (("tensors", len(tensors)), ("events", len(events))):  # a cut file first
                if header[key] != got:
                    raise Invalid(
                        "the header's counts must match the file (is it truncated?)",
                        f"header announces {header[key]} {key}, the file has {got}",
                    )
            checker.saved(frozenset(saved), tuple(saved_at), sum(isinstance(e, Op) for e in events))
            where = "line 1"  # the header's fields read against the whole file
            calls = records.calls(header.get("calls", {}))
            call_inputs = records.call_inputs(header.get("call_inputs", {}), len(tensors))
            let_go = records.let_go(
                header.get("let_go", []), len(tensors), sum(isinstance(e, Op) for e in events)
            )
            unseen = records.unseen_bytes(header.get("unseen_bytes", 0))
    except Invalid as err:
        raise RematValueError(
            message(
                "trace.load",
                err.rule,
                f"{path} {where}: {err.detail}",
                "fix the file or capture the step again",
            )
        ) from None
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as err:
        raise RematValueError(
            message("trace.load", "the file could not be read", f"{path} {where}: {err}", "check the file")
        ) from None
    except (TypeError, ValueError, OverflowError, RecursionError) as err:  # a value no rule foresaw
        raise RematValueError(
            message(
                "trace.load",
                "a value of the file is of a type or size no field takes",
                f"{path} {where}: {type(err).__name__}: {err}"[:300],
                "fix the file or capture the step again",
            )
        ) from None
    return Trace(
        tuple(tensors),
        tuple(events),
        frozenset(saved),
        name=header["name"],
        device=header["device"],
        source=header["source"],
        saved_at=tuple(saved_at),
        calls=calls,
        call_inputs=call_inputs,
        let_go=let_go,
        unseen_bytes=unseen,
    )


# -- records ------------------------------------------------------------------------------------


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"


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


def _open(path: Path, mode: Literal["r", "w"], name: str = "") -> IO[str]:
    """``path`` as text, through gzip if its name ends in ``.gz``; written, the gzip header names the
    file ``name`` (the file it becomes, not the one written beside it)."""
    if path.suffix != ".gz":
        return open(path, mode, encoding="utf-8", newline="\n")
    if mode == "w":
        under = open(path, "wb")  # noqa: SIM115 (closed with the wrapper: ``_Closing``)
        return _Closing(gzip.GzipFile(filename=name.removesuffix(".gz"), mode="wb", fileobj=under), under)
    return gzip.open(path, "rt", encoding="utf-8", newline="\n")


class _Closing(io.TextIOWrapper):
    """A text wrapper over a ``GzipFile`` that closes the file under it too."""

    def __init__(self, raw: gzip.GzipFile, under: IO[bytes]) -> None:
        super().__init__(raw, encoding="utf-8", newline="\n")  # type: ignore[arg-type]
        self._under = under

    def close(self) -> None:
        super().close()
        self._under.close()
