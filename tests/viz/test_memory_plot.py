"""The CPU allocator's timeline (``track(allocator=True)``), its picture and ``remat memory``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import remat
from remat.cli import main
from remat.memory import MemoryTracker
from remat.viz.cli import ratio
from remat.viz.steps import StepRun, draw

MIB = 2**20
PNG = b"\x89PNG\r\n\x1a\n"


def _eight_mib() -> tuple[MemoryTracker, int]:
    """A block that holds 8 MiB for a while, and a ``time.time_ns()`` moment in the middle of it.
    The sleeps put a millisecond between the moment and each event, far more than any rounding
    of the profiler's clock."""
    with remat.memory.track(allocator=True) as m:
        x = torch.empty(8 * MIB, dtype=torch.uint8)
        time.sleep(0.001)
        middle = time.time_ns()
        time.sleep(0.001)
        del x
    return m, middle


def test_allocator_timeline_agrees_with_peak_and_current() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
    x = torch.randn(32, 64)
    with remat.memory.track(allocator=True) as m:
        model(x).sum().backward()
        kept = torch.ones(1000)
    samples = m.allocator_timeline
    assert samples
    assert max(s.bytes for s in samples) == m.peak_bytes
    assert samples[-1].bytes == m.current_bytes
    assert m.current_bytes >= kept.nbytes
    times = [s.time_ns for s in samples]
    assert times == sorted(times)


def test_a_known_allocation_is_a_step_of_its_size() -> None:
    m, _ = _eight_mib()
    held = [0, *(s.bytes for s in m.allocator_timeline)]
    steps = [b - a for a, b in zip(held, held[1:], strict=False)]
    assert 8 * MIB in steps
    assert steps.index(-8 * MIB) > steps.index(8 * MIB)
    assert (m.peak_bytes, m.current_bytes) == (8 * MIB, 0)


def test_the_profiler_stamps_events_in_the_clock_of_time_ns() -> None:
    """NOTE [profiler clock]: a moment taken with time.time_ns() lies between the events around it."""
    before = time.time_ns()
    time.sleep(0.001)
    m, middle = _eight_mib()
    allocation, free = (s.time_ns for s in m.allocator_timeline if s.bytes in (8 * MIB, 0))
    assert before < m.start_ns <= allocation < middle < free <= m.end_ns


def test_allocator_timeline_per_device(device: torch.device) -> None:
    with remat.memory.track(device, allocator=True) as m:
        x = torch.empty(1024, device=device)
        del x
    if device.type == "cpu":
        assert m.allocator_timeline is not None and len(m.allocator_timeline) == 2
    else:  # CUDA: allocator statistics, no event stream; the picture says so
        assert m.allocator_timeline is None
        fig = remat.memory.plot({"step": m})
        assert [t.get_gid() for t in fig.axes[0].texts] == ["no-timeline"]


def test_without_allocator_there_is_no_allocator_timeline() -> None:
    with remat.memory.track() as m:
        torch.ones(10)
    assert m.allocator_timeline is None
    fig = remat.memory.plot({"counted": m})
    assert "allocator=False" in fig.axes[0].texts[0].get_text()


def test_plot_draws_the_budget_and_the_marks_where_they_happened(tmp_path: Path) -> None:
    m, middle = _eight_mib()
    path = tmp_path / "memory.png"
    fig = remat.memory.plot(
        {"plain": m, "dynamic": m},
        path,
        budget={"dynamic": "4MiB"},
        marks={"dynamic": [(middle, "evict"), (middle, "recompute"), (m.end_ns, "recompute")]},
        notes={"dynamic": "stopped: a reason"},
        title="one step",
    )
    assert path.read_bytes()[:8] == PNG
    plain, dynamic = fig.axes[:2]
    assert [line.get_gid() for line in plain.lines] == ["held"]
    lines = {line.get_gid(): line for line in dynamic.lines}
    assert list(lines) == ["held", "evict", "recompute", "budget"]
    assert list(lines["budget"].get_ydata()) == [4.0, 4.0]
    at = (middle - m.start_ns) / 1e6
    assert list(lines["evict"].get_xdata()) == [at]
    assert list(lines["evict"].get_ydata()) == [8.0], "the mark sits on the curve, at the 8 MiB held"
    assert list(lines["recompute"].get_ydata()) == [8.0, 0.0]
    assert max(lines["held"].get_ydata()) == 8.0
    assert [t.get_text() for t in dynamic.texts] == ["stopped: a reason"]
    assert [t.get_text() for t in dynamic.get_legend().get_texts()] == [
        "evict (1)",
        "recompute (2)",
        "budget 4.00 MiB",
    ]


