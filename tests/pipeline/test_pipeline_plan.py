"""``remat.pipeline.plan`` without processes: the cut, the per-stage plans within a rank budget,
the error for a budget no rank meets, the JSON form and the per-rank table."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from models import chain_example
from torch import nn

import remat.pipeline as pp
from remat import RematTypeError, RematValueError
from remat.pipeline.chain import mlp_chain
from remat.pipeline.split import balance, trainable_from

ROWS, M = 256, 4


@pytest.fixture(scope="module")
def example() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return chain_example(ROWS)


def _plan(example, budget, **options) -> pp.PipelinePlan:
    model, x, y = example
    options = {
        "schedule": "1f1b",
        "boundaries": [2],
        "n_microbatches": M,
        "loss_fn": nn.functional.mse_loss,
        "target": y,
        **options,
    }
    return pp.plan(model, x, n_stages=2, budget_per_rank=budget, **options)


@pytest.fixture(scope="module")
def plain(example) -> pp.PipelinePlan:
    return _plan(example, "1GB")


def test_balance_is_the_minimax_contiguous_cut() -> None:
    assert balance([1, 1, 1, 1], [1, 1]) == (0, 2, 4)
    assert balance([4, 1, 1, 1, 1], [1, 1]) == (0, 1, 5)
    # the first stage holds twice the micro-batches: it gets less to keep
    assert balance([1, 1, 1, 1, 1, 1], [2, 1]) == (0, 2, 6)
    with pytest.raises(RematValueError, match=r"more stages than children to cut \(3 stages, 2 children\)"):
        balance([1, 1], [1, 1, 1])


def test_a_balanced_first_stage_holds_something_to_differentiate() -> None:
    """A cut balanced by time put an in-place ReLU (no parameter, its input the example) alone in
    the first stage whenever it measured as long as the rest, and the plan was refused: the first
    stage now reaches the first child with a trainable parameter."""
    chain = [nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)]
    assert trainable_from(chain, torch.randn(4, 8)) == 2
    assert trainable_from(chain, torch.randn(4, 8, requires_grad=True)) == 1
    assert balance([10, 1, 1, 1], [1, 1]) == (0, 1, 4)
    assert balance([10, 1, 1, 1], [1, 1], first=2) == (0, 2, 4)
    assert balance([10, 1, 1, 1], [1, 1, 1], first=4) == (0, 1, 2, 4)  # no cut can: the refusal says why


def test_a_large_budget_recomputes_nothing_and_leaves_the_model_as_it_was(example, plain) -> None:
    model, _, _ = example
    assert all(sp.plan is None for sp in plain.stage_plans)
    assert [sp.in_flight for sp in plain.stage_plans] == [2, 1]
    assert plain.boundaries == (0, 2, 4)
    assert all(p.grad is None for p in model.parameters())
    assert all(m.running_mean.eq(0).all() for m in model.modules() if isinstance(m, nn.BatchNorm1d))


def test_a_tighter_budget_plans_only_the_rank_that_needs_it(example, plain) -> None:
    need = plain.timeline().peak_bytes
    tight = _plan(example, int(0.85 * max(need)))
    assert tight.stage_plans[0].plan is not None
    assert tight.stage_plans[1].plan is None  # rank 1 holds one micro-batch: it fits as it is
    assert max(tight.timeline().peak_bytes) <= tight.budget_bytes
    assert tight.stage_plans[0].recompute_s > 0.0


def test_the_last_microbatch_runs_plain_where_the_budget_allows(example, plain) -> None:
    need = plain.timeline().peak_bytes[0]
    sp = _plan(example, int(0.95 * need)).stage_plans[0]
    assert sp.plan is not None and sp.except_last
    assert [sp.recomputes(i, M) for i in range(M)] == [True, True, True, False]


def test_a_budget_no_split_meets_names_what_each_rank_needs(example) -> None:
    with pytest.raises(
        RematValueError,
        match=r"pipeline\.plan: budget_per_rank below .*rank 0 needs \d+ bytes.*rank 1 needs \d+ bytes.*"
        r"the cut before children \[2\] \(given\)\); raise budget_per_rank, cut elsewhere",
    ):
        _plan(example, 1000)


def test_bad_arguments_fail_before_any_work(example) -> None:
    model, x, y = example
    with pytest.raises(RematTypeError, match=r"remat\.pipeline\.plan: a byte count is required"):
        _plan(example, 0.5)
    with pytest.raises(RematValueError, match=r"boundaries are the first child of each stage"):
        _plan(example, "1GB", boundaries=[5])
    with pytest.raises(RematValueError, match=r"stages must be n_stages modules \(1 for 2 stages\)"):
        pp.plan(
            [model],
            x,
            n_stages=2,
            n_microbatches=M,
            budget_per_rank="1GB",
            loss_fn=nn.functional.mse_loss,
            target=y,
        )


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"n_stages": 2.0}, r"n_stages is a whole number \(n_stages=2\.0\)"),
        ({"n_stages": True}, r"n_stages is a whole number \(n_stages=True\)"),
        ({"n_microbatches": "4"}, r"n_microbatches is a whole number \(n_microbatches='4'\)"),
        ({"boundaries": [1.5]}, r"boundaries are whole numbers: .* \(boundaries=\[1\.5\]\)"),
        ({"boundaries": 2}, r"boundaries are whole numbers: .* \(boundaries=2\)"),
        (
            {"rerun_modules": "yes"},
            r"rerun_modules must be True or False \(got 'yes'\); pass rerun_modules=True",
        ),
    ],
)
def test_arguments_of_the_wrong_type_are_clear_errors(example, given: dict[str, Any], match: str) -> None:
    model, x, y = example
    options: dict[str, Any] = {"n_stages": 2, "n_microbatches": M, "boundaries": [2], **given}
    with pytest.raises(RematTypeError, match=r"remat\.pipeline\.plan: " + match):
        pp.plan(model, x, budget_per_rank="1GB", loss_fn=nn.functional.mse_loss, target=y, **options)


def test_boundaries_take_any_sequence_of_integers(example) -> None:
    import numpy as np

    assert _plan(example, "1GB", boundaries=range(2, 3)).boundaries == (0, 2, 4)
    assert _plan(example, "1GB", boundaries=[np.int64(2)]).boundaries == (0, 2, 4)


def test_a_container_without_a_forward_is_refused_clearly(example) -> None:
    model, x, y = example
    with pytest.raises(RematTypeError, match=r"ModuleList failed on the example: NotImplementedError"):
        pp.plan(
            nn.ModuleList(list(model)),
            x,
            n_stages=2,
            n_microbatches=M,
            budget_per_rank="1GB",
            loss_fn=nn.functional.mse_loss,
            target=y,
        )


def test_a_schedule_given_another_count_of_stages_is_refused(plain) -> None:
    with pytest.raises(RematValueError, match=r"'1f1b' takes this rank's 1 stage\(s\) \(0 stages\)"):
        plain.schedule([], nn.functional.mse_loss)


def test_a_schedule_given_a_loss_function_that_is_no_function_is_refused(plain) -> None:
    """It failed inside torch's schedule at its first step, on the last rank only (the other ranks
    then lost their connection)."""
    for given in (3, "mse"):
        with pytest.raises(RematTypeError, match=r"PipelinePlan\.schedule: loss_fn must be callable"):
            plain.schedule([object()], given)


def test_save_load_round_trip_and_stages_need_the_model(plain, example, tmp_path: Path) -> None:
    model, _, _ = example
    plain.save(tmp_path / "p.json")
    loaded = pp.PipelinePlan.load(tmp_path / "p.json")
    assert loaded == plain
    with pytest.raises(
        RematValueError, match=r"the plan holds no model to cut.*PipelinePlan.load\(path, model\)"
    ):
        loaded.stage_modules()
    assert [len(m) for m in pp.PipelinePlan.load(tmp_path / "p.json", model).stage_modules()] == [2, 2]
    with pytest.raises(RematValueError, match=r"remat\.pipeline\.load: no such file"):
        pp.PipelinePlan.load(tmp_path / "missing.json")
    body = plain.to_json()
    for key, value in (("budget_bytes", -3), ("boundaries", [4, 2, 0])):  # both loaded before
        (tmp_path / "edited.json").write_text(json.dumps({**body, key: value}))
        with pytest.raises(RematValueError, match=rf"load: the plan file is incomplete or damaged .*{key}"):
            pp.PipelinePlan.load(tmp_path / "edited.json")


def test_str_and_explain_show_each_rank(example, plain) -> None:
    tight = _plan(example, int(0.85 * max(plain.timeline().peak_bytes)))
    assert str(tight).startswith("PipelinePlan(1f1b, 2 stages x 4 micro-batches")
    out = io.StringIO()
    assert tight.explain(file=out) is None
    text = out.getvalue()
    assert "held" in text and "predicted step" in text
    assert "regions" in text and "nothing" in text


def test_balanced_by_time_or_memory_cuts_every_child_once(example) -> None:
    for by in ("time", "memory"):
        p = _plan(example, "1GB", boundaries=None, balance_by=by)
        assert p.boundaries[0] == 0 and p.boundaries[-1] == 4 and len(p.boundaries) == 3
        assert p.balance == by


def test_balancing_leaves_the_gradients_the_model_holds_as_they_were(example) -> None:
    """Profiling the children ran their backward three times, adding into the ``.grad`` the model
    held (in the middle of accumulation): the same tensors came back, summed into."""
    model, x, y = example
    nn.functional.mse_loss(model(x), y).backward()
    before = [(p.grad, p.grad.clone()) for p in model.parameters() if p.grad is not None]
    assert len(before) == len(list(model.parameters()))
    try:
        for by in ("time", "memory"):
            _plan(example, "1GB", boundaries=None, balance_by=by)
        for p, (grad, value) in zip(model.parameters(), before, strict=True):
            assert p.grad is grad and torch.equal(grad, value)
    finally:
        model.zero_grad(set_to_none=True)


def test_more_refusals_say_what_to_do(example, plain, tmp_path: Path) -> None:
    model, x, y = example
    with pytest.raises(RematTypeError, match=r"and target must be tensors \(got Tensor, list\)"):
        _plan(example, "1GB", target=[1])
    with pytest.raises(RematTypeError, match=r"loss_fn must be callable"):
        _plan(example, "1GB", loss_fn=3)
    with pytest.raises(
        RematValueError, match=r"unknown balance \('size'\); use one of auto, step, time, memory"
    ):
        _plan(example, "1GB", boundaries=None, balance_by="size")
    with pytest.raises(RematValueError, match=r"stages, micro-batches and stages per rank must be positive"):
        _plan(example, "1GB", schedule="gpipe", n_microbatches=0)
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(
        RematValueError,
        match=r"remat\.pipeline\.load: not a remat\.pipeline/4 or remat\.pipeline/3 or remat\.pipeline/2 "
        r"plan \(format 'other'\)",
    ):
        pp.PipelinePlan.load(tmp_path / "bad.json")
    with pytest.raises(RematValueError, match=r"no stage runs on this rank \(rank 5 of 2\)"):
        plain.stages(5, "cpu")
    with pytest.raises(RematTypeError, match=r"this plan was made for stage modules"):
        dataclasses.replace(plain, boundaries=()).with_model(model)


def test_an_interleaved_plan_runs_two_stages_per_rank_and_saves_and_loads(example, tmp_path: Path) -> None:
    model, _, _ = example
    p = _plan(example, "1GB", schedule="interleaved-1f1b", stages_per_rank=2, boundaries=[1, 2, 3])
    assert [sp.rank for sp in p.stage_plans] == [0, 1, 0, 1]
    assert [sp.in_flight for sp in p.stage_plans] == [p.order.in_flight(s) for s in range(4)]
    p.save(tmp_path / "plan.json")
    loaded = pp.PipelinePlan.load(tmp_path / "plan.json", model)
    assert loaded == p and loaded.order.stages_of(1) == (1, 3)


def test_interleaved_refusals_name_plan(example) -> None:
    with pytest.raises(
        RematValueError,
        match=r"remat\.pipeline\.plan: interleaved-1f1b needs the micro-batches in whole rounds.*"
        r"\(5 micro-batches on 2 ranks: 2 rounds\); use a multiple of 2 micro-batches",
    ):
        _plan(example, "1GB", schedule="interleaved-1f1b", stages_per_rank=2, n_microbatches=5)
    with pytest.raises(
        RematValueError,
        match=r"remat\.pipeline\.plan: only interleaved-1f1b runs more than one stage per rank "
        r"\('1f1b' with stages_per_rank=2\)",
    ):
        _plan(example, "1GB", stages_per_rank=2)


def _four(budget, **options) -> pp.PipelinePlan:
    torch.manual_seed(0)
    model, x, y = mlp_chain(8, 32, 128), torch.randn(64, 32), torch.randn(64, 32)
    return pp.plan(
        model,
        x,
        n_stages=4,
        n_microbatches=8,
        budget_per_rank=budget,
        loss_fn=nn.functional.mse_loss,
        target=y,
        boundaries=[2, 4, 6],
        op_costs="model",
        **options,
    )


def test_the_plan_at_per_block_checkpointings_need_fits_and_is_no_slower() -> None:
    # NOTE [stage plans from the frontier]: rank 0 holds 4 micro-batches; only plans that hold
    # little per micro-batch (every block checkpointed) reach uniform checkpointing's need there
    always = _four("1GB", checkpoint="always")
    assert all(sp.plan is not None and not sp.except_last for sp in always.stage_plans)
    need = max(always.timeline().peak_bytes)
    joint = _four(need)
    assert max(joint.timeline().peak_bytes) <= need
    assert joint.timeline().makespan <= always.timeline().makespan
    assert all(
        j.recompute_s <= a.recompute_s for j, a in zip(joint.stage_plans, always.stage_plans, strict=True)
    )
    # the last rank holds one micro-batch at a time: it needs less than per-block checkpointing
    assert joint.stage_plans[3].recompute_s < always.stage_plans[3].recompute_s
    # the cost model's op times give the same plan on every run

    def chosen(p: pp.PipelinePlan) -> list[object]:
        return [(sp.plan and sp.plan.regions, sp.except_last, sp.recompute_s) for sp in p.stage_plans]

    assert chosen(_four(need)) == chosen(joint)


def test_blocks_run_again_as_modules_are_weighed_beside_the_tape() -> None:
    """``rerun_modules=True``: a block checkpointed runs again as its module (no tape), holding
    what the tape's plan holds but the generators' states of each call; the joint plan at that
    mode's need weighs both ways and is no slower than either mode. A large budget still
    recomputes nothing: the figures of a stage are counted from the plan that recomputes nothing,
    not from the cheapest plan at the plain peak, which may run a module again (that made the
    rank peaks of "always" 2.5 times the tape's)."""
    tape = _four("1GB", checkpoint="always")
    again = _four("1GB", checkpoint="always", rerun_modules=True)
    for t, a in zip(tape.stage_plans, again.stage_plans, strict=True):
        assert t.plan is not None and a.plan is not None
        assert [(r.first, r.last) for r in a.plan.regions] == [(r.first, r.last) for r in t.plan.regions]
        assert all(r.rerun for r in a.plan.regions) and not any(r.rerun for r in t.plan.regions)
    # each call run again keeps the CPU generator's state: two blocks per stage, rank 0 holding up
    # to four micro-batches (the tape keeps none here: no block draws random numbers)
    state = torch.get_rng_state().nbytes
    for t, a in zip(tape.timeline().peak_bytes, again.timeline().peak_bytes, strict=True):
        assert t < a <= t + 2 * 4 * state and (a - t) % state == 0
    need = max(again.timeline().peak_bytes)
    joint = _four(need, rerun_modules=True)
    assert max(joint.timeline().peak_bytes) <= need
    for mode in (tape, again):
        assert joint.timeline().makespan <= mode.timeline().makespan
        assert all(
            j.recompute_s <= m.recompute_s for j, m in zip(joint.stage_plans, mode.stage_plans, strict=True)
        )
    assert all(sp.plan is None for sp in _four("1GB", rerun_modules=True).stage_plans)


def test_torchgpipes_uniform_modes(example) -> None:
    last = _plan(example, "1GB", checkpoint="except_last", op_costs="model")
    assert all(sp.plan is not None and sp.except_last for sp in last.stage_plans)
    assert all("every block checkpointed" in sp.plan.notes for sp in last.stage_plans if sp.plan is not None)
    never = _plan(example, "1GB", checkpoint="never", op_costs="model")
    assert all(sp.plan is None for sp in never.stage_plans)
    refused = r"needs with checkpoint='never'.*rank 0 needs.*or checkpoint='planned'"
    with pytest.raises(RematValueError, match=refused):
        _plan(example, max(never.timeline().peak_bytes) - 1, checkpoint="never", op_costs="model")
    _, x, y = example
    with pytest.raises(RematValueError, match=r"checkpoints each block of a stage.*\(stage 0: Linear\)"):
        pp.plan(
            [nn.Linear(32, 32), nn.Linear(32, 32)],
            x,
            n_stages=2,
            n_microbatches=M,
            budget_per_rank="1GB",
            loss_fn=nn.functional.mse_loss,
            target=y,
            checkpoint="always",
        )
    with pytest.raises(RematValueError, match=r"unknown checkpoint mode \('sometimes'\); use one of planned"):
        _plan(example, "1GB", checkpoint="sometimes")
    with pytest.raises(RematValueError, match=r"unknown op costs \('guessed'\); use one of measured, model"):
        _plan(example, "1GB", op_costs="guessed")


class _Listed(nn.Module):
    """A stage keeping its blocks in an ``nn.ModuleList`` beside a child of its own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        wide = 4 * width
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, wide), nn.ReLU(), nn.Linear(wide, width)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_uniform_modes_checkpoint_each_block_of_a_module_list() -> None:
    torch.manual_seed(0)
    stages, x = [_Listed(16), _Listed(16)], torch.randn(64, 16)
    p = pp.plan(
        stages,
        x,
        n_stages=2,
        n_microbatches=2,
        budget_per_rank="1GB",
        loss_fn=nn.functional.mse_loss,
        target=torch.randn(64, 16),
        checkpoint="always",
        op_costs="model",
    )
    for sp in p.stage_plans:
        assert sp.plan is not None
        assert [r.name for r in sp.plan.regions] == ["inp", "layers.0", "layers.1", "layers.2"]
        assert sp.saved_bytes < sp.plain_saved_bytes


def test_a_ranks_receive_buffers_are_sized_by_the_stage_that_sends() -> None:
    """NOTE [receive buffers]: stage 1 receives stage 0's wide output (2048 columns) and sends
    back a narrow one; its rank's need, as the refusal names it, is the plan's own timeline's
    (planning once stood stage 1's costs in for stage 0's and sized the buffers by its output)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 2048),
        nn.Linear(2048, 256),
        nn.Tanh(),
        nn.Linear(256, 256),
        nn.Tanh(),
        nn.Linear(256, 4),
    )
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    options: dict[str, Any] = dict(
        n_stages=2,
        n_microbatches=4,
        schedule="1f1b",
        boundaries=[1],
        loss_fn=nn.functional.mse_loss,
        target=y,
        op_costs="model",
    )
    need = pp.plan(model, x, budget_per_rank="1GB", **options).timeline().peak_bytes
    with pytest.raises(RematValueError, match=f"rank 1 needs {need[1]} bytes"):
        pp.plan(model, x, budget_per_rank=need[1] - 1, **options)


