"""The DTR op log importer: the three reference logs, and clear errors for broken lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.trace import Op, Phase, Release, load, validate
from remat.trace.dtr_log import load_dtr_log, looks_like_dtr_log

LOGS = Path(__file__).resolve().parents[1] / "data" / "dtr"
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


def test_small_log_maps_every_instruction(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        START,
        *const("w", 64),
        *call("mm", ["w", "w"], [("y", 128, -1)], time=2500),
        *call("view", ["y"], [("v", 128, 0)]),
        {"INSTRUCTION": "COPY", "SRC": "v", "DST": "v2"},
        {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "BACKWARD"},
        {"INSTRUCTION": "MUTATE", "NAME": "add_", "ARGS": ["y", "w"], "MUTATE": [0], "TIME": "10"},
        {"INSTRUCTION": "RELEASE", "NAME": "y"},
    )
    trace = validate(load_dtr_log(path))
    w, y, v, v2 = trace.tensors
    assert w.constant and w.nbytes == 64
    assert (y.nbytes, y.alias_of) == (128, None)
    assert (v.nbytes, v.alias_of) == (0, y.id)  # an alias owns no bytes
    assert (v2.nbytes, v2.alias_of) == (0, v.id)  # COPY: a second handle
    mm, view, copy, mutate, release = trace.events
    assert isinstance(mm, Op) and mm.cost == pytest.approx(2.5e-6) and mm.phase is Phase.FORWARD
    assert isinstance(copy, Op) and copy.name == "alias" and copy.cost == 0.0
    assert isinstance(mutate, Op) and mutate.mutates == (y.id,) and mutate.outputs == ()
    assert mutate.phase is Phase.BACKWARD
    assert [op.index for op in trace.ops] == [0, 1, 2, 3]  # ops only, releases not counted
    assert release == Release(y.id)
    assert trace.source == "dtr" and trace.name == "log"


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
        ([START, {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "MIDDLE"}], 2, "unknown annotation"),
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
