"""The schedule model and the pipeline model, without processes: actions as strings, the
micro-batches each rank holds, the makespan and memory of a walk, deadlocks found before running."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

import remat.pipeline as pp
from remat import RematTypeError, RematValueError
from remat.pipeline import Action, Cost, Schedule, build, walk


def test_actions_read_and_write_as_torch_writes_them() -> None:
    assert str(Action(1, "F", 0)) == "1F0"
    assert Action.parse("12B3") == Action(12, "B", 3)
    assert Action.parse("0I2") == Action(0, "I", 2) and str(Action(3, "W", 1)) == "3W1"
    with pytest.raises(RematValueError, match=r"remat\.pipeline\.Action\.parse: an action is .*'1X0'"):
        Action.parse("1X0")


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_1f1b_rank_i_holds_p_minus_i_and_gpipe_holds_all(ranks: int, microbatches: int) -> None:
    one = build("1f1b", ranks, microbatches)
    gpipe = build("gpipe", ranks, microbatches)
    for rank in range(ranks):
        assert one.in_flight(rank) == min(microbatches, ranks - rank)
        assert gpipe.in_flight(rank) == microbatches
        for schedule in (one, gpipe):
            actions = schedule.actions[rank]
            assert sorted(str(a) for a in actions) == sorted(
                f"{rank}{k}{m}" for k in "FB" for m in range(microbatches)
            )


def test_the_last_rank_of_1f1b_alternates_from_the_first_microbatch() -> None:
    # torch 2.13's Schedule1F1B._get_pipeline_order lists 3F1 ... 3F8 here; what runs is 3F0 3B0 ...
    assert [str(a) for a in build("1f1b", 4, 8).actions[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]


def test_a_schedule_refuses_what_torch_refuses() -> None:
    with pytest.raises(
        RematValueError, match=r"1f1b needs at least as many micro-batches as stages \(2 < 4\)"
    ):
        build("1f1b", 4, 2)
    with pytest.raises(RematValueError, match=r"unknown schedule \('zb-h1'\); use one of gpipe, 1f1b"):
        build("zb-h1", 2, 2)
    with pytest.raises(RematValueError, match=r"zbv runs exactly two stages per rank.*stages_per_rank=3"):
        build("zbv", 2, 4, 3)


def test_interleaved_runs_each_ranks_stages_in_a_loop_as_torch_lists_them() -> None:
    # ScheduleInterleaved1F1B's list for P=2, V=2, M=4 (idle slots left out); the gloo test checks
    # the same against what runs
    schedule = build("interleaved-1f1b", 2, 4, 2)
    assert schedule.n_stages == 4 and schedule.stages_of(0) == (0, 2)
    assert " ".join(map(str, schedule.actions[0])) == (
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    )
    assert [schedule.in_flight(s) for s in range(4)] == [4, 3, 2, 1]


@pytest.mark.parametrize(
    ("ranks", "per_rank", "microbatches"), [(2, 2, 4), (2, 3, 6), (4, 2, 8), (3, 2, 3), (4, 2, 10)]
)
def test_interleaved_runs_every_forward_and_backward_once_without_deadlock(
    ranks: int, per_rank: int, microbatches: int
) -> None:
    schedule = build("interleaved-1f1b", ranks, microbatches, per_rank)
    for rank in range(ranks):
        assert sorted(str(a) for a in schedule.actions[rank]) == sorted(
            f"{s}{k}{m}" for s in schedule.stages_of(rank) for k in "FB" for m in range(microbatches)
        )
    n = ranks * per_rank
    line = walk(schedule, _costs(n, microbatches, 1.0, 2.0))
    assert line.makespan >= microbatches * per_rank * 3.0


def _costs(ranks: int, m: int, f: float, b: float, saved: int = 10, peak: int = 15) -> tuple:
    return tuple(tuple(Cost(f, b, 0.0, saved, peak, 0, 0, 0) for _ in range(m)) for _ in range(ranks))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_makespan_of_equal_stages_is_m_plus_p_minus_1_rounds(name: str) -> None:
    ranks, m = 3, 6
    line = walk(build(name, ranks, m), _costs(ranks, m, 1.0, 2.0))
    assert line.makespan == pytest.approx((m + ranks - 1) * (1.0 + 2.0))
    assert line.busy(0) == pytest.approx(m * 3.0)


def test_memory_of_a_rank_is_what_it_holds_plus_one_step_peak() -> None:
    ranks, m = 2, 4
    for name in ("gpipe", "1f1b"):
        schedule = build(name, ranks, m)
        line = walk(schedule, _costs(ranks, m, 1.0, 1.0, saved=10, peak=15))
        assert line.peak_bytes == tuple((schedule.in_flight(r) - 1) * 10 + 15 for r in range(ranks))


def test_a_deadlock_is_found_before_anything_runs() -> None:
    # rank 1 waits for a backward of micro-batch 1 that rank 0 only runs after it
    stuck = Schedule(
        "custom",
        2,
        2,
        2,
        (
            (Action(0, "F", 0), Action(0, "B", 1), Action(0, "F", 1), Action(0, "B", 0)),
            (Action(1, "F", 0), Action(1, "B", 0), Action(1, "F", 1), Action(1, "B", 1)),
        ),
    )
    with pytest.raises(RematValueError, match=r"the schedule deadlocks.*rank 0: 0B1"):
        walk(stuck, _costs(2, 2, 1.0, 1.0))


@pytest.mark.parametrize(("ranks", "microbatches"), [(1, 3), (2, 1), (2, 4), (3, 2), (3, 7), (4, 8), (4, 12)])
def test_zbv_is_the_order_torch_lists(ranks: int, microbatches: int) -> None:
    # ScheduleZBVZeroBubble's per-rank list, idle slots dropped (it reads only these attributes);
    # the gloo test checks the same against what runs
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    torch_side = SimpleNamespace(pp_group_size=ranks, _n_microbatches=microbatches, num_stages=2 * ranks)
    schedule = build("zbv", ranks, microbatches, 2)
    for rank in range(ranks):
        listed = ScheduleZBVZeroBubble._calculate_single_rank_operations(torch_side, rank)  # type: ignore[arg-type]
        assert [str(a) for a in schedule.actions[rank]] == [str(a) for a in listed if a is not None]


def test_zbv_places_two_stages_per_rank_in_a_v_and_splits_the_backward() -> None:
    schedule = build("zbv", 4, 8, 2)
    assert [schedule.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert schedule.stages_of(1) == (1, 6) and schedule.split_backward
    assert not build("1f1b", 4, 8).split_backward
    for m in (4, 8, 12):
        # a micro-batch is held from its forward to its I (the whole backward runs there)
        assert [build("zbv", 4, m, 2).in_flight(s) for s in range(8)] == [min(m, 8 - s) for s in range(8)]
    for rank in range(4):
        assert sorted(str(a) for a in schedule.actions[rank]) == sorted(
            f"{s}{k}{m}" for s in schedule.stages_of(rank) for k in "FIW" for m in range(8)
        )


@pytest.mark.parametrize(("ranks", "microbatches"), [(2, 4), (4, 8), (3, 2)])
def test_zbv_walks_without_deadlock_holding_each_microbatch_from_f_to_i(
    ranks: int, microbatches: int
) -> None:
    schedule = build("zbv", ranks, microbatches, 2)
    line = walk(schedule, _costs(2 * ranks, microbatches, 1.0, 2.0, saved=10, peak=15))
    assert all(s.end == s.start for s in line.spans if s.action.kind == "W")
    assert line.busy(0) == pytest.approx(2 * microbatches * 3.0)
    for rank, actions in enumerate(schedule.actions):
        held = most = 0
        for action in actions:
            held += {"F": 1, "I": -1, "W": 0}[action.kind]
            most = max(most, held)
        assert line.peak_bytes[rank] == (most - 1) * 10 + 15


def test_a_schedule_that_keeps_its_sends_holds_them_to_the_steps_end() -> None:
    # NOTE [sends kept to the end]: interleaved 1F1B and ZBV keep every stage's output (sent
    # forward) and input gradient (sent backward) once the micro-batch's backward ran; 1F1B only
    # its last transfers (transfer_bytes, from the start)
    def costs(stages: int) -> tuple:
        return tuple(tuple(Cost(1.0, 1.0, 0.0, 0, 0, 8, 0, 100) for _ in range(4)) for _ in range(stages))

    looped = build("interleaved-1f1b", 2, 4, 2)
    assert looped.keeps_sends and build("zbv", 2, 4, 2).keeps_sends and not build("1f1b", 2, 4).keeps_sends
    line = walk(looped, costs(4))
    # the first step's receive buffers (NOTE [receive buffers]): rank 0 the output gradients of
    # stages 0 and 2 and the inputs of stage 2, rank 1 the same of stages 1 and 3, less stage 3's
    # output gradients (the last stage's gradient is the loss's)
    buffers = (3 * 4 * 8, 3 * 4 * 8)
    # rank 0 (stages 0, 2): 4 outputs of stage 0, 4 outputs and input gradients of stage 2
    assert line.memory[0][-1][1] == 4 * 8 + 4 * 16 + buffers[0]
    # rank 1 (stages 1, 3): stage 1 as stage 2, stage 3 its input gradients and its outputs (kept
    # for the end), and at the end its outputs concatenated, the sends gone
    assert line.steady_peak_bytes[1] == 4 * 16 + 4 * 8 + 4 * 8
    assert max(b for _, b in line.memory[1]) == line.peak_bytes[1] == 4 * 16 + 4 * 8 + 4 * 8 + buffers[1]
    assert line.memory[1][-1][1] == 4 * 8 + 4 * 8 + buffers[1]
    one = walk(build("1f1b", 2, 4), costs(2))
    # 1F1B on 2 ranks: rank 0 receives its output's gradients, rank 1 its inputs, 4 of each
    assert one.memory[0][-1][1] == 100 + 4 * 8 and one.memory[1][-1][1] == 100 + 4 * 8 + 4 * 8 + 4 * 8
    assert [a - b for a, b in zip(one.peak_bytes, one.steady_peak_bytes, strict=True)] == [4 * 8, 4 * 8]


def test_a_hand_over_on_one_rank_replaces_its_first_step_buffer() -> None:
    """NOTE [receive buffers]: under ZBV rank 1 runs stages 1 and 2, and hands stage 1's outputs
    to stage 2 and stage 2's input gradients to stage 1 itself: each such buffer goes when its
    micro-batch is handed over, so by the step's end only the buffers filled from rank 0 stay."""
    costs = tuple(tuple(Cost(1.0, 1.0, 0.0, 0, 0, 8, 0, 0) for _ in range(4)) for _ in range(4))
    line = walk(build("zbv", 2, 4, 2), costs)
    # at the start: stages 1 and 2, their inputs and output gradients, 4 micro-batches of 8 bytes
    assert line.memory[1][0][1] == 2 * 2 * 4 * 8
    # at the end: the sends kept (each middle stage's output and input gradient, NOTE [sends kept
    # to the end]) and the 8 buffers rank 0 fills (stage 1's inputs, stage 2's output gradients)
    assert line.memory[1][-1][1] == 2 * 4 * (8 + 8) + 8 * 8
    assert line.steady_peak_bytes[1] < line.peak_bytes[1] < line.steady_peak_bytes[1] + 2 * 2 * 4 * 8