def test_a_parameter_shared_by_two_stages_is_refused() -> None:
    """Tied weights split across stages would each get part of their gradient, with no error. The
    error names them as the model does (it named them within each stage: ``1.weight`` for the
    model's ``3.weight``)."""
    torch.manual_seed(0)
    first, last = nn.Linear(16, 16), nn.Linear(16, 16)
    last.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(16, 16), last)
    x = torch.randn(8, 16)
    options = {"n_stages": 2, "n_microbatches": 2, "budget_per_rank": "1GB", "target": x}
    with pytest.raises(
        RematValueError,
        match=r"stages must not share a parameter .*\(0\.weight of stage 0 is 3\.weight of stage 1\)",
    ):
        pp.plan(model, x, loss_fn=nn.functional.mse_loss, boundaries=[2], **options)
    plan = pp.plan(model, x, loss_fn=nn.functional.mse_loss, **{**options, "n_stages": 1})
    assert len(plan.stage_plans) == 1  # one stage may share what it likes


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_a_child_that_does_not_return_one_tensor_is_refused() -> None:
    model, x = nn.Sequential(nn.Linear(16, 16), _Pair(), nn.Linear(16, 16)), torch.randn(8, 16)
    options = {"n_stages": 2, "n_microbatches": 2, "budget_per_rank": "1GB", "target": x}
    with pytest.raises(
        RematTypeError,
        match=r"each child of the model returns one tensor.*\(child 1 \(_Pair\) returned a tuple\)",
    ):
        pp.plan(model, x, loss_fn=nn.functional.mse_loss, **options)
    with pytest.raises(RematTypeError, match=r"each child of the model takes the tensor the one before it"):
        pp.plan(
            nn.Sequential(nn.Linear(16, 16), nn.Linear(8, 8)), x, loss_fn=nn.functional.mse_loss, **options
        )


