"""Swapping victims to the host in the simulator (remat.core.swap): values, counts, link speeds."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat import Link
from remat.cli import main
from remat.core.policies import get
from remat.sim import Outcome, facts, simulate
from remat.sim.synthetic import random_program
from remat.trace import Trace, load

LOGS = Path(__file__).resolve().parents[2] / "data" / "dtr"
FAST = Link(d2h=1e15, h2d=1e15, latency=0)
SLOW = Link(d2h="1KB/s", h2d="1KB/s")


@functools.cache
def log(name: str) -> Trace:
    return load(LOGS / f"{name}.log")


@pytest.mark.parametrize("policy", ["dtr", "coop"])
def test_a_fast_link_swaps_instead_of_recomputing(policy: str) -> None:
    plain = simulate(log("resnet32-56"), 0.6, policy)
    swapped = simulate(log("resnet32-56"), 0.6, policy, link=FAST)
    assert plain.outcome is swapped.outcome is Outcome.OK
    assert plain.swaps == 0 and not plain.link
    assert swapped.swaps > 0 and swapped.reloads > 0
    assert swapped.recomputations < plain.recomputations
    assert swapped.overhead < plain.overhead
    assert swapped.host_peak_bytes > 0 and swapped.peak_bytes <= swapped.budget
    assert swapped.digest == plain.digest  # every reload brought back the value it sent


def test_a_slow_link_swaps_nothing() -> None:
    plain = simulate(log("resnet32-56"), 0.6, "coop")
    slow = simulate(log("resnet32-56"), 0.6, "coop", link=SLOW)
    assert (slow.swaps, slow.reloads, slow.host_peak_bytes, slow.stall_seconds) == (0, 0, 0, 0.0)
    assert (slow.overhead, slow.evictions, slow.recomputations) == (
        plain.overhead,
        plain.evictions,
        plain.recomputations,
    )


def test_the_result_names_the_link_and_the_overhead_counts_stalls() -> None:
    result = simulate(log("resnet32-56"), 0.3, "dtr", link=Link("25GB/s", "25GB/s"))
    assert result.label == "dtr + swap" and result.link.startswith("Link(")
    assert "swaps" in str(result) and "host peak" in str(result)
    assert json.loads(json.dumps(result.to_dict()))["swaps"] == result.swaps
    assert result.overhead >= 1.0 + result.stall_seconds / sum(op.cost for op in log("resnet32-56").ops)


@settings(max_examples=25, deadline=None)
@given(
    st.builds(random_program, st.randoms(use_true_random=False), st.integers(1, 25), st.integers(1, 3)),
    st.sampled_from(["dtr", "dte", "coop"]),
    st.floats(0.0, 1.0),
)
def test_swapping_keeps_values_and_the_budget(trace: Trace, policy: str, fraction: float) -> None:
    worst = facts(trace, get(policy).inplace).worst_case
    budget = worst + int(fraction * max(0, trace.peak_bytes - worst))
    swapped = simulate(trace, budget, policy, thrash_limit=10.0, link=FAST)
    if swapped.outcome is Outcome.OK:  # every op read the values of the plain run, or it raised
        assert swapped.peak_bytes <= swapped.budget
        assert swapped.reloads <= swapped.swaps <= swapped.evictions
        assert swapped.digest == simulate(trace, 10**12, "lru", layout=False).digest


def test_a_link_that_is_not_a_link_is_refused() -> None:
    with pytest.raises(
        TypeError, match=r"remat\.sim\.simulate: link must be a remat\.Link or None \(got '25GB/s'\)"
    ):
        simulate(log("resnet32-56"), 0.5, "dtr", link="25GB/s")  # type: ignore[arg-type]


def test_cli_runs_each_policy_with_and_without_swapping(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    trace = str(LOGS / "resnet32-56.log")
    assert (
        main(["sim", trace, "--policies", "dtr", "--ratios", "0.6", "--link", "1000TB/s", "--json", str(out)])
        == 0
    )
    records = json.loads(out.read_text())
    assert [(r["policy"], bool(r["link"])) for r in records] == [("dtr", False), ("dtr", True)]
    assert records[1]["swaps"] > 0 and records[0]["swaps"] == 0
    assert "dtr + swap" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["sim", trace, "--link", "fast"])
    assert "remat.sim.cli: cannot parse this rate (got 'fast')" in capsys.readouterr().err