def test_walk_refuses_what_it_cannot_walk() -> None:
    """A schedule that is none, costs of another shape, a figure negative or not finite (a negative
    forward made a shorter step, a NaN one a NaN step), a per-action cost that is none: clear errors."""
    order = pp.build("gpipe", 2, 2)
    cost = pp.Cost(1.0, 1.0, 0.0, 10, 10, 10, 10, 10)
    fine = ((cost, cost), (cost, cost))
    assert pp.walk(order, fine).makespan == 6.0
    with pytest.raises(RematTypeError, match=r"remat\.pipeline\.walk: schedule must be a Schedule \(str\)"):
        pp.walk("gpipe", fine)  # type: ignore[arg-type]
    with pytest.raises(
        RematValueError, match=r"one Cost per stage and micro-batch \(2 stages x 2 micro-batches\)"
    ):
        pp.walk(order, ((cost, cost),))
    with pytest.raises(RematValueError, match=r"\(NoneType\); pass costs\[stage\]\[microbatch\]"):
        pp.walk(order, None)  # type: ignore[arg-type]
    with pytest.raises(RematTypeError, match=r"each cost is a Cost \(costs\[1\]\[0\] is int\)"):
        pp.walk(order, ((cost, cost), (3, cost)))  # type: ignore[arg-type]
    for bad, shown in ((-5.0, "forward_s=-5.0"), (float("nan"), "forward_s=nan")):
        with pytest.raises(RematValueError, match=rf"finite and not negative \(costs\[0\]\[1\]: {shown}\)"):
            pp.walk(order, ((cost, dataclasses.replace(cost, forward_s=bad)), (cost, cost)))
    with pytest.raises(RematValueError, match=r"\(costs\[0\]\[0\]: saved_bytes=1.5\)"):
        pp.walk(order, ((dataclasses.replace(cost, saved_bytes=1.5), cost), (cost, cost)))  # type: ignore[arg-type]
    with pytest.raises(RematTypeError, match=r"per_action must be an ActionCost or None \(str\)"):
        pp.walk(order, fine, "x")  # type: ignore[arg-type]
    with pytest.raises(
        RematValueError, match=r"per_action's figures are finite and not negative \(step_s=-1\)"
    ):
        pp.walk(order, fine, pp.ActionCost(step_s=-1))
