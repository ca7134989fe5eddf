"""Bad input to the public API is refused in remat's words (``remat.<api>: <rule> (<given>);
<what to do>``), not with an exception from deep inside torch or remat, a hang, or silence."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
import remat.pipeline as pp
import remat.sim as sim
import remat.trace as tr
from remat import RematTypeError, RematValueError
from remat.dynamic import DynamicModule
from remat.memory import format_bytes
from remat.sim.synthetic import training_step


def _lin() -> nn.Linear:
    return nn.Linear(4, 4)


X = torch.randn(2, 4)


def _pipeline(model: object) -> Any:
    return pp.plan(
        model, X, n_stages=2, n_microbatches=2, budget_per_rank="1MB", loss_fn=lambda o, t: o.sum(), target=X
    )  # type: ignore[arg-type]


def _chain_pipeline() -> Any:
    """A pipeline plan of two stages over a chain of two tanh layers."""
    chain = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    y = torch.randn(4, 8)
    loss = lambda o, t: (o - t).pow(2).mean()  # noqa: E731
    return pp.plan(chain, y, n_stages=2, n_microbatches=2, budget_per_rank="1MB", loss_fn=loss, target=y)


CASES: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "checkpoint a class",
        lambda: remat.checkpoint(nn.Linear, X),
        RematTypeError,
        r"remat\.checkpoint: fn must be callable \(got the class Linear\)",
    ),
    (
        "sequential of classes",
        lambda: remat.checkpoint_sequential([nn.Linear, nn.Tanh], 2, X),
        RematTypeError,
        r"remat\.checkpoint_sequential: .*\(got the classes Linear, Tanh\)",
    ),
    (
        "debug against check",
        lambda: remat.checkpoint(_lin(), X, check="none", debug=True),
        RematValueError,
        r"remat\.checkpoint: torch's debug= and determinism_check= set remat's check=: they disagree "
        r"\(got check='none' and debug=True\)",
    ),
    (
        "determinism against check",
        lambda: remat.checkpoint(_lin(), X, check="values", determinism_check="none"),
        RematValueError,
        r"disagree \(got check='values' and determinism_check='none'\)",
    ),
    (
        "DynamicModule keep",
        lambda: DynamicModule(_lin(), "10MB", keep=()),
        RematTypeError,
        r"remat\.dynamic\.DynamicModule: its options are remat\.dynamic's .*\(got keep\)",
    ),
    (
        "DynamicModule unknown",
        lambda: DynamicModule(_lin(), "10MB", bogus=1),
        RematTypeError,
        r"\(got bogus\); use backend, cost",
    ),
    (
        "DynamicModule no module",
        lambda: DynamicModule(5, "10MB"),
        RematTypeError,
        r"DynamicModule runs an nn\.Module \(got int\)",
    ),  # type: ignore[arg-type]
    (
        "DynamicModule optimizer",
        lambda: DynamicModule(_lin(), "10MB", optimizer=5),
        RematTypeError,
        r"optimizer is a torch\.optim\.Optimizer, or None \(got int\)",
    ),  # type: ignore[arg-type]
    (
        "Plan.load number",
        lambda: remat.Plan.load(5),
        RematTypeError,
        r"remat\.plan\.load: a path is a string or a pathlib\.Path \(got int\)",
    ),  # type: ignore[arg-type]
    ("trace.load None", lambda: tr.load(None), RematTypeError, r"remat\.trace\.load: a path is a string"),  # type: ignore[arg-type]
    (
        "trace.save number",
        lambda: tr.save(5, "t.jsonl"),
        RematTypeError,
        r"remat\.trace\.save: a trace is a remat\.trace\.Trace \(got int\)",
    ),  # type: ignore[arg-type]
    ("trace.validate number", lambda: tr.validate(5), RematTypeError, r"remat\.trace\.validate: a trace is"),  # type: ignore[arg-type]
    ("sim.facts number", lambda: sim.facts(5, True), RematTypeError, r"remat\.sim\.facts: a trace is"),  # type: ignore[arg-type]
    (
        "sweep one trace",
        lambda: sim.sweep(training_step(2), ["dtr"], [0.5]),
        RematTypeError,
        r"traces is a list \(every trace is swept\) \(got Trace\)",
    ),  # type: ignore[arg-type]
    (
        "sweep one ratio",
        lambda: sim.sweep([training_step(2)], ["dtr"], 0.5),
        RematTypeError,
        r"ratios is a list .*\(got float\); pass \[ratio, \.\.\.\]",
    ),  # type: ignore[arg-type]
    (
        "simulate layout",
        lambda: sim.simulate(training_step(2), 0.5, layout="x"),
        RematTypeError,
        r"layout is True or False \(got 'x'\)",
    ),  # type: ignore[arg-type]
    (
        "simulate compact",
        lambda: sim.simulate(training_step(2), 0.5, compact="x"),
        RematTypeError,
        r"compact is True or False \(got 'x'\)",
    ),  # type: ignore[arg-type]
    (
        "capture repeats",
        lambda: tr.capture(_lin(), (X,), lambda o: o.sum(), repeats=1.5),
        RematTypeError,
        r"remat\.trace\.capture: repeats is a whole number of at least 1 \(got 1\.5\)",
    ),
    (
        "capture optimizer",
        lambda: tr.capture(_lin(), (X,), lambda o: o.sum(), optimizer=5),
        RematTypeError,
        r"optimizer is a torch\.optim\.Optimizer \(got 5\)",
    ),  # type: ignore[arg-type]
    ("capture loss", lambda: tr.capture(_lin(), (X,), 5), RematTypeError, r"loss_fn is callable \(got 5\)"),  # type: ignore[call-overload]
    (
        "capture scratch",
        lambda: tr.capture(_lin(), (X,), lambda o: o.sum(), scratch="x"),
        RematTypeError,
        r"scratch is True or False",
    ),  # type: ignore[arg-type]
    (
        "zoo tiny",
        lambda: remat.zoo.build("gpt2", tiny="yes"),
        RematTypeError,
        r"remat\.zoo\.build: tiny is True or False \(got 'yes'\)",
    ),  # type: ignore[arg-type]
    (
        "zoo seed",
        lambda: remat.zoo.build("gpt2", tiny=True, seed=1.5),
        RematTypeError,
        r"seed is a whole number \(got 1\.5\)",
    ),  # type: ignore[arg-type]
    (
        "zoo device",
        lambda: remat.zoo.build("gpt2", tiny=True, device="xyz"),
        RematValueError,
        r"device is a torch device \(got 'xyz'\)",
    ),
    (
        "format_bytes nan",
        lambda: format_bytes(float("nan")),
        RematTypeError,
        r"remat\.memory\.format_bytes: a byte count to format is a finite number \(got nan\)",
    ),
    ("format_bytes None", lambda: format_bytes(None), RematTypeError, r"\(got None\)"),  # type: ignore[arg-type]
    (
        "auto's options",
        lambda: remat.plan(
            nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
            (X,),
            0.9,
            loss_fn=lambda m, x: m(x).sum(),
            repeats=1,
            time_limit=5,
        ),
        RematTypeError,
        r"remat\.plan: unknown option for solver 'auto' \(got time_limit\); use slots, single_level",
    ),
    (
        "early stop's flag",
        lambda: remat.set_checkpoint_early_stop("x").__enter__(),
        RematValueError,
        r"remat\.set_checkpoint_early_stop: enable must be one of False, True \(got enable='x'\); "
        r"pass enable=True$",
    ),
    (
        "apply to no module",
        lambda: remat.Plan.from_json({}).apply(5),
        Exception,
        r".",
    ),
    (
        "a lazy model planned",
        lambda: remat.plan(
            nn.Sequential(nn.LazyLinear(4), nn.Tanh()), (X,), 0.9, loss_fn=lambda m, x: m(x).sum()
        ),
        RematValueError,
        r"remat\.plan: a model is planned with its parameters made .*\(Sequential has uninitialized "
        r"parameters\); run one forward first",
    ),
    (
        "schedule too long",
        lambda: pp.build("gpipe", 10**6, 10**6),
        RematValueError,
        r"remat\.pipeline: a schedule holds at most 3000000 actions",
    ),
    (
        "pipeline plan number",
        lambda: pp.plan(
            5, X, n_stages=2, n_microbatches=2, budget_per_rank="1MB", loss_fn=lambda o, t: o.sum(), target=X
        ),
        RematTypeError,
        r"remat\.pipeline\.plan: model_or_stages is an nn\.Module to cut, or a list of the stage modules "
        r"\(got int\)",
    ),  # type: ignore[arg-type]
    (
        "pipeline plan class",
        lambda: _pipeline(nn.Sequential),
        RematTypeError,
        r"\(got the class Sequential\)",
    ),  # type: ignore[arg-type]
    (
        "pipeline plan classes",
        lambda: _pipeline([nn.Linear, nn.Linear]),
        RematTypeError,
        r"\(got a list of the class Linear\)",
    ),  # type: ignore[list-item]
]


@pytest.mark.parametrize(("what", "call", "kind", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_in_remats_words(
    what: str, call: Callable[[], Any], kind: type[Exception], pattern: str
) -> None:
    with pytest.raises(kind, match=pattern):
        call()


def test_a_plan_refuses_a_position_a_table_file_and_a_stage_device_that_are_not_one(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    x = torch.randn(64, 16)
    plan = remat.plan(model, (x,), 0.9, loss_fn=lambda m, x: m(x).pow(2).sum(), repeats=1)
    for position in ("a", None, 1.5):
        with pytest.raises(
            RematTypeError, match=r"remat\.plan\.region_of: an op's position is a whole number"
        ):
            plan.region_of(position)  # type: ignore[arg-type]
    with pytest.raises(
        RematTypeError, match=r"remat\.plan\.explain: file is where the table goes.*\(got int\)"
    ):
        plan.explain(file=5)
    with pytest.raises(RematTypeError, match=r"remat\.plan\.apply: apply takes the model to run \(got int\)"):
        plan.apply(5).__enter__()  # type: ignore[arg-type]
    with pytest.raises(
        RematValueError, match=r"remat\.memory\.plot: path names the picture's file, not a folder"
    ):
        with remat.memory.track() as tracked:
            torch.randn(8).sum()
        remat.memory.plot({"a": tracked}, tmp_path)
    assert not os.path.exists(f"{tmp_path}.png")
    pipe = _chain_pipeline()
    for rank, device, pattern in (
        ("0", "cpu", r"rank is a whole number \(got '0'\)"),
        (0, "xyz", r"device is a torch device \(got 'xyz'\)"),
        (0, "meta", r"a stage runs on a device that computes \(got meta\)"),
        (
            0,
            "cpu",
            r"stages exchange activations over torch\.distributed \(no process group is initialized\)",
        ),
    ):
        with pytest.raises((RematTypeError, RematValueError), match=pattern):
            pipe.stages(rank, device)  # type: ignore[arg-type]
    # a group of another size than the plan's ranks: gloo aborted the process at the first message
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        with pytest.raises(
            RematValueError,
            match=r"remat\.pipeline\.PipelinePlan\.stages: the process group has a process per rank of the "
            r"plan \(the plan runs on 2 ranks, the group has 1\); start 2 processes",
        ):
            pipe.stages(0, "cpu")
    finally:
        torch.distributed.destroy_process_group()
    with pytest.raises(RematTypeError, match=r"remat\.pipeline\.explain: file is where the table goes"):
        pipe.explain(file=5)


@pytest.mark.parametrize(
    "name",
    ["scope", "offload", "plainly", "set_checkpoint_early_stop", "memory.track"],
)
def test_a_context_used_as_a_decorator_without_its_parentheses_is_refused(name: str) -> None:
    """``@remat.scope`` took the function as its policy, and calling it returned a function."""
    context = remat.memory.track if name == "memory.track" else getattr(remat, name)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with pytest.raises(
        RematTypeError,
        match=rf"remat\.{name}: as a decorator it takes its parentheses "
        rf"\(@remat\.{name} over the function f\); write @remat\.{name}\(\)",
    ):
        context(f)


def test_a_memory_track_object_is_entered_again_as_a_new_measure() -> None:
    track = remat.memory.track()
    for n in (1, 2):
        with track as m:
            kept = torch.zeros(256 * n)
        assert m.peak_bytes == kept.nbytes


class _NotCallable:
    decide = 5


class _NoContext:
    def decide(self) -> remat.Decision:
        return remat.Decision.SAVE


_SEQ = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
MORE: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "decide not callable",
        lambda: remat.checkpoint(_lin(), X, policy=_NotCallable()),  # type: ignore[arg-type]
        RematTypeError,
        r"remat\.checkpoint: policy\.decide must be a method taking one OpContext \(_NotCallable\.decide "
        r"is 5, not callable\)",
    ),
    (
        "decide without a context",
        lambda: remat.scope(_NoContext()).__enter__(),  # type: ignore[arg-type]
        RematTypeError,
        r"remat\.scope: policy\.decide must be a method taking one OpContext \(_NoContext\.decide is a "
        r"function of \(\)",
    ),
    (
        "zoo name list",
        lambda: remat.zoo.build(["gpt2"]),
        RematTypeError,
        r"remat\.zoo\.build: unknown model name",
    ),
    (
        "zoo seed range",
        lambda: remat.zoo.build("gpt2", tiny=True, seed=2**70),
        RematValueError,
        r"remat\.zoo\.build: seed is a whole number of 64 bits at most",
    ),
    (
        "capture a class",
        lambda: tr.capture(nn.Linear, X, lambda o: o.sum()),  # type: ignore[arg-type]
        RematTypeError,
        r"remat\.trace\.capture: step is a model or a function, not a model's class",
    ),
    (
        "capture inputs",
        lambda: tr.capture(_SEQ, 5, lambda o: o.sum(), repeats=1),  # type: ignore[arg-type]
        RematTypeError,
        r"remat\.trace\.capture: inputs is a tensor, a sequence of the model's arguments or a mapping",
    ),
    (
        "device profile",
        lambda: tr.DeviceProfile("d", -1.0, 1.0),
        RematValueError,
        r"remat\.trace\.DeviceProfile: flops is a finite number above 0 \(got -1\.0\)",
    ),
    (
        "device profile overhead",
        lambda: tr.DeviceProfile("d", 1.0, 1.0, float("nan")),
        RematValueError,
        r"remat\.trace\.DeviceProfile: overhead is a finite number of seconds",
    ),
]
MORE.append(
    (
        "pipeline target",
        lambda: pp.plan(
            _SEQ,
            X,
            n_stages=2,
            n_microbatches=2,
            budget_per_rank="1GB",
            loss_fn=nn.functional.mse_loss,
            target=X[:, :3],
        ),
        RematValueError,
        r"remat\.pipeline\.plan: loss_fn\(output, target\) runs on the last stage's output and the "
        r"micro-batch's target \(output float32\[2, 4\], target float32\[2, 3\]: The size of tensor",
    )
)
if not torch.cuda.is_available():
    MORE.append(
        (
            "zoo cuda here",
            lambda: remat.zoo.build("gpt2", tiny=True, device="cuda"),
            RematValueError,
            r"remat\.zoo\.build: no CUDA device here",
        )
    )


@pytest.mark.parametrize(("what", "call", "kind", "pattern"), MORE, ids=[c[0] for c in MORE])
def test_more_bad_input_is_refused_in_remats_words(
    what: str, call: Callable[[], Any], kind: type[Exception], pattern: str
) -> None:
    with pytest.raises(kind, match=pattern):
        call()


def test_damaged_plan_files_and_a_closed_stream_are_refused() -> None:
    import copy
    import io

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    plan = remat.plan(model, torch.randn(8, 16), "min", loss_fn=lambda m, a: m(a).pow(2).sum(), repeats=1)
    closed = io.StringIO()
    closed.close()
    with pytest.raises(RematValueError, match=r"remat\.plan\.explain: file is a stream open for writing"):
        plan.explain(file=closed)
    body = plan.to_json()
    for edit, said in (
        (lambda b: b["tensors"][0].__setitem__("nbytes", "abc"), r"a tensor's entry is damaged"),
        (lambda b: b["tensors"][0].__setitem__("op", True), r"a tensor's entry is damaged"),
        (lambda b: b["tensors"][0].__setitem__("module", 5), r"a tensor's entry is damaged"),
        (lambda b: b.__setitem__("gap", float("nan")), r"gap must be a finite number"),
        (lambda b: b.__setitem__("predicted_overhead", float("inf")), r"predicted_overhead must be a finite"),
        (lambda b: b.__setitem__("trainable", "abc"), r"trainable must list true or false"),
    ):
        damaged = copy.deepcopy(body)
        edit(damaged)
        with pytest.raises(RematValueError, match=rf"remat\.plan\.load: the plan file is .*damaged \({said}"):
            remat.Plan.from_json(damaged)


def test_damaged_pipeline_plan_files_and_stages_that_are_not_torchs_are_refused() -> None:
    import copy

    pipe = _chain_pipeline()
    with pytest.raises(RematTypeError, match=r"remat\.pipeline\.PipelinePlan\.schedule: stages are torch"):
        pipe.schedule([1], lambda o, t: o.sum())
    body = pipe.to_json()
    for edit, said in (
        (lambda b: b["stage_plans"][0].__setitem__("rank", 99), r"stage 0 on rank 99 of 2"),
        (lambda b: b["stage_plans"][0].__setitem__("rank", "0"), r"stage 0: rank '0'"),
        (lambda b: b["stage_plans"][0].__setitem__("saved_bytes", -5), r"stage 0: saved_bytes -5"),
        (lambda b: b["stage_plans"].__setitem__(1, b["stage_plans"][0]), r"stage plan 1 is for stage 0"),
        (lambda b: b.__setitem__("boundaries", [0, 1.7, 4]), r"boundaries \[0, 1\.7, 4\]"),
        (lambda b: b.__setitem__("budget_bytes", 1.9), r"budget_bytes 1\.9"),
    ):
        damaged = copy.deepcopy(body)
        edit(damaged)
        with pytest.raises(
            RematValueError, match=rf"remat\.pipeline\.load: the plan file is .*damaged \(.*{said}"
        ):
            pp.PipelinePlan.from_json(damaged)


def test_numpy_numbers_are_taken_where_python_ones_are() -> None:
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(4, 8)
    plan = remat.plan(model, (x,), np.float32(1.0), loss_fn=lambda m, a: m(a).sum(), repeats=np.int64(1))
    assert plan.region_of(np.int64(0)) == plan.region_of(0)
    assert tr.capture(model, (x,), lambda o: o.sum(), repeats=np.int64(1)).ops
    assert remat.dynamic(np.float32(0.5), thrash_limit=np.float32(3)).budget > 0
    assert remat.dynamic("1MB", reserve=np.int64(0)).reserve == 0


def test_a_reserve_is_checked_when_the_region_is_made_whatever_the_budget() -> None:
    for budget in (None, 0.5):
        with pytest.raises(
            RematValueError, match=r"remat\.dynamic: cannot parse this byte size \(got 'abc'\)"
        ):
            remat.dynamic(budget, reserve="abc")
    with pytest.raises(RematValueError, match=r"remat\.dynamic: the reserve is a part of the budget"):
        remat.dynamic(0.5, reserve=1.0)
    refused = pytest.raises(RematTypeError, match=r"remat\.scope: offloader must be a remat\.Offloader")
    with refused, torch.no_grad(), remat.scope(offloader="x"):  # type: ignore[arg-type]
        pass