def test_the_zoo_gpt2_chain_owns_its_head() -> None:
    from remat.pipeline.zoo_chain import gpt2_chain

    chain, _, _ = gpt2_chain(2, 16)
    assert chain[-1].lm_head.weight is not chain[0].wte.weight
    assert torch.equal(chain[-1].lm_head.weight, chain[0].wte.weight)


def _in_place_chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16)
    )


@pytest.mark.parametrize("balance_by", ["memory", "time", "step"])
def test_a_chain_of_in_place_modules_is_cut_where_no_stage_starts_writing_its_input(balance_by: str) -> None:
    """torch's stage receives its input as a leaf that requires grad, which ``ReLU(inplace=True)``
    may not write (NOTE [a stage's input is a leaf]): the cut avoids it, and the example is left as
    it was (the checks ran a copy)."""
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    before = x.clone()
    for stages in (2, 3):
        plan = pp.plan(
            _in_place_chain(),
            x,
            n_stages=stages,
            n_microbatches=stages,
            budget_per_rank="1GB",
            loss_fn=nn.functional.mse_loss,
            target=y,
            balance_by=balance_by,
            op_costs="model",
        )
        assert not any(isinstance(_in_place_chain()[k], nn.ReLU) for k in plan.boundaries[1:-1])
    assert torch.equal(x, before)