def test_a_budget_for_every_panel() -> None:
    m, _ = _eight_mib()
    fig = remat.memory.plot({"a": m, "b": m}, budget=6 * MIB)
    assert all("budget" in [line.get_gid() for line in ax.lines] for ax in fig.axes[:2])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"runs": {}}, remat.RematValueError, r"remat\.memory\.plot: needs at least one run"),
        ({"runs": [None]}, remat.RematTypeError, r"runs map labels to trackers \(got list\)"),
        ({"runs": {"a": 3}}, remat.RematTypeError, r"each run is a MemoryTracker \(got int for 'a'\)"),
        (
            {"budget": {"b": 100}},
            remat.RematValueError,
            r"budget names a run that is not plotted \(got 'b'\)",
        ),
        ({"budget": 0.5}, remat.RematTypeError, r"remat\.memory\.plot: a byte count is required"),
        ({"marks": {"a": [(1, "drop")]}}, remat.RematValueError, r"a mark is a \(time_ns, kind\) pair"),
        ({"marks": [(1, "evict")]}, remat.RematTypeError, r"marks is a mapping from run labels"),
        ({"notes": {"z": "x"}}, remat.RematValueError, r"notes names a run that is not plotted"),
    ],
)
def test_plot_refuses_bad_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    m, _ = _eight_mib()
    arguments: dict[str, object] = {"runs": {"a": m}, **kwargs}
    with pytest.raises(error, match=match):
        remat.memory.plot(**arguments)  # type: ignore[arg-type]


def test_a_picture_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    """A format matplotlib has no writer for, or a missing folder, raised matplotlib's or Python's
    error."""
    m, _ = _eight_mib()
    for path in (tmp_path / "memory.txt", tmp_path / "missing" / "memory.png"):
        with pytest.raises(
            remat.RematValueError, match=r"remat\.memory\.plot: the picture could not be written"
        ):
            remat.memory.plot({"a": m}, path)


def test_cli_writes_the_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gpt2.png"
    assert main(["memory", "--model", "gpt2", "--budget", "0.9", "--out", str(path)]) == 0
    assert path.read_bytes()[:8] == PNG
    out = capsys.readouterr().out
    assert "plain" in out and "dtr 90%" in out and f"picture: {path}" in out
    assert "max |grad diff|" in out


def test_cli_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for text in ("1.5", "0", "half"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"remat\.memory\.cli: a budget is a ratio"):
            ratio(text)
    with pytest.raises(SystemExit):
        main(["memory", "--model", "gpt2", "--budget", "2", "--out", str(tmp_path / "x.png")])
    assert "a budget is a ratio of the plain peak in (0, 1] (got '2')" in capsys.readouterr().err
    code = main(["memory", "--model", "gpt2", "--image", "32", "--out", str(tmp_path / "x.png")])
    assert code == 2
    assert "remat.zoo.build: 'gpt2' takes seq, not image" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_stopped_run_keeps_the_rule_of_its_error() -> None:
    failure = (
        "remat.dynamic: the budget makes policy 'dtr' thrash: recomputation passed thrash_limit=3.0 "
        "(budget 4 KiB; 3 recomputations, stopped at op 12 (aten.mm.default)); raise the budget"
    )
    run = StepRun("dtr 50%", MemoryTracker(torch.device("cpu")), failure=failure)
    assert run.rule == "the budget makes policy 'dtr' thrash: recomputation passed thrash_limit=3.0"


def test_measured_runs_are_drawn_with_their_budget_marks_and_failure() -> None:
    m, middle = _eight_mib()
    runs = [
        StepRun("plain", m),
        StepRun("dtr 50%", m, 4 * MIB, 5 * MIB, ((middle, "evict"),)),
        StepRun("coop 10%", m, MIB, 2 * MIB, failure="remat.dynamic: too small (budget 2 MiB); raise it"),
    ]
    fig = draw(runs, None)
    gids = [[line.get_gid() for line in ax.lines] for ax in fig.axes[:3]]
    assert gids == [["held"], ["held", "evict", "budget"], ["held", "budget"]]
    assert [t.get_text() for t in fig.axes[2].texts] == ["stopped: too small"]


def test_a_dollar_in_a_label_a_note_or_the_title_is_drawn_as_written(tmp_path: Path) -> None:
    """matplotlib reads text between two "$" as math: "cost $5 and $1" came out in italics."""
    with remat.memory.track(allocator=True) as tracked:
        torch.randn(64).sum()
    label = "cost $5 and $1"
    fig = remat.memory.plot({label: tracked}, tmp_path / "p.png", notes={label: "a $x$ note"}, title="t $1$")
    ax = fig.axes[0]
    note = next(t for t in ax.texts if t.get_gid() == "note")
    assert ax.title.get_text().startswith(label) and note.get_text() == "a $x$ note"
    assert not ax.title.get_parse_math() and not note.get_parse_math()


def test_a_path_without_an_extension_is_written_as_named(tmp_path: Path) -> None:
    """matplotlib wrote ``p`` to ``p.png``."""
    with remat.memory.track(allocator=True) as tracked:
        torch.randn(64).sum()
    remat.memory.plot({"run": tracked}, tmp_path / "p")
    assert (tmp_path / "p").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "p.png").exists()
