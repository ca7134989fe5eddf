"""The ``remat`` command line: bad arguments are refused before any work, and remat's own errors
print as one line with exit code 2 (a traceback only with ``--debug``); budget strings read as a
user writes them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import remat
from remat import cli
from remat._units import parse_budget, parse_bytes

LOG = Path(__file__).resolve().parents[1] / "data" / "dtr" / "lstm-128.log"


def test_a_bad_budget_is_refused_before_the_model_is_traced(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    traced = []
    monkeypatch.setattr(remat.zoo, "build", lambda *a, **k: traced.append(a))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["plan", "--model", "gpt2", "--budget", "lots"])
    assert stopped.value.code == 2 and not traced
    err = capsys.readouterr().err
    assert "remat.plan: cannot parse this byte size (got 'lots')" in err and "Traceback" not in err
    for option, value in (("--points", "1"), ("--solvers", "chain,magic")):
        with pytest.raises(SystemExit):
            cli.main(["plan", "--model", "gpt2", option, value])
        assert "remat.plan:" in capsys.readouterr().err
    assert not traced


def test_remat_errors_print_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trace", "info", "/no/such/trace.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("remat.trace.load: no such file")
    with pytest.raises(remat.RematError, match="no such file"):
        cli.main(["--debug", "trace", "info", "/no/such/trace.jsonl"])


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (
            ["plan", "--model", "gpt2", "--save", "/no/such/folder/p.json"],
            r"remat\.plan: --save names a file in a",
        ),
        (
            ["trace", "--model", "gpt2", "--tiny", "--out", "/no/such/folder/t.jsonl"],
            r"remat\.trace: --out names",
        ),
        (
            ["memory", "--model", "gpt2", "--budget", "0.9", "--out", "m.txt"],
            r"remat\.memory: --out is a picture",
        ),
        (["sim", str(LOG), "--plot", "o.txt"], r"remat\.sim: --plot is a picture, .*\.png"),
        (
            ["plan", "--model", "gpt2", "--save", "/tmp"],
            r"remat\.plan: --save names a file, not a folder \(/tmp is a",
        ),
        # a folder that exists but takes no new file: the error came after the whole sweep
        (["sim", str(LOG), "--json", "/proc/x.json"], r"remat\.sim: --json names a file this process may"),
    ],
)
def test_the_files_a_command_writes_are_checked_before_it_works(
    argv: list[str], pattern: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    built = []
    monkeypatch.setattr(remat.zoo, "build", lambda *a, **k: built.append(a))
    assert cli.main(argv) == 2 and not built
    assert re.match(pattern, capsys.readouterr().err)


def test_a_file_that_is_not_text_is_refused_as_a_trace(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    import gzip

    for name, body in (
        ("binary.jsonl", gzip.compress(b'{"format": 1}')),
        ("text.jsonl.gz", b'{"format": 1}\n'),
    ):
        path = Path(str(tmp_path)) / name
        path.write_bytes(body)
        assert cli.main(["trace", "info", str(path)]) == 2
        assert capsys.readouterr().err.startswith(
            "remat.trace.load: a trace is text (JSON lines), gzip-compressed"
        )


def test_a_trace_whose_tensors_own_more_than_a_pool_holds_is_refused(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """A size edited to 10**30 loaded, and the simulator crashed in its pool."""
    from remat.sim.synthetic import training_step
    from remat.trace import save

    path = Path(str(tmp_path)) / "huge.jsonl"
    save(training_step(3), path)
    lines = path.read_text().splitlines()
    k = next(i for i, line in enumerate(lines) if '"nbytes"' in line)
    lines[k] = re.sub(r'"nbytes": *\d+', '"nbytes":' + str(10**30), lines[k])
    path.write_text("\n".join(lines) + "\n")
    assert cli.main(["sim", str(path), "--ratios", "0.5"]) == 2
    assert "the tensors own at most 2**60 bytes in all" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0.5", 0.5), (".25", 0.25), ("1.0", 1.0), ("1e9", 10**9), ("2GB", 2 * 10**9), ("1.5GiB", 3 * 2**29)],
)
def test_budget_strings_read_as_written(text: str, expected: float) -> None:
    assert parse_budget(text, "plan") == expected
    assert type(parse_budget(text, "plan")) is type(expected)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("-1GB", r"remat\.plan: a byte count must be positive \(got '-1GB'\)"),
        ("0", r"remat\.plan: a ratio budget must lie in \(0, 1\] \(got 0\.0\)"),
        ("0.5 B", r"a byte count in B is a whole number \(got '0\.5 B'\)"),
        ("lots", r"remat\.plan: cannot parse this byte size \(got 'lots'\)"),
        ("1.5", r"remat\.plan: a ratio budget must lie in \(0, 1\] \(got 1\.5\)"),
        ("1e400", r"remat\.plan: cannot parse this byte size \(got '1e400'\); pass a finite size"),
    ],
)
def test_bad_budget_strings_say_what_is_wrong(text: str, pattern: str) -> None:
    with pytest.raises(remat.RematValueError, match=pattern):
        parse_budget(text, "plan")


@pytest.mark.parametrize("text", ["0.5", "1.5"])
def test_a_ratio_where_bytes_are_asked_for_says_so(text: str) -> None:
    """``1.5`` was floored to one byte, and ``0.5`` refused with a hint to pass 0.5."""
    with pytest.raises(
        remat.RematValueError, match=rf"no unit is a whole number \(got '{text}'\); pass bytes such as"
    ):
        parse_bytes(text, "memory.parse_bytes")
    assert parse_bytes("1.5KiB") == 1536 and parse_bytes("1e3") == 1000


def test_capture_shows_its_progress(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    out = f"{tmp_path}/gpt2.jsonl"
    assert cli.main(["trace", "--model", "gpt2", "--tiny", "--fake", "--out", out]) == 0
    err = capsys.readouterr().err  # the display's last state: k/N ops, elapsed, time left
    assert re.search(
        r"captured gpt2 \(tiny\) on fake tensors: ops .* (\d+)/\1 elapsed \d:\d\d:\d\d left", err
    ), err


def test_small_argument_slips_are_refused(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder given as a trace said "no such file"; ``--top -1`` was taken; a ratio range of
    seven million steps was expanded before anything ran."""
    assert cli.main(["trace", "info", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("remat.trace.load: a trace is a file, not a folder")
    for argv in (["trace", "info", str(LOG), "--top", "-1"], ["sim", str(LOG), "--ratios", "0.2:0.9:1e-7"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
    assert "a range gives at most 1000 ratios (got 7000001" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["plan", "--model", "gpt2", "--budget", "0.5", "--link", "25GB/s", "--host-budget", "abc"],
            "remat.plan: cannot parse this byte size (got 'abc')",
        ),
        (
            ["memory", "--model", "gpt2", "--thrash-limit", "0", "--out", "m.png"],
            "remat.memory: --thrash-limit is an overhead: a finite number above 1",
        ),
    ],
)
def test_limits_are_read_before_any_step_runs(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were read after the step's capture (11 s) or the plain step."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(said)


def test_a_size_the_machine_cannot_hold_is_one_line_in_remats_words(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch's allocator failing on sizes asked for printed its traceback, with exit code 1."""
    import remat.pipeline.cli as pipeline_cli

    def too_big(args: object) -> int:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(pipeline_cli, "run", too_big)
    assert cli.main(["pipeline", "--stages", "2", "--microbatches", "2", "--budget", "4MB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "remat.pipeline: the sizes asked for need more memory than there is ([enforce fail"
    ), err
    monkeypatch.setattr(pipeline_cli, "run", lambda args: (_ for _ in ()).throw(RuntimeError("another")))
    with pytest.raises(RuntimeError, match="another"):  # torch's other errors keep their traceback
        cli.main(["pipeline", "--stages", "2", "--microbatches", "2", "--budget", "4MB"])


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (
            ["plan", "--model", "gpt2", "--repeats", "0"],
            "remat.plan: argument --repeats: a whole number of at least 1 (got 0)",
        ),
        (["plan", "--model", "alexnet"], "remat.plan: argument --model: invalid choice: 'alexnet'"),
        (
            ["pipeline", "--stages", "x"],
            "remat.pipeline: argument --stages: a whole number of at least 1 (got 'x')",
        ),
        (
            ["plan", "--model", "gpt2", "--budget", "lots"],
            "remat.plan: cannot parse this byte size (got 'lots')",
        ),
        ([], "remat: the following arguments are required: command (got: remat); see remat --help"),
        (  # a nested command is named whole: it said "remat.info ... see remat info --help"
            ["trace", "info"],
            "remat.trace.info: the following arguments are required: file (got: remat trace info); "
            "see remat trace info --help",
        ),
        (  # before the model was built and its capture had started
            ["trace", "--model", "gpt2", "--repeats", "0"],
            "remat.trace: argument --repeats: a whole number of at least 1 (got 0); see remat trace --help",
        ),
    ],
)
def test_argparses_own_errors_are_one_line_in_remats_words(
    argv: list[str], start: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They printed argparse's usage block and ``remat plan: error: argument --budget: remat.plan: ...``
    (5 to 10 lines), and ``must be at least 1: 0`` with no advice."""
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and err.startswith(start), err
