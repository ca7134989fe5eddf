"""The DTR op log importer: each instruction kind imported exactly, the three reference logs, and
clear errors for broken lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.trace import Op, Phase, Release, TensorInfo, load, validate
from remat.trace.dtr_log import load_dtr_log, looks_like_dtr_log

LOGS = Path(__file__).resolve().parents[2] / "data" / "dtr"
NAMES = ("resnet32-56", "transformer-10", "lstm-128")


def write(tmp_path: Path, *records: dict[str, object]) -> Path:
    path = tmp_path / "log.txt"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


START = {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"}


def const(name: str, nbytes: int) -> list[dict[str, object]]:
    return [
        {"INSTRUCTION": "CONSTANT", "NAME": name},
        {"INSTRUCTION": "MEMORY", "NAME": name, "MEMORY": str(nbytes)},
    ]


def call(
    name: str, args: list[str], results: list[tuple[str, int, int]], time: int = 1000
) -> list[dict[str, object]]:
    records: list[dict[str, object]] = [
        {
            "INSTRUCTION": "CALL",
            "NAME": name,
            "ARGS": args,
            "RESULT": [r[0] for r in results],
            "TIME": str(time),
        }
    ]
    for result, nbytes, alias in results:
        records.append({"INSTRUCTION": "MEMORY", "NAME": result, "MEMORY": str(nbytes)})
        records.append({"INSTRUCTION": "ALIAS", "NAME": result, "ALIAS": str(alias)})
    return records


def mutate(name: str, args: list[str], positions: list[int], time: int = 10) -> dict[str, object]:
    return {"INSTRUCTION": "MUTATE", "NAME": name, "ARGS": args, "MUTATE": positions, "TIME": str(time)}


def copy(kind: str, dst: str, src: str) -> dict[str, object]:
    return {"INSTRUCTION": kind, "DST": dst, "SRC": src}


def release(name: str) -> dict[str, object]:
    return {"INSTRUCTION": "RELEASE", "NAME": name}


def annotate(annotation: str) -> dict[str, object]:
    return {"INSTRUCTION": "ANNOTATE", "ANNOTATION": annotation}


NS = 1e-9  # TIME is in nanoseconds, Op.cost in seconds
FWD, BWD = Phase.FORWARD, Phase.BACKWARD


def const_info(tensor: int, nbytes: int) -> TensorInfo:
    return TensorInfo(tensor, nbytes, constant=True)


# One small log per instruction kind (MEMORY and ALIAS only ever follow CONSTANT or CALL), with the
# exact tensors and events it must import as.
KINDS = {
    "CONSTANT": ([START, *const("w", 64)], (const_info(0, 64),), ()),
    "CALL": (
        # MEMORY of a result that aliases argument 0 is ignored: a view owns no bytes.
        [START, *const("x", 8), *call("split", ["x", "x"], [("a", 16, -1), ("b", 99, 1)], time=2500)],
        (const_info(0, 8), TensorInfo(1, 16), TensorInfo(2, 0, alias_of=0)),
        (Op(0, "split", (0, 0), (1, 2), cost=2500 * NS, phase=FWD),),
    ),
    "CALL without results": (
        [START, *const("x", 8), *call("print", ["x"], [], time=7)],
        (const_info(0, 8),),
        (Op(0, "print", (0,), (), cost=7 * NS, phase=FWD),),
    ),
    "MUTATE": (
        [START, *const("x", 8), *const("y", 8), mutate("addcmul_", ["x", "y", "x"], [0, 2])],
        (const_info(0, 8), const_info(1, 8)),
        (Op(0, "addcmul_", (0, 1, 0), (), mutates=(0,), cost=10 * NS, phase=FWD),),
    ),
    "COPY": (
        [START, *const("x", 8), copy("COPY", "y", "x"), release("x"), release("y")],
        (const_info(0, 8), TensorInfo(1, 0, alias_of=0)),
        (Op(0, "alias", (0,), (1,), phase=FWD), Release(0), Release(1)),
    ),
    "COPY_FROM": (
        # y's first tensor goes when y takes x's; the later RELEASE y drops the new handle.
        [
            START,
            *const("x", 8),
            *call("relu", ["x"], [("y", 8, -1)]),
            copy("COPY_FROM", "y", "x"),
            release("y"),
        ],
        (const_info(0, 8), TensorInfo(1, 8), TensorInfo(2, 0, alias_of=0)),
        (
            Op(0, "relu", (0,), (1,), cost=1000 * NS, phase=FWD),
            Op(1, "alias", (0,), (2,), phase=FWD),
            Release(1),
            Release(2),
        ),
    ),
    "COPY_FROM itself": (
        # The new handle is made from the old before the old is released, so the storage stays.
        [START, *call("randn", [], [("x", 8, -1)]), copy("COPY_FROM", "x", "x")],
        (TensorInfo(0, 8), TensorInfo(1, 0, alias_of=0)),
        (
            Op(0, "randn", (), (0,), cost=1000 * NS, phase=FWD),
            Op(1, "alias", (0,), (1,), phase=FWD),
            Release(0),
        ),
    ),
    "RELEASE": ([START, *const("x", 8), release("x")], (const_info(0, 8),), (Release(0),)),
    "ANNOTATE": (
        # UNKNOWN before START, then FORWARD, then BACKWARD, which a second START does not undo.
        [
            *call("a", [], [("x", 4, -1)]),
            START,
            *call("b", [], [("y", 4, -1)]),
            annotate("BACKWARD"),
            *call("c", [], [("z", 4, -1)]),
            START,
            *call("d", [], [("u", 4, -1)]),
        ],
        tuple(TensorInfo(i, 4) for i in range(4)),
        tuple(
            Op(i, name, (), (i,), cost=1000 * NS, phase=phase)
            for i, (name, phase) in enumerate([("a", Phase.UNKNOWN), ("b", FWD), ("c", BWD), ("d", BWD)])
        ),
    ),
    "CALL named backward": (
        # With no BACKWARD mark, the first op named like a backward kernel starts the phase.
        [
            START,
            *const("x", 8),
            *call("threshold_backward", ["x"], [("g", 8, -1)]),
            mutate("add_", ["g"], [0]),
        ],
        (const_info(0, 8), TensorInfo(1, 8)),
        (
            Op(0, "threshold_backward", (0,), (1,), cost=1000 * NS, phase=BWD),
            Op(1, "add_", (1,), (), mutates=(1,), cost=10 * NS, phase=BWD),
        ),
    ),
    "MUTATE named backward": (
        [START, *const("x", 8), mutate("fill_backward_", ["x"], [0]), *call("relu", ["x"], [("y", 8, -1)])],
        (const_info(0, 8), TensorInfo(1, 8)),
        (
            Op(0, "fill_backward_", (0,), (), mutates=(0,), cost=10 * NS, phase=BWD),
            Op(1, "relu", (0,), (1,), cost=1000 * NS, phase=BWD),
        ),
    ),
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_instruction_imports_exactly(tmp_path: Path, kind: str) -> None:
    records, tensors, events = KINDS[kind]
    trace = validate(load_dtr_log(write(tmp_path, *records)))
    assert trace.tensors == tensors
    assert trace.events == events
    assert trace.source == "dtr" and trace.name == "log" and trace.device == "cuda"


def test_copy_from_into_a_released_handle_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, START, *const("x", 8), *const("y", 8), release("y"), copy("COPY_FROM", "y", "x"))
    with pytest.raises(ValueError, match=r"remat\.trace\.load: a tensor can be released only once \("):
        load(path)


@pytest.mark.parametrize(
    ("records", "line", "reason"),
    [
        ([START, "not json"], 2, "not valid JSON"),
        ([START, {"INSTRUCTION": "JUMP"}], 2, "not a DTR instruction"),
        ([START, {"INSTRUCTION": "RELEASE", "NAME": "ghost"}], 2, "used before it is defined"),
        ([START, {"INSTRUCTION": "CONSTANT", "NAME": "c"}, START], 2, "not followed by its MEMORY"),
        ([START, *const("c", 4), *const("c", 4)], 4, "defined twice"),
        ([START, *call("relu", ["x"], [("y", 4, -1)])], 2, "used before it is defined"),
        ([START, *const("c", 4), *call("relu", ["c"], [("y", 4, 3)])], 6, "not -1 nor an argument index"),
        ([START, *const("c", 4), *call("relu", ["c"], [("y", -4, -1)])], 5, "negative MEMORY"),
        ([START, *const("c", 4), *call("relu", ["c"], [("y", 4, -1)])[:2], START], 4, "lacks MEMORY/ALIAS"),
        (
            [
                START,
                *const("c", 4),
                {"INSTRUCTION": "MUTATE", "NAME": "a_", "ARGS": ["c"], "MUTATE": [5], "TIME": "1"},
            ],
            4,
            "argument positions",
        ),
        ([START, *const("c", 4), *call("relu", ["c"], [("y", 4, -1)], time=-3)], 4, "negative TIME"),
        # a TIME past any float (a traceback: int too large to convert to float)
        ([START, *const("c", 4), *call("relu", ["c"], [("y", 4, -1)], time=10**400)], 4, r"than 10\*\*18"),
        ([START, {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "MIDDLE"}], 2, "unknown annotation"),
        ([START, {"INSTRUCTION": "MEMORY", "NAME": "m", "MEMORY": "4"}], 2, "not a result of the CALL"),
        ([START, {"INSTRUCTION": "ALIAS", "NAME": "m", "ALIAS": "-1"}], 2, "not a result of the CALL"),
        ([START, *const("c", 4), copy("COPY", "c", "c")], 4, "'c' is defined twice"),
        ([START, *const("c", 4), copy("COPY", "d", "ghost")], 4, "'ghost' is used before it is defined"),
        ([START, *const("c", 4), copy("COPY_FROM", "ghost", "c")], 4, "'ghost' is used before it is defined"),
        ([START, *const("c", 4), copy("COPY_FROM", "c", "ghost")], 4, "'ghost' is used before it is defined"),
        ([START, *const("c", 4), {"INSTRUCTION": "COPY_FROM", "SRC": "c"}], 4, "field DST must be a string"),
        ([START, *const("c", 4), {"INSTRUCTION": "COPY_FROM", "DST": ["c"], "SRC": "c"}], 4, "field DST"),
        ([START, *const("c", 4), {"INSTRUCTION": "COPY_FROM", "DST": "c", "SRC": 3}], 4, "field SRC"),
    ],
)
def test_malformed_lines_name_line_and_reason(
    tmp_path: Path, records: list[object], line: int, reason: str
) -> None:
    path = tmp_path / "bad.log"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    with pytest.raises(
        ValueError, match=rf"remat\.trace\.load_dtr_log: malformed DTR log line \(line {line}: .*{reason}"
    ):
        load_dtr_log(path)


def test_looks_like_dtr_log(tmp_path: Path) -> None:
    assert looks_like_dtr_log(write(tmp_path, START))
    assert looks_like_dtr_log(write(tmp_path, copy("COPY_FROM", "y", "x")))  # any kind, first line or not
    other = tmp_path / "other.jsonl"
    other.write_text('{"format": "remat-trace"}\n')
    assert not looks_like_dtr_log(other)
    assert not looks_like_dtr_log(tmp_path / "missing.log")


@pytest.mark.parametrize("name", NAMES)
def test_reference_logs_load_and_validate(name: str) -> None:
    trace = load(LOGS / f"{name}.log")  # remat.trace.load dispatches to the importer and validates
    assert trace.source == "dtr" and trace.name == name
    phases = {op.phase for op in trace.ops}
    assert phases == {Phase.FORWARD, Phase.BACKWARD}
    assert all(op.cost > 0 or op.name == "alias" for op in trace.ops)
    assert 0.1 < trace.total_cost < 2.0  # seconds: the logs hold ns from a Titan V


def test_a_gzipped_log_loads_as_the_plain_one(tmp_path: Path) -> None:
    """``remat.trace.load`` reads a ``.gz`` name through gzip; the DTR importer read it as text
    and the load said line 1 must be a header "or the file a DTR op log", quoting a DTR line."""
    import gzip

    plain = LOGS / f"{NAMES[0]}.log"
    packed = tmp_path / f"{NAMES[0]}.log.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert looks_like_dtr_log(packed)
    a, b = load(plain), load(packed)
    assert a.ops == b.ops and a.tensors == b.tensors
    broken = tmp_path / "broken.log.gz"
    broken.write_bytes(gzip.compress(plain.read_bytes())[:40])
    assert not looks_like_dtr_log(broken)
