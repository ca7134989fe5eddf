"""Reading one line of a trace file (``remat.trace.codec``): the header, a tensor, an op or a release,
each value's type and field checked, each failure an ``Invalid`` naming the rule and what was found
(the reader adds the file and the line).

Why apart from the codec: the file's reading and writing (paths, gzip, the read-back before a
save replaces a file) is one mechanism; what each kind of line may hold is the format's other half.
"""

from __future__ import annotations

import json
from typing import Any

from remat.trace.fields import count, fields, ids, is_count, number, typed
from remat.trace.types import Op, Phase, Release, TensorInfo
from remat.trace.validator import TOTAL_LIMIT, Invalid

__all__ = [
    "FORMAT",
    "VERSION",
    "call_inputs",
    "calls",
    "header",
    "let_go",
    "op",
    "parse_line",
    "positions",
    "release",
    "tensor",
    "unseen_bytes",
]

FORMAT = "remat-trace"
VERSION = 3
# version -> the optional header fields it reads
_READS = {
    1: frozenset({"calls", "call_inputs"}),
    2: frozenset({"calls", "call_inputs", "let_go"}),
    3: frozenset({"calls", "call_inputs", "let_go", "unseen_bytes"}),
}

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


def calls(value: object) -> tuple[tuple[str, int], ...]:
    if not (isinstance(value, dict) and all(isinstance(k, str) and is_count(n) for k, n in value.items())):
        raise Invalid("calls must map module paths to call counts", f"calls {value!r}"[:200])
    return tuple(value.items())


def call_inputs(value: object, n_tensors: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    if not (
        isinstance(value, dict)
        and all(
            isinstance(k, str) and isinstance(ids, list) and all(is_count(i) and i < n_tensors for i in ids)
            for k, ids in value.items()
        )
    ):
        raise Invalid("call_inputs must map module paths to lists of tensor ids", f"{value!r}"[:200])
    return tuple((k, tuple(ids)) for k, ids in value.items())


def let_go(value: object, n_tensors: int, n_ops: int) -> tuple[tuple[int, int], ...]:
    if not (
        isinstance(value, list)
        and all(
            isinstance(pair, list)
            and len(pair) == 2
            and is_count(pair[0])
            and pair[0] < n_tensors
            and is_count(pair[1])
            and pair[1] < n_ops
            for pair in value
        )
    ):
        raise Invalid("let_go must list [tensor id, op index] pairs", f"{value!r}"[:200])
    return tuple((t, op) for t, op in value)


def positions(record: dict[str, Any], tid: int) -> list[int]:
    positions = record.get("saved_at", [])
    if not (isinstance(positions, list) and all(is_count(p) for p in positions)):
        raise Invalid("saved_at must be a list of op counts", f"tensor {tid} has saved_at {positions!r}")
    return positions


def parse_line(line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise Invalid(
            "each line must be one JSON object", f"not JSON: {err.msg} at column {err.colno}"
        ) from None
    except (ValueError, RecursionError) as err:  # an integer of over 4300 digits, nesting too deep
        raise Invalid("each line must be one JSON object", f"not readable: {err}"[:200]) from None
    if not isinstance(record, dict):
        raise Invalid("each line must be one JSON object", f"got a {type(record).__name__}")
    return record


def header(record: dict[str, Any]) -> dict[str, Any]:
    if record.get("format") != FORMAT:
        raise Invalid(
            f'line 1 must be the header, with "format": "{FORMAT}"', f"format {record.get('format')!r}"
        )
    version = record.get("version")
    if type(version) is not int or version not in _READS:
        raise Invalid(
            f"unsupported format version (this remat reads versions {', '.join(map(str, _READS))})",
            f"version {version!r}",
        )
    fields(record, _HEADER_FIELDS | _READS[version], f"version {version} header")
    for key in ("name", "device", "source"):
        typed(record, key, str, "header")
    for key in ("tensors", "events"):
        count(record, key, "header")
    return record


def tensor(record: dict[str, Any]) -> TensorInfo:
    fields(record, _TENSOR_FIELDS, "tensor line")
    tid = count(record, "tensor", "tensor line")
    what = f"tensor {tid}"
    shape = record.get("shape")
    if shape is not None and not (isinstance(shape, list) and all(is_count(s) for s in shape)):
        raise Invalid("shape must be a list of non-negative integers", f"{what} has shape {shape!r}")
    alias_of = record.get("alias_of")
    if alias_of is not None and not is_count(alias_of):
        raise Invalid("alias_of must be a tensor id", f"{what} has alias_of {alias_of!r}")
    dtype = record.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise Invalid("dtype must be a string", f"{what} has dtype {dtype!r}")
    return TensorInfo(
        id=tid,
        nbytes=typed(record, "nbytes", int, what),
        alias_of=alias_of,
        constant=typed(record, "constant", bool, what, False),
        shape=tuple(shape) if shape is not None else None,
        dtype=dtype,
    )


def op(record: dict[str, Any]) -> Op:
    fields(record, _OP_FIELDS, "op line")
    index = count(record, "op", "op line")
    what = f"op {index}"
    phase = record.get("phase", Phase.UNKNOWN.value)
    if not isinstance(phase, str) or phase not in _PHASES:
        raise Invalid(f"phase must be one of {', '.join(_PHASES)}", f"{what} has phase {phase!r}")
    return Op(
        index=index,
        name=typed(record, "name", str, what),
        inputs=ids(record, "inputs", what),
        outputs=ids(record, "outputs", what),
        mutates=ids(record, "mutates", what, required=False),
        cost=number(record, "cost", what),
        est_cost=number(record, "est_cost", what),
        phase=_PHASES[phase],
        module=typed(record, "module", str, what, ""),
        random=typed(record, "random", bool, what, False),
        scratch=_bytes(record, "scratch", what),
        state=_bytes(record, "state", what),
    )


def _bytes(record: dict[str, Any], key: str, what: str) -> int:
    """An op's bytes beside its outputs (its kernel's scratch, the state it keeps): a count no
    larger than a step's tensors may own together."""
    value = typed(record, key, int, what, 0)
    if value > TOTAL_LIMIT:  # a negative count is the checker's to refuse
        raise Invalid(f'"{key}" must be at most 2**60 bytes', f"{what} has {key} {value}")
    return int(value)


def release(record: dict[str, Any]) -> Release:
    fields(record, {"release"}, "release line")
    tensor = record["release"]
    if not is_count(tensor):
        raise Invalid("a release names one tensor id", f"release {tensor!r}")
    return Release(tensor)


def unseen_bytes(value: object) -> int:
    if not isinstance(value, int) or not is_count(value):
        raise Invalid("unseen_bytes must be a whole number of bytes, 0 or more", f"{value!r}"[:200])
    return value
