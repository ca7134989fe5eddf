"""remat.trace.save/load/validate: lossless round trips, DTR logs, and a clear error (with the line)
for every kind of malformed or inconsistent file."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import remat
from remat.trace import Op, Phase, Release, TensorInfo, Trace, capture, load, save, validate

DTR_LOGS = Path(__file__).resolve().parents[2] / "data" / "dtr"

GOOD = [
    '{"format":"remat-trace","version":3,"name":"t","device":"cpu","source":"test","tensors":3,"events":4}',
    '{"tensor":0,"nbytes":16,"constant":true,"shape":[4],"dtype":"float32"}',
    '{"tensor":1,"nbytes":32,"shape":[8],"dtype":"float32","saved":true}',
    '{"tensor":2,"nbytes":0,"alias_of":1,"shape":[2,4],"dtype":"float32"}',
    '{"op":0,"name":"aten.cat.default","inputs":[0,0],"outputs":[1],"cost":1e-06,"phase":"forward"}',
    '{"op":1,"name":"aten.view.default","inputs":[1],"outputs":[2],"phase":"forward","module":"m"}',
    '{"release":2}',
    '{"release":1}',
]


def _write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_hand_written_file_reads_as_documented(tmp_path: Path) -> None:
    trace = load(_write(tmp_path, GOOD))
    assert trace.tensors[1] == TensorInfo(1, 32, None, False, (8,), "float32")
    assert trace.tensors[2].alias_of == 1 and trace.saved == frozenset({1})
    assert trace.events[0] == Op(0, "aten.cat.default", (0, 0), (1,), cost=1e-06, phase=Phase.FORWARD)
    assert trace.events[2:] == (Release(2), Release(1))
    assert (trace.name, trace.device, trace.source) == ("t", "cpu", "test")
    assert (trace.peak_bytes, trace.activation_peak_bytes, trace.constant_bytes) == (48, 32, 16)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_captured_trace_round_trips_exactly(tmp_path: Path, suffix: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    opt = torch.optim.Adam(net.parameters())
    trace = capture(net, (x,), lambda out: nn.functional.cross_entropy(out, y), optimizer=opt)
    assert trace.saved and any(op.random for op in trace.ops) and any(op.mutates for op in trace.ops)
    path = tmp_path / f"step{suffix}"
    save(trace, path)
    back = load(path)
    assert back == trace
    assert back.events == trace.events and back.tensors == trace.tensors and back.saved == trace.saved


def test_every_field_round_trips(tmp_path: Path) -> None:
    trace = Trace(
        tensors=(TensorInfo(0, 8, constant=True), TensorInfo(1, 0, 0, True, (2,), "int32"), TensorInfo(2, 3)),
        events=(
            Op(0, "custom", (0, 1), (2,), (1,), 0.1, 0.2, Phase.OPTIMIZER, "a.b", True, 640, 5056),
            Op(1, "other", (2,), ()),
            Release(2),
            Release(1),
        ),
        saved=frozenset({0, 2}),
        name="x",
        device="cuda",
        source="test",
        saved_at=((2, 2), (0, 0), (2, 1)),
        calls=(("a", 1), ("a.b", 2)),
        call_inputs=(("a", (0, 1)),),
        let_go=((2, 1),),
        unseen_bytes=5056,
    )
    assert trace.saved_at == ((0, 0), (2, 1), (2, 2))  # kept sorted
    save(trace, tmp_path / "t.jsonl")
    assert json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])["version"] == 3
    assert load(tmp_path / "t.jsonl") == trace


def _replace(line: int, text: str) -> list[str]:
    lines = list(GOOD)
    lines[line - 1] = text
    return lines


MALFORMED = {
    "bad json": (_replace(3, '{"tensor":1,"nbytes":32'), 3, "each line must be one JSON object"),
    "not an object": (_replace(3, "[1, 2]"), 3, "each line must be one JSON object"),
    "wrong format": (_replace(1, '{"format":"other","version":1}'), 1, "must be the header"),
    "bad version": (
        _replace(1, GOOD[0].replace('"version":3', '"version":4')),
        1,
        "unsupported format version",
    ),
    "negative unseen_bytes": (
        _replace(1, GOOD[0].replace('"events"', '"unseen_bytes":-1,"events"')),
        1,  # read once the file is, named at the header's line
        "unseen_bytes must be a whole number",
    ),
    "unseen_bytes in a version 2 header": (
        _replace(
            1, GOOD[0].replace('"version":3', '"version":2').replace('"events"', '"unseen_bytes":8,"events"')
        ),
        1,
        "unknown field in a version 2 header",
    ),
    "let_go out of range": (
        _replace(1, GOOD[0].replace('"events"', '"let_go":[[1,9]],"events"')),
        1,  # checked once the ops are counted
        "let_go must list",
    ),
    "let_go in a version 1 header": (
        _replace(
            1, GOOD[0].replace('"version":3', '"version":1').replace('"events"', '"let_go":[],"events"')
        ),
        1,
        "unknown field in a version 1 header",
    ),
    "duplicate id": (_replace(3, '{"tensor":0,"nbytes":32}'), 3, "tensor ids must be unique"),
    "id out of order": (_replace(3, '{"tensor":5,"nbytes":32}'), 3, r"tensor ids must be 0, 1, 2"),
    "unknown field": (_replace(3, '{"tensor":1,"nbytes":32,"size":1}'), 3, "unknown field"),
    "wrong type": (_replace(3, '{"tensor":1,"nbytes":"32"}'), 3, '"nbytes" must be of type int'),
    "missing field": (_replace(5, '{"op":0,"inputs":[0],"outputs":[1]}'), 5, '"name" is required'),
    "negative nbytes": (_replace(3, '{"tensor":1,"nbytes":-1}'), 3, "nbytes must not be negative"),
    "unknown alias target": (
        _replace(4, '{"tensor":2,"nbytes":0,"alias_of":7}'),
        4,
        "alias_of must name an earlier",
    ),
    "alias with bytes": (_replace(4, '{"tensor":2,"nbytes":4,"alias_of":1}'), 4, "an alias owns no bytes"),
    "unknown record": (_replace(7, '{"free":2}'), 7, r'is a "tensor", "op" or "release"'),
    "unknown tensor in op": (
        _replace(6, GOOD[5].replace('"inputs":[1]', '"inputs":[9]')),
        6,
        "unknown tensor 9",
    ),
    "op index": (_replace(6, GOOD[5].replace('"op":1', '"op":4')), 6, r"ops must be numbered 0, 1, 2"),
    "read before made": (
        _replace(5, GOOD[4].replace('"inputs":[0,0]', '"inputs":[2]')),
        5,
        "an op may read only tensors that exist",
    ),
    "read after release": (
        [*GOOD[:6], '{"release":2}', '{"op":2,"name":"f","inputs":[2],"outputs":[]}'],
        8,
        "an op may read only live tensors .*reads tensor 2, released at line 7",
    ),
    "made twice": (
        _replace(6, GOOD[5].replace('"outputs":[2]', '"outputs":[1]')),
        6,
        "a tensor is made once",
    ),
    "constant made": (
        _replace(5, GOOD[4].replace('"outputs":[1]', '"outputs":[0]')),
        5,
        "a tensor is made once",
    ),
    "mutates a non-input": (
        _replace(6, GOOD[5].replace('"outputs":[2]', '"outputs":[2],"mutates":[0]')),
        6,
        "mutates only tensors among its inputs",
    ),
    "negative scratch": (
        _replace(5, GOOD[4].replace('"cost":1e-06', '"cost":1e-06,"scratch":-8')),
        5,
        "scratch bytes must not be negative",
    ),
    "negative state": (
        _replace(5, GOOD[4].replace('"cost":1e-06', '"cost":1e-06,"state":-8')),
        5,
        "state bytes must not be negative",
    ),
    "negative cost": (_replace(5, GOOD[4].replace('"cost":1e-06', '"cost":-1')), 5, "costs must be finite"),
    "bad phase": (_replace(5, GOOD[4].replace('"forward"', '"sideways"')), 5, "phase must be one of"),
    "released twice": ([*GOOD[:7], '{"release":2}'], 8, "released only once"),
    "release before made": (
        [*GOOD[:4], '{"release":2}', *GOOD[4:7]],
        5,
        "released only after it exists",
    ),
    "tensor after events": (
        [*GOOD[:5], '{"tensor":3,"nbytes":1}', *GOOD[5:]],
        6,
        "tensor lines must come before",
    ),
    "truncated": (GOOD[:-1], None, "header's counts must match"),
    # values no rule foresaw: each was a traceback from inside Python, or read silently
    "saved not a bool": (
        _replace(3, GOOD[2].replace('"saved":true', '"saved":1')),
        3,
        '"saved" must be of type bool',
    ),
    "phase a list": (_replace(5, GOOD[4].replace('"forward"', '["forward"]')), 5, "phase must be one of"),
    "cost of 400 digits": (
        _replace(5, GOOD[4].replace("1e-06", "1" * 400)),
        5,
        "of a type or size no field takes",
    ),
    "an int of 5000 digits": (
        _replace(3, GOOD[2].replace("32", "9" * 5000)),
        3,
        "each line must be one JSON object",
    ),
    "nested too deep": (_replace(3, "[" * 100_000 + "]" * 100_000), 3, "each line must be one JSON object"),
    "scratch past 2**60": (
        _replace(5, GOOD[4].replace('"cost"', f'"scratch":{2**63},"cost"')),
        5,
        r"at most 2\*\*60 bytes",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_files_are_refused_with_the_line(tmp_path: Path, case: str) -> None:
    lines, line, rule = MALFORMED[case]
    where = f"line {line}" if line is not None else "end of file"
    with pytest.raises(remat.RematValueError, match=rf"^remat\.trace\.load: .*{rule}") as err:
        load(_write(tmp_path, lines))
    assert f"t.jsonl {where}: " in str(err.value)


def test_files_that_are_no_trace_at_all(tmp_path: Path) -> None:
    with pytest.raises(remat.RematValueError, match=r"remat\.trace\.load: no such file"):
        load(tmp_path / "missing.jsonl")
    for text in ("", "hello\n", '{"a": 1}\n'):
        path = tmp_path / "other.txt"
        path.write_text(text)
        with pytest.raises(remat.RematValueError, match=r"remat\.trace\.load: line 1 must be a header"):
            load(path)


def test_validate_and_save_name_the_event_at_fault(tmp_path: Path) -> None:
    good = load(_write(tmp_path, GOOD))
    assert validate(good) is good
    bad = dataclasses.replace(good, events=(*good.events, Release(1)))
    with pytest.raises(remat.RematValueError, match=r"remat\.trace\.validate: .*released only once.*event 4"):
        validate(bad)
    with pytest.raises(remat.RematValueError, match=r"remat\.trace\.save: .*event 4"):
        save(bad, tmp_path / "bad.jsonl")
    assert not (tmp_path / "bad.jsonl").exists()
    unknown_saved = dataclasses.replace(good, saved=frozenset({7}))
    with pytest.raises(remat.RematValueError, match=r"saved tensors must be known"):
        validate(unknown_saved)
    with pytest.raises(remat.RematValueError, match=r"saved_at may name only saved tensors .*tensor 0"):
        validate(dataclasses.replace(good, saved_at=((0, 1), (1, 1))))
    with pytest.raises(remat.RematValueError, match=r"every saved tensor needs a position .*\[1\]"):
        validate(dataclasses.replace(good, saved=frozenset({0, 1}), saved_at=((0, 1),)))
    with pytest.raises(remat.RematValueError, match=r"position must be a number of ops .*saved at 9"):
        validate(dataclasses.replace(good, saved_at=((1, 9),)))
    with pytest.raises(remat.RematValueError, match=r"saved_at must be a list of op counts .*line 3"):
        load(_write(tmp_path, _replace(3, '{"tensor":1,"nbytes":32,"saved":true,"saved_at":[-1]}')))


def test_a_gzip_file_whose_stream_is_damaged_is_refused(tmp_path: Path) -> None:
    import gzip

    data = bytearray(gzip.compress(("\n".join(GOOD) + "\n").encode()))
    data[20:30] = b"\xff" * 10  # the deflate stream, past the gzip header
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(remat.RematValueError, match=r"^remat\.trace\.load: "):
        load(path)


def test_save_refuses_a_trace_that_would_not_read_back_and_leaves_the_file(tmp_path: Path) -> None:
    """A field of another type than documented (a phase given as a string, a size as a float)
    made a file that ``load`` refused, or stopped halfway and cut a good file short."""
    good = load(_write(tmp_path, GOOD))
    path = tmp_path / "kept.jsonl.gz"
    save(good, path)
    before = path.read_bytes()
    op = good.events[0]
    assert isinstance(op, Op)
    for bad in (
        dataclasses.replace(good, events=(dataclasses.replace(op, phase="forward"), *good.events[1:])),  # type: ignore[arg-type]
        dataclasses.replace(
            good, tensors=(dataclasses.replace(good.tensors[0], nbytes=16.0), *good.tensors[1:])
        ),  # type: ignore[arg-type]
        dataclasses.replace(good, name=None),  # type: ignore[arg-type]
    ):
        with pytest.raises(
            remat.RematValueError, match=r"^remat\.trace\.save: every field of the trace must be"
        ):
            save(bad, path)
        assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.jsonl.gz", "t.jsonl"]
    assert load(path) == good


def test_version_1_and_2_files_still_read(tmp_path: Path) -> None:
    for version in (1, 2):
        old = _replace(1, GOOD[0].replace('"version":3', f'"version":{version}'))
        assert load(_write(tmp_path, old)) == load(_write(tmp_path, GOOD))
    calls = '"calls":{"m":1},"call_inputs":{"m":[0]},'
    later = _replace(1, GOOD[0].replace('"version":3,', f'"version":1,{calls}'))
    assert load(_write(tmp_path, later)).calls == (("m", 1),)  # version 1 files of later captures


def test_written_lines_are_one_json_object_each(tmp_path: Path) -> None:
    good = load(_write(tmp_path, GOOD))
    save(good, tmp_path / "again.jsonl")
    lines = (tmp_path / "again.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [json.loads(line) for line in GOOD]


_HAS_DTR = importlib.util.find_spec("remat.trace.dtr_log") is not None


@pytest.mark.skipif(not _HAS_DTR, reason="remat.trace.dtr_log (the DTR importer) is not in this checkout")
@pytest.mark.parametrize("log", ["resnet32-56", "transformer-10", "lstm-128"])
def test_dtr_logs_load_and_validate(log: str) -> None:
    trace = load(DTR_LOGS / f"{log}.log")
    assert trace.source == "dtr" and trace.ops and validate(trace) is trace
    assert trace.total_cost > 0 and trace.peak_bytes > trace.constant_bytes > 0
    assert {op.phase for op in trace.ops} >= {Phase.FORWARD, Phase.BACKWARD}


def test_a_save_writes_through_a_link_and_refuses_what_is_not_a_file(tmp_path: Path) -> None:
    """The file was written beside the path and renamed over it: a link was replaced by a file (the
    file it named left as it was), a device by a file, a ``.partial-`` file of the user's deleted,
    and the gzip header named the file written beside it."""
    trace = load(_write(tmp_path, GOOD))
    (tmp_path / "target.jsonl").write_text("old")
    (tmp_path / "link.jsonl").symlink_to("target.jsonl")
    (tmp_path / ".partial-step.jsonl").write_text("mine")
    save(trace, tmp_path / "link.jsonl")
    assert (tmp_path / "link.jsonl").is_symlink() and load(tmp_path / "target.jsonl") == trace
    save(trace, tmp_path / "step.jsonl")
    assert (tmp_path / ".partial-step.jsonl").read_text() == "mine"
    os.mkfifo(tmp_path / "pipe")
    refused = r"remat\.trace\.save: the path names a file .*not a regular file"
    with pytest.raises(remat.RematValueError, match=refused):
        save(trace, tmp_path / "pipe")
    save(trace, tmp_path / "step.jsonl.gz")
    header = (tmp_path / "step.jsonl.gz").read_bytes()[10:30]  # FNAME follows the 10-byte header
    assert header.startswith(b"step.jsonl\x00")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, a folder no file can be made in")
def test_a_save_into_a_folder_it_cannot_write_in_says_so_of_the_path_given() -> None:
    """It raised the OS's error, naming the temporary file it writes first."""
    trace = capture(lambda: (torch.randn(4, requires_grad=True) * 2).sum().backward(), repeats=1)
    with pytest.raises(
        remat.RematValueError,
        match=r"remat\.trace\.save: the trace is written to its path \(/proc/step\.jsonl: .+\); pass a path "
        r"in a folder this process may write in",
    ):
        save(trace, "/proc/step.jsonl")


def test_a_file_cut_short_is_said_to_be_truncated(tmp_path: Path) -> None:
    """Its saves, pointing past the ops the file still holds, were blamed first."""
    w = torch.randn(8, 8, requires_grad=True)
    trace = capture(lambda: (torch.tanh(w @ w) * 2).sum().backward(), repeats=1)
    save(trace, tmp_path / "t.jsonl")
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    for keep in range(2, len(lines)):
        cut.write_text("\n".join(lines[:keep]) + "\n")
        with pytest.raises(
            remat.RematValueError, match=r"the header's counts must match the file \(is it truncated\?\)"
        ):
            load(cut)
