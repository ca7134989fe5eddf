"""``remat sim``: the sweep from the command line, its JSON and its figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat._arguments import ratio_range
from remat.cli import main
from remat.sim.synthetic import training_step
from remat.trace import save


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "chain.jsonl"
    save(training_step(30), path)
    return path


def test_sweep_writes_json_and_plot(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    code = main(
        [
            "sim",
            str(trace_file),
            "--policies",
            "dtr,coop",
            "--ratios",
            "0.4:0.8:0.4",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    records = json.loads(out.read_text())
    assert [(r["policy"], r["ratio"]) for r in records] == [
        ("dtr", pytest.approx(0.4, abs=1e-6)),
        ("dtr", pytest.approx(0.8, abs=1e-6)),
        ("coop", pytest.approx(0.4, abs=1e-6)),
        ("coop", pytest.approx(0.8, abs=1e-6)),
    ]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "chain-30" in capsys.readouterr().out


def test_byte_counting_refuses_nothing_it_can_run(trace_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert (
        main(
            [
                "sim",
                str(trace_file),
                "--memory",
                "bytes",
                "--policies",
                "dtr",
                "--ratios",
                "0.5",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())[0]["layout"] is False


def test_unknown_policy_lists_the_registry(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", str(trace_file), "--policies", "dtr,fifo"])
    err = capsys.readouterr().err
    assert "remat.sim.cli: unknown eviction policy (got 'dtr,fifo'); use coop," in err and "dtr-eq" in err


def test_ratio_ranges() -> None:
    assert ratio_range("0.2:0.9:0.1") == [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert ratio_range("0.3,0.5") == [0.3, 0.5]
    for bad in ("0.2:0.9", "a,b", "0.5:1.5:0.5", "0.9:0.2:0.1", "0.1:inf:0.1", "0:1:1e-320"):
        with pytest.raises(Exception, match=r"remat\.sim\.cli: "):
            ratio_range(bad)


def test_byte_counting_runs_the_default_policies_that_count_bytes(trace_file: Path, tmp_path: Path) -> None:
    """``dte`` and ``coop`` read addresses: with ``--memory bytes`` and no ``--policies`` the sweep
    was refused after reading the traces; it runs ``dtr`` alone."""
    out = tmp_path / "out.json"
    assert main(["sim", str(trace_file), "--memory", "bytes", "--ratios", "0.5", "--json", str(out)]) == 0
    assert [r["policy"] for r in json.loads(out.read_text())] == ["dtr"]


def test_a_policy_that_reads_addresses_under_byte_counting_is_refused_in_the_commands_words(
    trace_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal gave the Python API's advice ("pass layout=True")."""
    assert main(["sim", str(trace_file), "--memory", "bytes", "--policies", "coop"]) == 2
    assert "pass --memory address" in capsys.readouterr().err


def test_the_plot_of_runs_that_never_evicted(trace_file: Path, tmp_path: Path) -> None:
    """No victim search to draw on a log scale: matplotlib raised after the table."""
    png = tmp_path / "out.png"
    assert main(["sim", str(trace_file), "--policies", "dtr", "--ratios", "1", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_thrash_limit_below_one_is_refused_before_the_traces_are_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "none.jsonl"  # never read: the limit is refused first
    assert main(["sim", str(missing), "--thrash-limit", "0.5"]) == 2
    assert capsys.readouterr().err.startswith(
        "remat.sim.simulate: thrash_limit is an overhead and must be at least 1"
    )