def test_a_cut_or_stages_starting_with_a_module_that_writes_its_input_are_refused() -> None:
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    options: dict[str, Any] = dict(
        n_stages=2, n_microbatches=2, budget_per_rank="1GB", loss_fn=nn.functional.mse_loss, target=y
    )
    rule = (
        r"remat\.pipeline\.plan: no stage but the first starts with a module that writes its input in place"
    )
    with pytest.raises(
        RematValueError, match=rule + r".*\(stage 1 starts with child 1 \(ReLU\)\); cut elsewhere"
    ):
        pp.plan(_in_place_chain(), x, boundaries=[1], **options)
    chain = _in_place_chain()
    stages = [chain[:1], nn.Sequential(*chain[1:])]
    with pytest.raises(RematValueError, match=rule + r".*\(stage 1 \(Sequential\) writes its input\)"):
        pp.plan(stages, x, **options)
    with pytest.raises(
        RematValueError, match=rule + r".*\(2 stages of 2 children, children \[1\] write theirs\)"
    ):
        pp.plan(_in_place_chain()[:2], x, **options)


@pytest.mark.parametrize(
    ("loss_fn", "error", "match"),
    [
        (
            lambda out: out.sum(),
            RematTypeError,
            r"loss_fn\(output, target\) takes the last stage's output and the ",
        ),
        (
            lambda out, target: nn.functional.mse_loss(out, target, reduction="none"),
            RematValueError,
            r"returns the micro-batch's loss, a scalar tensor that requires grad \(got tensor of shape "
            r"\[32, 16\]\)",
        ),
        (lambda out, target: 1.0, RematValueError, r"a scalar tensor that requires grad \(got float\)"),
    ],
)
def test_a_loss_fn_of_another_form_is_refused_in_the_pipelines_words(
    loss_fn: Any, error: type, match: str
) -> None:
    """Not the planner's ``loss_fn(model, *inputs)`` advice, nor a bare TypeError."""
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    with pytest.raises(error, match=r"remat\.pipeline\.plan: " + r".*" + match):
        pp.plan(
            nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
            x,
            n_stages=2,
            n_microbatches=2,
            budget_per_rank="1GB",
            loss_fn=loss_fn,
            target=y,
        )


def test_boundaries_may_be_an_array() -> None:
    np = pytest.importorskip("numpy")
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    options: dict[str, Any] = dict(
        n_stages=2, n_microbatches=2, budget_per_rank="1GB", loss_fn=nn.functional.mse_loss, target=y
    )
    for given in (np.array([2]), np.cumsum([2]), torch.tensor([2])):
        assert pp.plan(_in_place_chain(), x, boundaries=given, **options).boundaries == (0, 2, 5)
