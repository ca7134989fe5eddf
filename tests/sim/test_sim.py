"""The simulator: DTR's published figures, budgets and their errors, results, sweeps."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest

from remat import RematValueError
from remat.sim import Outcome, SimResult, facts, simulate, sweep
from remat.sim.synthetic import training_step
from remat.trace import Trace, capture, load
from remat.trace.builder import TraceBuilder
from remat.trace.types import Op, Release, TensorInfo

LOGS = Path(__file__).resolve().parents[2] / "data" / "dtr"


@functools.cache
def log(name: str) -> Trace:
    return load(LOGS / f"{name}.log")


@functools.cache
def chain() -> Trace:
    return training_step(40)


# The DTR authors' simulator with h_DTR (Kirisame et al., ICLR 2021), budget ratio 0.3 / 0.5 / 0.8 of
# the unconstrained peak, constants included. Their simulator counts bytes: layout=False.
PAPER = {
    "resnet32-56": (1.18, 1.11, 1.02),
    "transformer-10": (1.12, 1.06, 1.02),
    "lstm-128": (1.30, 1.07, 1.03),
}


@pytest.mark.parametrize(
    ("name", "ratio", "expected"),
    [(name, ratio, figures[i]) for name, figures in PAPER.items() for i, ratio in enumerate((0.3, 0.5, 0.8))],
)
def test_dtr_reproduces_the_papers_simulated_overheads(name: str, ratio: float, expected: float) -> None:
    result = simulate(log(name), ratio, "dtr", layout=False)
    assert result.outcome is Outcome.OK
    assert result.overhead == pytest.approx(expected, rel=0.05)
    assert result.peak_bytes <= result.budget


def test_address_memory_fragments_where_byte_counting_does_not() -> None:
    counted = simulate(log("lstm-128"), 0.9, "dtr-eq", layout=False)
    addressed = simulate(log("lstm-128"), 0.9, "dtr-eq", layout=True)
    coop = simulate(log("lstm-128"), 0.9, "coop", layout=True)
    assert addressed.fragmentation > 5 * counted.fragmentation
    assert addressed.overhead > counted.overhead + 0.1  # a 35 MB block costs hundreds of evictions
    assert coop.overhead < addressed.overhead and coop.fragmentation < addressed.fragmentation


@pytest.mark.parametrize(
    ("name", "ratio"), [("transformer-10", 0.5), ("transformer-10", 0.8), ("resnet32-56", 0.6)]
)
def test_coop_is_no_worse_than_dtr_and_dte_on_address_pools(name: str, ratio: float) -> None:
    coop, dtr, dte = (simulate(log(name), ratio, policy) for policy in ("coop", "dtr", "dte"))
    assert all(r.outcome is Outcome.OK for r in (coop, dtr, dte))
    assert coop.overhead <= min(dtr.overhead, dte.overhead)
    assert coop.digest == dtr.digest  # the same values, whatever was recomputed


@pytest.mark.parametrize(
    ("budget", "error", "match"),
    [
        (1.5, ValueError, r"remat\.sim\.simulate: a ratio budget must lie in \(0, 1\] \(got 1\.5\)"),
        (-0.5, ValueError, r"remat\.sim\.simulate: a ratio budget must lie in \(0, 1\]"),
        (math.nan, ValueError, r"remat\.sim\.simulate: a ratio budget must lie in \(0, 1\]"),
        (-100, ValueError, r"remat\.sim\.simulate: a byte count must be positive \(got -100\)"),
        (0, ValueError, r"remat\.sim\.simulate: a byte count must be positive"),
        (None, TypeError, r"remat\.sim\.simulate: a byte count must be an int or a string \(got NoneType\)"),
        ([0.5], TypeError, r"remat\.sim\.simulate: a byte count must be an int or a string"),
        (True, TypeError, r"remat\.sim\.simulate: a byte count is required, not a ratio or a bool"),
        ("lots", ValueError, r"remat\.sim\.simulate: cannot parse this byte size \(got 'lots'\)"),
    ],
)
def test_bad_budgets_are_refused(budget: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        simulate(chain(), budget, "dtr")  # type: ignore[arg-type]


def test_budget_strings_and_bytes() -> None:
    assert simulate(chain(), "200MB", "dtr").budget == 200_000_000
    assert simulate(chain(), 300_000_000, "dtr").budget == 300_000_000
    assert simulate(chain(), 0.5, "dtr").budget == math.floor(0.5 * chain().peak_bytes)


def test_bad_policies_and_options_are_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"remat\.sim\.simulate: unknown eviction policy \(got 'fifo'\); use one of coop, .*lru",
    ):
        simulate(chain(), 0.5, "fifo")
    with pytest.raises(
        ValueError, match=r"remat\.sim\.simulate: this policy reads addresses.*'dte' with layout=False"
    ):
        simulate(chain(), 0.5, "dte", layout=False)
    with pytest.raises(
        TypeError, match=r"remat\.sim\.simulate: policy must be a registered name or an eviction policy"
    ):
        simulate(chain(), 0.5, 3)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"remat\.sim\.simulate: thrash_limit is an overhead and must be at least 1"
    ):
        simulate(chain(), 0.5, "dtr", thrash_limit=0.5)
    with pytest.raises(TypeError, match=r"remat\.sim\.simulate: thrash_limit must be a number"):
        simulate(chain(), 0.5, "dtr", thrash_limit="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"remat\.sim\.simulate: unknown fit \(got 'worst'\)"):
        simulate(chain(), 0.5, "dtr", fit="worst")
    with pytest.raises(ValueError, match=r"remat\.sim\.simulate: the budget comes to no bytes"):
        simulate(chain(), 1e-12, "dtr")


def test_out_of_memory_reports_the_figure_needed() -> None:
    known = facts(chain(), inplace=False)
    result = simulate(chain(), known.working_set - 1, "dtr")
    assert result.outcome is Outcome.OOM and result.needed_bytes == known.worst_case
    assert "below the working set" in result.reason and "never runs out" in result.reason
    assert math.isnan(result.overhead) and "OOM" in str(result)
    assert result.to_dict()["overhead"] is None
    assert simulate(chain(), known.worst_case, "dtr", layout=False).outcome is not Outcome.OOM


def test_thrashing_stops_the_run() -> None:
    result = simulate(chain(), 0.3, "lru", thrash_limit=1.2)
    assert result.outcome is Outcome.THRASHED and result.overhead > 1.2
    assert "thrashed" in str(result)


def test_result_is_frozen_readable_and_serializable() -> None:
    result = simulate(chain(), 0.5, "coop")
    assert isinstance(result, SimResult) and result.outcome is Outcome.OK
    assert result.evictions > 0 and result.recomputations > 0 and result.searches > 0
    assert 0.0 <= result.fragmentation < 1.0 and result.search_seconds > 0.0
    assert result.tensors == len(chain().tensors) and result.ratio == pytest.approx(0.5, abs=1e-6)
    assert str(result).startswith("coop on chain-40 at 0.50") and "overhead 1." in str(result)
    record = json.loads(json.dumps(result.to_dict()))
    assert record["outcome"] == "ok" and record["policy"] == "coop"
    with pytest.raises(AttributeError):
        result.overhead = 1.0  # type: ignore[misc]


def test_sweep_nests_traces_policies_ratios() -> None:
    seen: list[SimResult] = []
    results = sweep([chain()], ["dtr-eq", "coop"], [0.4, 0.8], progress=seen.append)
    assert [(r.policy, round(r.ratio, 2)) for r in results] == [
        ("dtr-eq", 0.4),
        ("dtr-eq", 0.8),
        ("coop", 0.4),
        ("coop", 0.8),
    ]
    assert seen == results
    with pytest.raises(ValueError, match=r"remat\.sim\.simulate: unknown eviction policy"):
        sweep([chain()], ["dtr", "nope"], [0.5])


def test_a_constant_released_unread_after_the_first_made_tensor() -> None:
    # A trace's constants exist from its start (NOTE [first sight] in remat.sim.backend): one that
    # comes after a made tensor and whose only event is its release is counted, not skipped.
    mib = 1 << 20
    tensors = (
        TensorInfo(0, mib, constant=True),
        TensorInfo(1, mib),
        TensorInfo(2, 4 * mib, constant=True),
        TensorInfo(3, mib),
    )
    events = (
        Op(0, "a", (0,), (1,), cost=1.0),
        Release(2),
        Op(1, "b", (1,), (3,), cost=1.0),
        Release(1),
        Release(3),
    )
    trace = Trace(tensors, events, name="released")
    result = simulate(trace, 10 * mib, "dtr", layout=False)
    assert result.outcome is Outcome.OK and result.peak_bytes >= 6 * mib  # both constants and a's output
    assert simulate(trace, 6 * mib - 1, "dtr", layout=False).outcome is Outcome.OOM


def test_a_digest_is_the_same_in_every_process() -> None:
    """A constant's value was hashed with a string, which Python salts per process: two runs of
    the same simulation wrote different digests to ``remat sim --json``."""
    import subprocess
    import sys

    path = str(LOGS / "lstm-128.log")
    code = "from remat.sim import simulate; from remat.trace import load; "
    code += f"print(simulate(load({path!r}), 10**12, 'lru', layout=False).digest)"
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(digests) == 1 and simulate(log("lstm-128"), 10**12, "lru", layout=False).digest == int(
        digests.pop()
    )


def test_sweep_takes_one_policy_name_as_well_as_a_list() -> None:
    """A name was taken as a list of its letters ("unknown eviction policy (got 'd')")."""
    results = sweep([training_step(10)], "dtr", [0.8])
    assert [r.policy for r in results] == ["dtr"]


def test_a_ratio_of_a_trace_that_holds_no_bytes_says_so() -> None:
    """It said the budget came to no bytes and to raise it, which no ratio could."""
    empty = capture(lambda: None, repeats=1)
    with pytest.raises(
        RematValueError,
        match=r"remat\.sim\.simulate: a ratio is of the trace's peak, and this trace holds no bytes "
        r"\(trace .*, peak 0 bytes\); simulate a step that makes tensors",
    ):
        simulate(empty, 0.5, "dtr")


def test_a_view_op_reading_a_tensor_made_from_its_base_is_refused_not_endless() -> None:
    """Restoring the base re-derives its view, whose op reads a tensor made from the base: the
    recursion had no end (a RecursionError, even with the simulator's deeper limit). No PyTorch op
    does this; a hand-made trace can."""
    b = TraceBuilder()
    x = b.tensor(1024, constant=True)
    base = b.tensor(4096)
    b.op("f", (x,), (base,), 1.0)
    made = b.tensor(4096)
    b.op("g", (base,), (made,), 1.0)
    view = b.tensor(0, alias_of=base)
    b.op("view_with", (base, made), (view,), 0.1)
    b.release(base)
    b.release(made)
    previous, chain = x, []
    for i in range(8):
        chain.append(t := b.tensor(4096))
        b.op(f"h{i}", (previous,), (t,), 1.0)
        previous = t
    b.op("use", (view, previous), (b.tensor(4096),), 1.0)
    for t in chain:
        b.release(t)
    trace = b.trace("cycle")
    assert simulate(trace, 0.9, "dtr").outcome is Outcome.OK
    with pytest.raises(
        RematValueError, match=r"remat\.core\.Runtime: restoring a tensor needs that tensor itself"
    ):
        simulate(trace, 0.5, "dtr")
