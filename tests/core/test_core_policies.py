"""Eviction policies: the registry, each policy's choice on a staged pool, and exact h_DTR."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.core.classes import EvictedClasses
from remat.core.graph import Column, Graph
from remat.core.neighbourhood import Neighbourhoods
from remat.core.policies import get, names
from remat.core.policies.base import TICK, candidates
from remat.core.policies.coop import compute_dense
from remat.core.policies.dtr import DTR
from remat.core.pool import FREE, AddressPool
from remat.sim import Outcome, facts, simulate
from remat.sim.synthetic import random_program
from remat.trace.types import Op, Trace


def staged(pieces: list[tuple[int, float, str]], capacity: int = 100) -> Any:
    """A runtime-shaped object over an address pool laid out as ``pieces``: (bytes, cost, state)
    with state "free", "evictable" or "locked", in address order. All were last used at time 0;
    the clock is 1."""
    graph, pool, last = Graph(), AddressPool(capacity), Column()
    evictable, nearby, resident, owners = Column(bool), Column(), [], []
    for nbytes, cost, state in pieces:
        storage = graph.add_storage(nbytes, -1, False, ())
        graph.cost[storage] = cost
        graph.cost_array[storage] = cost
        last.append(0.0)
        nearby.append(0.0)
        evictable.append(state == "evictable")
        pool.allocate(storage, nbytes)
        resident.append(True)
        owners.append((storage, state))
    for storage, state in owners:
        if state == "free":
            pool.free(storage)
    return SimpleNamespace(
        graph=graph,
        pool=pool,
        last=last,
        evictable=evictable,
        evicted_nearby=nearby,
        resident=resident,
        classes=EvictedClasses(),
        regions=Neighbourhoods(),
        clock=1.0,
    )


def test_registry_lists_every_policy_and_rejects_unknown_names() -> None:
    assert {"dtr", "dtr-eq", "dtr-local", "dte", "lru", "largest", "coop"} <= set(names())
    assert {
        "coop-no-layout",
        "coop-no-opguided",
        "coop-no-inplace",
        "coop-per-byte",
        "coop-total",
        "coop-exact",
    } <= set(names())
    assert get("dte").name == "dte"
    with pytest.raises(
        ValueError,
        match=r"remat\.core\.policies\.get: unknown eviction policy \(got 'nope'\); use one of .*dtr-eq",
    ):
        get("nope")


@pytest.mark.parametrize(
    ("name", "dense"),
    [
        ("cudnn_convolution", True),
        ("cudnn_convolution_backward", True),
        ("aten.addmm.default", True),
        ("bmm", True),
        ("mm", True),
        ("aten.linear.default", True),
        ("relu", False),
        ("_masked_scale", False),
        ("sum_dim_IntList", False),
        ("native_layer_norm", False),
    ],
)
def test_compute_dense_ops(name: str, dense: bool) -> None:
    assert compute_dense(name) is dense


def test_coop_places_dense_outputs_at_the_high_end() -> None:
    op = Op(0, "mm", (), ())
    assert get("coop").end(op).value == "high"
    assert get("coop-no-opguided").end(op).value == "low"
    assert get("dtr").end(op).value == "low"
    assert get("coop").inplace and not get("coop-no-inplace").inplace and not get("dtr").inplace


def test_coop_window_counts_free_pieces_as_free_and_stops_at_locked_ones() -> None:
    # [A 20 cost 1][free 10][C 30 cost 5][D 20 cost 3][locked 10][E 10 cost 0.1]
    runtime = staged(
        [
            (20, 1.0, "evictable"),
            (10, 0, "free"),
            (30, 5.0, "evictable"),
            (20, 3.0, "evictable"),
            (10, 0, "locked"),
            (10, 0.1, "evictable"),
        ]
    )
    assert get("coop").choose(runtime, 30) == [0]  # A + the hole: 30 bytes for cost 1
    assert get("coop").choose(runtime, 50) == [0, 2]  # A + hole + C (cost 6) beats C + D (cost 8)
    assert get("coop").choose(runtime, 90) == []  # A..D hold 80 bytes, and E is cut off


def test_coop_windows_by_density_total_cost_and_cost_per_byte() -> None:
    # [A 12 cost 1][locked 1][B 40 cost 2][free 8][locked 39]
    runtime = staged(
        [
            (12, 1.0, "evictable"),
            (1, 0, "locked"),
            (40, 2.0, "evictable"),
            (8, 0, "free"),
            (39, 0, "locked"),
        ]
    )
    assert get("coop-total").choose(runtime, 12) == [0]  # least total cost: 1 for 12 bytes
    assert get("coop").choose(runtime, 12) == [2]  # least summed density: 2 / 40 against 1 / 12
    assert get("coop-per-byte").choose(runtime, 12) == [2]  # 2 for 48 bytes (B + the hole) is cheaper
    assert get("coop-per-byte").choose(runtime, 55) == []  # no run holds 55 bytes


def test_summed_density_prefers_one_dear_storage_to_several_cheap_ones() -> None:
    # [A 40 cost 4][locked 1][B 10 cost 0.5][C 10 cost 0.5][D 10 cost 0.5][E 10 cost 0.5]
    # NOTE [window score]: B..E hold A's bytes for half its cost, but their summed h is twice A's.
    pieces = [(40, 4.0, "evictable"), (1, 0.0, "locked")] + [(10, 0.5, "evictable")] * 4
    runtime = staged(pieces, capacity=81)
    assert get("coop").choose(runtime, 40) == [0]  # h: 4 / 40 against 4 * 0.5 / 10
    assert get("coop-per-byte").choose(runtime, 40) == [2, 3, 4, 5]  # 2 for 40 bytes against 4


def test_dte_prefers_the_storage_next_to_free_space() -> None:
    # Two identical candidates; the second borders a 20-byte hole.
    runtime = staged([(20, 1.0, "evictable"), (10, 0, "locked"), (20, 1.0, "evictable"), (20, 0, "free")])
    assert get("dte").choose(runtime, 30) == [2]
    assert get("dtr-eq").choose(runtime, 30) == [0]  # ties go to the lowest id without addresses


def test_greedy_baselines() -> None:
    runtime = staged([(10, 9.0, "evictable"), (30, 9.0, "evictable"), (20, 0.5, "evictable")])
    runtime.last.set(0, 0.5)  # storage 0 was used most recently
    assert get("largest").choose(runtime, 5) == [1]
    assert get("lru").choose(runtime, 5) == [1]
    assert get("dtr-local").choose(runtime, 5) == [2]  # cost / (bytes * staleness) least for 2


@dataclass(frozen=True)
class BruteForceDTR(DTR):
    """h_DTR scoring every candidate with an uncached, unbounded neighbourhood search; checks
    that the cached, pruned search of :class:`DTR` chose a candidate of the least score."""

    name: str = "dtr-brute-force"

    def choose(self, runtime: Any, nbytes: int) -> list[int]:
        chosen = super().choose(runtime, nbytes)
        graph, resident = runtime.graph, runtime.resident

        def score(s: int) -> float:
            seen, total = {s}, graph.cost[s]
            for edges in (graph.parents, graph.children):
                stack = [s]
                while stack:
                    for n in edges[stack.pop()]:
                        if n not in seen and not resident[n]:
                            seen.add(n)
                            total += graph.cost[n]
                            stack.append(n)
            return total / (graph.nbytes[s] * max(runtime.clock - runtime.last.values[s], TICK))

        if chosen:
            best = min(score(int(s)) for s in candidates(runtime))
            assert score(chosen[0]) == pytest.approx(best, rel=1e-9), (score(chosen[0]), best)
        return chosen


def feasible(trace: Trace, fraction: float) -> int:
    """A budget between the worst case (at or above it no run runs out of memory) and the peak."""
    known = facts(trace, inplace=False)
    return known.worst_case + int(fraction * max(known.peak_bytes - known.worst_case, 0))


@settings(max_examples=40, deadline=None)
@given(st.randoms(use_true_random=False), st.floats(0.0, 0.8))
def test_exact_dtr_matches_brute_force_on_random_programs(rng: random.Random, fraction: float) -> None:
    trace = random_program(rng, ops=25)
    result = simulate(trace, feasible(trace, fraction), BruteForceDTR(), thrash_limit=20.0, layout=False)
    assert result.outcome in (Outcome.OK, Outcome.THRASHED)


def test_exact_dtr_matches_brute_force_on_a_long_program() -> None:
    trace = random_program(random.Random(7), ops=400, constants=4)
    known = facts(trace, inplace=False)
    # below the worst case, which is near this program's peak; this budget evicts and finishes
    budget = known.working_set + int(0.3 * (known.peak_bytes - known.working_set))
    result = simulate(trace, budget, BruteForceDTR(), thrash_limit=50.0, layout=False)
    assert result.evictions > 10 and not math.isnan(result.overhead)


# pool layouts: (size, cost, state) per piece
PIECES = st.lists(
    st.tuples(st.integers(1, 20), st.floats(0.0, 5.0), st.sampled_from(["free", "evictable", "locked"])),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(PIECES, st.integers(1, 60), st.sampled_from(["coop", "coop-exact", "coop-total"]))
def test_coop_window_is_the_cheapest_contiguous_run(
    pieces: list[tuple[int, float, str]], nbytes: int, policy: str
) -> None:
    runtime = staged(pieces, capacity=sum(size for size, _, _ in pieces))
    layout = list(runtime.pool.pieces())  # free neighbours have coalesced

    def cost(owner: int) -> float:  # staleness is 1, no neighbours
        if owner == FREE:
            return 0.0
        density = policy != "coop-total"  # h_DTR = c / m summed, or c summed
        return runtime.graph.cost[owner] / (runtime.graph.nbytes[owner] if density else 1)

    best = math.inf
    for left in range(len(layout)):
        held, total = 0, 0.0
        for _, size, owner in layout[left:]:
            if owner != FREE and not runtime.evictable.values[owner]:
                break
            held, total = held + size, total + cost(owner)
            if held >= nbytes:
                best = min(best, total)
                break
    chosen = get(policy).choose(runtime, nbytes)
    if best == math.inf:
        assert chosen == []
        return
    assert sum(cost(owner) for owner in chosen) == pytest.approx(best)
    for owner in chosen:
        runtime.pool.free(owner)
    assert runtime.pool.allocate(-5, nbytes)  # the run made a contiguous block of nbytes


def candidate_runs(runtime: Any, nbytes: int) -> list[tuple[frozenset[int], float, int]]:
    """(storages, cost, bytes) of the shortest run ending at each piece that holds ``nbytes``
    without a locked piece, by brute force over the staged pool (staleness 1, no neighbours)."""
    layout = list(runtime.pool.pieces())
    runs = []
    for right in range(len(layout)):
        held, total, owners = 0, 0.0, set()
        for _, size, owner in reversed(layout[: right + 1]):
            if owner != FREE and not runtime.evictable.values[owner]:
                break
            held += size
            if owner != FREE:
                total += runtime.graph.cost[owner]
                owners.add(owner)
            if held >= nbytes:
                runs.append((frozenset(owners), total, held))
                break
    return runs


@settings(max_examples=150, deadline=None)
@given(PIECES, st.integers(1, 60))
def test_coop_per_byte_window_is_the_cheapest_per_byte_candidate(
    pieces: list[tuple[int, float, str]], nbytes: int
) -> None:
    runtime = staged(pieces, capacity=sum(size for size, _, _ in pieces))
    runs = candidate_runs(runtime, nbytes)
    chosen = get("coop-per-byte").choose(runtime, nbytes)
    if not runs:
        assert chosen == []
        return
    best = min(cost / held for _, cost, held in runs)
    assert any(
        owners == frozenset(chosen) and cost / held == pytest.approx(best) for owners, cost, held in runs
    )
