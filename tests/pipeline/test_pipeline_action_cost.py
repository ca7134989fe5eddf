"""The per-action cost in the pipeline model (NOTE [per-action cost] in remat.pipeline.timeline):
zero changes nothing, a cost per action adds exactly that to each rank's busy time, a message
arrives no sooner than the link lets it, and bad figures are refused. The calibration is checked
in the gloo test's processes (tests/pipeline/test_pipeline_gloo.py) and, marked slow, on processes
of its own."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import remat.pipeline as pp
from remat import RematTypeError, RematValueError
from remat.pipeline import ActionCost, Cost, build, walk
from remat.pipeline.calibrate import _LONG, _MESSAGES, _SHORT, figures
from remat.pipeline.chain import mlp_chain
from remat.pipeline.launch import run_calibrated

# every schedule on 2 and 4 ranks (interleaved and zbv with two stages per rank)
CASES = [
    (name, ranks, m, 2 if name in ("interleaved-1f1b", "zbv") else 1)
    for name in pp.SCHEDULES
    for ranks, m in ((2, 4), (4, 8))
]


def _costs(schedule: pp.Schedule) -> tuple[tuple[Cost, ...], ...]:
    # binary fractions, so that sums of them are exact; stages differ, the output sizes too
    return tuple(
        tuple(
            Cost(1.0 + 0.25 * s, 2.0 + 0.5 * s, 0.0, 64, 128, 1024 * (s + 1), 32, 16)
            for _ in range(schedule.n_microbatches)
        )
        for s in range(schedule.n_stages)
    )


@pytest.mark.parametrize(("name", "ranks", "m", "per_rank"), CASES)
def test_no_cost_per_action_is_the_op_times_model(name: str, ranks: int, m: int, per_rank: int) -> None:
    schedule = build(name, ranks, m, per_rank)
    costs = _costs(schedule)
    assert walk(schedule, costs, ActionCost()) == walk(schedule, costs)


@pytest.mark.parametrize(("name", "ranks", "m", "per_rank"), CASES)
def test_a_cost_per_action_adds_exactly_that_to_each_ranks_busy_time(
    name: str, ranks: int, m: int, per_rank: int
) -> None:
    schedule = build(name, ranks, m, per_rank)
    costs = _costs(schedule)
    bare = walk(schedule, costs)
    c, step = 0.125, 0.5
    line = walk(schedule, costs, ActionCost(forward_s=c, backward_s=c, step_s=step))
    for rank, actions in enumerate(schedule.actions):
        # a W runs nothing: its backward ran at I
        counted = sum(a.kind != "W" for a in actions)
        assert line.busy(rank) == bare.busy(rank) + c * counted + step
        assert line.makespan >= line.busy(rank)
    # every action ends at least the step's cost and one action's cost later (the walk is monotone)
    assert line.makespan >= bare.makespan + step + c
    assert line.peak_bytes == bare.peak_bytes


@pytest.mark.parametrize(("ranks", "m"), [(2, 4), (3, 5), (4, 8)])
def test_gpipe_of_equal_stages_takes_m_plus_p_minus_1_slots_and_a_link_each_way(ranks: int, m: int) -> None:
    schedule = build("gpipe", ranks, m)
    costs = tuple(tuple(Cost(1.0, 2.0, 0.0, 0, 0, 0, 0, 0) for _ in range(m)) for _ in range(ranks))
    per = ActionCost(forward_s=0.25, backward_s=0.5, latency_s=0.0625, step_s=0.125)
    line = walk(schedule, costs, per)
    assert line.makespan == 0.125 + (m + ranks - 1) * (1.25 + 2.5) + 2 * (ranks - 1) * 0.0625


@pytest.mark.parametrize(("name", "ranks", "m", "per_rank"), CASES)
def test_a_message_arrives_no_sooner_than_the_link_carries_it(
    name: str, ranks: int, m: int, per_rank: int
) -> None:
    schedule = build(name, ranks, m, per_rank)
    costs = _costs(schedule)
    per = ActionCost(0.125, 0.25, 0.0625, 0.03125, latency_s=0.5, byte_s=1e-4)
    line = walk(schedule, costs, per)
    end = {(s.action.stage, s.action.kind, s.action.microbatch): s.end for s in line.spans}
    crossed = 0
    for span in line.spans:
        a = span.action
        if a.kind == "F" and a.stage > 0:
            source, sent = (a.stage - 1, "F", a.microbatch), costs[a.stage - 1][a.microbatch].output_bytes
        elif a.kind in ("B", "I") and a.stage < schedule.n_stages - 1:
            source, sent = (a.stage + 1, a.kind, a.microbatch), costs[a.stage][a.microbatch].output_bytes
        else:
            continue
        if schedule.rank_of(source[0]) != span.rank:
            crossed += 1
            assert span.start >= end[source] + 0.5 + sent * 1e-4
        else:
            assert span.start >= end[source]
    assert crossed > 0


# every schedule on 2, 3 and 4 ranks; interleaved and zbv with two stages per rank (zbv's V hands
# over between stages P-1 and P on its last rank, and its stages 0 and 2P-1 share rank 0)
EXACT = [
    (name, ranks, m, 2 if name in ("interleaved-1f1b", "zbv") else 1)
    for name in pp.SCHEDULES
    for ranks, m in ((2, 4), (3, 6), (4, 8))
]


@pytest.mark.parametrize(("name", "ranks", "m", "per_rank"), EXACT)
def test_every_span_starts_and_lasts_as_its_sends_and_receives_say(
    name: str, ranks: int, m: int, per_rank: int
) -> None:
    schedule = build(name, ranks, m, per_rank)
    last = schedule.n_stages - 1
    # distinct powers of two for every term, so that sums are exact and no term stands in for another
    per = ActionCost(2.0**-1, 2.0**-2, 2.0**-5, 2.0**-7, 2.0**-9, 2.0**-20, 3.0)
    costs = tuple(
        tuple(Cost(1.0 + s / 4, 2.0 + s / 8, 0.0, 0, 0, 1024 * (s + 1) + 64 * i, 0, 0) for i in range(m))
        for s in range(schedule.n_stages)
    )
    line = walk(schedule, costs, per)
    span = {x.action: x for x in line.spans}
    end = {(a.stage, a.kind, a.microbatch): x.end for a, x in span.items()}
    sent_count = received_count = 0
    for rank, actions in enumerate(schedule.actions):
        free = per.step_s
        for a in actions:
            x, c = span[a], costs[a.stage][a.microbatch]
            if a.kind == "F":  # in: the previous stage's output; out: to the next stage
                source = (a.stage - 1, "F", a.microbatch) if a.stage > 0 else None
                came_from, goes_to = a.stage - 1, a.stage + 1 if a.stage < last else None
                sent, compute = costs[a.stage - 1][a.microbatch].output_bytes, c.forward_s + per.forward_s
            elif a.kind == "W":  # after its I, on the same stage; runs nothing
                source, came_from, goes_to, sent, compute = (a.stage, "I", a.microbatch), None, None, 0, 0.0
            else:  # in: the gradient of this stage's output; out: the gradient of its input
                at_end = a.stage == last
                source = (a.stage, "F", a.microbatch) if at_end else (a.stage + 1, a.kind, a.microbatch)
                came_from, goes_to = None if at_end else a.stage + 1, a.stage - 1 if a.stage > 0 else None
                sent, compute = c.output_bytes, c.backward_s + per.backward_s
            received = came_from is not None and came_from >= 0 and schedule.rank_of(came_from) != rank
            sends = goes_to is not None and goes_to >= 0 and schedule.rank_of(goes_to) != rank
            ready = 0.0 if source is None else end[source] + received * (per.latency_s + sent * per.byte_s)
            assert x.rank == rank
            assert x.start == max(free, ready), a
            assert x.end - x.start == compute + received * per.receive_s + sends * per.send_s, a
            sent_count += sends
            received_count += received
            free = x.end
    # every message crossing ranks is sent once and received once, and nothing else is
    crossing = sum(
        schedule.rank_of(a.stage) != schedule.rank_of(a.stage + (1 if a.kind == "F" else -1))
        for row in schedule.actions
        for a in row
        if (a.kind == "F" and a.stage < last) or (a.kind in ("B", "I") and a.stage > 0)
    )
    assert sent_count == received_count == crossing > 0


def _plan(**options: object) -> pp.PipelinePlan:
    torch.manual_seed(0)
    model = mlp_chain(4, 16, 32)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    return pp.plan(
        model,
        x,
        n_stages=2,
        n_microbatches=4,
        budget_per_rank="1GB",
        loss_fn=nn.functional.mse_loss,
        target=y,
        op_costs="model",
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("forward_s", -1e-3), ("latency_s", math.nan), ("byte_s", math.inf), ("send_s", True), ("step_s", "1")],
)
def test_the_plan_refuses_negative_non_finite_or_non_number_figures(field: str, value: object) -> None:
    with pytest.raises(
        RematValueError,
        match=rf"remat\.pipeline\.plan: action_cost's figures are seconds .*finite and not negative "
        rf"\({field}={value!r}\); pass remat\.pipeline\.calibrate\(\)'s figures",
    ):
        _plan(action_cost=dataclasses.replace(ActionCost(), **{field: value}))
    with pytest.raises(
        RematTypeError, match=r"remat\.pipeline\.plan: action_cost must be an ActionCost \(dict\)"
    ):
        _plan(action_cost={"forward_s": 1e-3})


def test_the_plan_keeps_its_action_cost_and_its_choices() -> None:
    per = ActionCost(1e-3, 2e-3, 1e-4, 1e-4, 5e-5, 1e-9, 3e-3)
    bare, costed = _plan(), _plan(action_cost=per)
    assert costed.stage_plans == bare.stage_plans and costed.action_cost == per
    assert costed.timeline() == walk(
        costed.order, tuple(tuple(sp.cost(i, 4) for i in range(4)) for sp in costed.stage_plans), per
    )
    assert costed.timeline().makespan > bare.timeline().makespan
    assert f"ms with {per}; rank 0" in str(costed) and "ActionCost" not in str(bare)
    assert str(per).startswith("ActionCost(forward 1.000 ms, backward 2.000 ms, send 0.100 ms")
    again = pp.PipelinePlan.from_json(costed.to_json())
    assert again.action_cost == per
    assert costed.to_json()["format"] == "remat.pipeline/4"
    older = {k: v for k, v in bare.to_json().items() if k != "action_cost"} | {"format": "remat.pipeline/2"}
    assert pp.PipelinePlan.from_json(older).action_cost == ActionCost()


@pytest.mark.parametrize(
    "figures",
    [{"forward_s": -1.0}, {"forward_s": math.nan}, {"forward_s": "0.001"}, {"step_s": True}],
    ids=["negative", "nan", "text", "bool"],
)
def test_loading_refuses_a_damaged_action_cost(figures: dict[str, object]) -> None:
    body = _plan().to_json()
    body["action_cost"] = figures
    ((field, value),) = figures.items()
    with pytest.raises(
        RematValueError,
        match=rf"remat\.pipeline\.load: action_cost's figures are seconds .*finite and not negative "
        rf"\({field}={value!r}\); save the plan again",
    ):
        pp.PipelinePlan.from_json(body)


def test_calibrate_refuses_a_shape_without_sizes() -> None:
    with pytest.raises(
        RematValueError, match=r"remat\.pipeline\.calibrate: activation is a shape .*\(\(0, 4\)\)"
    ):
        pp.calibrate((0, 4))
    for rounds in (1, 3.5, True):
        with pytest.raises(
            RematValueError,
            match=rf"remat\.pipeline\.calibrate: rounds must be a whole number, at least 3 \({rounds!r}\)",
        ):
            pp.calibrate((4, 4), rounds=rounds)  # type: ignore[arg-type]
    with pytest.raises(
        RematValueError, match=r"remat\.pipeline\.calibrate: dtype is a floating dtype .*torch\.int64"
    ):
        pp.calibrate((4, 4), torch.int64)
    with pytest.raises(
        RematTypeError, match=r"remat\.pipeline\.calibrate: workdir is a folder's path or None \(got int\)"
    ):
        pp.calibrate((4, 4), workdir=5)  # type: ignore[arg-type]
    with pytest.raises(
        RematValueError, match=r"remat\.pipeline\.launch\.run_calibrated: the calibration sends"
    ):
        run_calibrated([], 1, ".", (4, 4))


TRUTH = ActionCost(4e-4, 9e-4, 1e-4, 1.2e-4, 5e-5, 1e-9, 2e-3)
SHAPE = (128, 64)  # 32768 bytes of float32


def _samples(rank: int, per: ActionCost, trip: list[float] | None = None) -> dict[str, list[float]]:
    """What ranks 0 and 1 would measure if ``per`` were the truth (calibrate's module doc), or with
    ``trip``, one-way times of its messages measured instead."""
    numel = math.prod(SHAPE)
    out = {"send": [per.send_s] * 3, "receive": [per.receive_s] * 3}
    for k, n in enumerate(_MESSAGES):
        size = max(1, n * numel) * 4
        one_way = per.send_s + per.latency_s + per.receive_s + size * per.byte_s if trip is None else trip[k]
        out[f"trip{k}"] = [2 * one_way] * 3
    first, second = (per.send_s, per.receive_s) if rank == 0 else (per.receive_s, per.send_s)
    for m in (_SHORT, _LONG):
        out[f"forward{m}"] = [per.step_s + m * (per.forward_s + first)] * 3
        out[f"full{m}"] = [per.step_s + m * (per.forward_s + first + per.backward_s + second)] * 3
    return out


def test_figures_give_back_the_cost_the_samples_were_made_of() -> None:
    got = figures([_samples(0, TRUTH), _samples(1, TRUTH)], SHAPE, torch.float32)
    for f in dataclasses.fields(ActionCost):
        assert getattr(got, f.name) == pytest.approx(getattr(TRUTH, f.name), rel=1e-9), f.name


def test_a_link_faster_than_its_send_and_receive_keeps_the_one_way_time_near_the_measured() -> None:
    # the zero-byte intercept 1.5e-4 s below the send and the receive: the latency goes to zero and
    # the per-byte figure is fitted again, so the model's one-way time is not the clamp's too long
    on_ranks, sizes = TRUTH.send_s + TRUTH.receive_s, [4.0, 4.0 * 8192, 16 * 4.0 * 8192]
    measured = [on_ranks - 1.5e-4 + size * TRUTH.byte_s for size in sizes]
    got = figures([_samples(r, TRUTH, measured) for r in (0, 1)], SHAPE, torch.float32)
    assert got.latency_s == 0.0 and 0 < got.byte_s < TRUTH.byte_s
    model = [got.send_s + got.latency_s + got.receive_s + size * got.byte_s for size in sizes]
    assert abs(model[-1] - measured[-1]) < 0.05 * measured[-1]
    # a message that takes no longer for being larger: no negative per-byte figure, the mean instead
    flat = figures([_samples(r, TRUTH, [7e-4, 6e-4, 5e-4]) for r in (0, 1)], SHAPE, torch.float32)
    assert flat.byte_s == 0.0 and flat.latency_s == pytest.approx(6e-4 - on_ranks, rel=1e-9)


@pytest.mark.slow  # two processes of its own, importing torch
def test_calibrate_on_its_own_processes_gives_the_figures_and_removes_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its temporary folder goes
    per = pp.calibrate((16, 8), rounds=3)
    # the per-action figures beyond a send and a receive are differences of timings, floored at
    # zero: on a loaded machine all of them may be (not asserted, which would depend on the load)
    assert per.bad() is None and per.send_s > 0 and per.receive_s > 0
    assert list(tmp_path.iterdir()) == []
