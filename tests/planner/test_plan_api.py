"""remat.plan on live models: an applied plan computes exactly what the plain model does (losses,
every gradient, batch-norm buffers, the RNG stream) for every solver, measures what it predicts,
and refuses clearly what it cannot do."""

from __future__ import annotations

import copy
import dataclasses
import io
import re
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import assert_same, build, train, twin
from plans import _measured_peak, _plan, _traced, fixed_costs, step_peak, trace_with_fixed_costs
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import remat
from remat import Plan, RecomputationError, RematTypeError, RematValueError
from remat.planner import BudgetTooSmall, plan_trace, room, trace_step
from remat.planner.api import block_key
from remat.planner.lowering import chain_from_trace
from remat.planner.predict import Prediction
from remat.planner.room import filled, filled_all
from remat.planner.search import Candidate, Step, best, keeping_compute, simple, untied
from remat.policy import Decision

SOLVERS = ["auto", "chain", "greedy", "milp", "sqrt"]


@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
@pytest.mark.parametrize("solver", SOLVERS)
def test_applied_plan_is_transparent(name: str, solver: str) -> None:
    plan = _plan(name, solver)
    assert plan.regions, f"{solver} recomputed nothing: the test would prove nothing"
    assert any(t.action is Decision.RECOMPUTE for t in plan.tensors)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    model, batch, _ = build(name)
    planned = twin(model)
    plain = train(model, batch, steps=2)
    ran = train(planned, batch, steps=2, region=lambda: plan.apply(planned))
    assert_same(plain, ran)


@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
def test_plain_step_measures_the_baseline_and_the_plan_less(name: str) -> None:
    plan = _plan(name, "chain")
    model, batch, _ = build(name)
    inputs = batch(0)
    plain = _measured_peak(model, inputs, None)
    planned = _measured_peak(model, inputs, plan)
    assert plain == pytest.approx(plan.baseline_peak_bytes, rel=0.02)
    assert planned < plain


@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
@pytest.mark.parametrize("solver", SOLVERS)
def test_measured_peak_is_the_predicted_one(name: str, solver: str) -> None:
    """The prediction replays the step with the executor's semantics (NOTE [region model]), so the
    peak the allocator measures (kernels' scratch buffers and the tape's generator states
    included) is at most the predicted one, and within 1% of it; hence within the budget."""
    plan = _plan(name, solver)
    model, batch, _ = build(name)
    planned = _measured_peak(model, batch(0), plan)
    assert planned <= plan.predicted_peak_bytes
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert planned >= 0.99 * plan.predicted_peak_bytes


class _Gelu(nn.Module):
    """GPT-2's tanh GELU: autograd keeps three of its Python numbers as 0-dim tensors."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return 0.5 * h * (1.0 + torch.tanh(0.79788 * (h + 0.044715 * torch.pow(h, 3.0))))


def _gelu_blocks() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor], remat.trace.Trace, int]:
    """Four blocks with a tanh GELU, their step's loss (after a warm-up step), its trace on fixed
    costs, and the minimum a ``BudgetTooSmall`` names for it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), _Gelu(), nn.Linear(64, 16)) for _ in range(4)])
    x = torch.randn(8, 16)

    def loss(m: nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    step_peak(model, loss)  # a warm-up step
    trace = fixed_costs(trace_step(model, (), loss, repeats=1))
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1000)
    return model, loss, trace, info.value.minimum_bytes


def test_the_floor_counts_the_numbers_autograd_keeps() -> None:
    """NOTE [wrapped numbers] in ``remat.aten.schema``: 24 bytes a block that no dispatch mode
    sees; the plan at the floor measured 24 bytes over it, the plain step 96 over its prediction."""
    model, loss, trace, minimum = _gelu_blocks()
    plan = plan_trace(trace, minimum)
    assert step_peak(model, loss, plan) == plan.predicted_peak_bytes <= minimum
    assert step_peak(model, loss) == plan.baseline_peak_bytes


def test_budget_min_is_the_plan_of_the_minimum_a_refusal_names() -> None:
    """``budget="min"``: the lowest plan of the search, the one the minimum of a ``BudgetTooSmall``
    is the peak of, measured at its prediction; another solver's own lowest plan; and a budget
    that is none of bytes, a ratio or "min" names all three."""
    model, loss, trace, minimum = _gelu_blocks()
    lowest = plan_trace(trace, " MIN ")
    assert lowest.budget_bytes == lowest.predicted_peak_bytes == minimum
    assert lowest.predicted_peak_bytes < lowest.baseline_peak_bytes
    assert step_peak(model, loss, lowest) == lowest.predicted_peak_bytes
    sqrt = min(c.pred.peak_bytes for c in remat.planner.frontier.frontier(trace, "sqrt").candidates)
    assert plan_trace(trace, "min", solver="sqrt").predicted_peak_bytes == sqrt
    with pytest.raises(RematValueError, match=r'remat.plan: cannot parse .*got \'minimum\'.*or "min"'):
        plan_trace(trace, "minimum")
    with pytest.raises(RematValueError, match=r'a ratio budget must lie in \(0, 1\].*or "min"'):
        remat.plan(model, (), 1.5, loss_fn=lambda m: loss(m))


@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
def test_a_larger_budget_never_costs_more(name: str) -> None:
    trace, base, low = _traced(name)
    overheads = [plan_trace(trace, low + (base - low) * k // 10).predicted_overhead for k in range(11)]
    assert all(a >= b for a, b in zip(overheads, overheads[1:], strict=False)), overheads
    assert overheads[0] > overheads[-1] == 1.0


def test_remat_plan_end_to_end_leaves_the_model_as_it_was(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace_with_fixed_costs(monkeypatch)  # which plan wins (chain's) must not depend on op timings
    model, batch, _ = build("cnn")
    inputs = batch(0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    rng = torch.get_rng_state()

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return m(x, y)

    plan = remat.plan(model, (inputs["x"], inputs["y"]), budget=0.9, loss_fn=loss_fn, repeats=1)
    assert isinstance(plan, remat.Plan)
    assert plan.name == "CNN" and plan.solver == "chain" and plan.gap is not None
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), f"planning changed {k}"
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    planned = twin(model)
    assert_same(
        train(model, batch, steps=2), train(planned, batch, steps=2, region=lambda: loaded.apply(planned))
    )


def test_explain_lists_blocks_and_regions() -> None:
    plan = _plan("gpt2", "chain")
    buffer = io.StringIO()
    assert plan.explain(file=buffer) is None  # printed once, not also returned to a REPL
    text = buffer.getvalue()
    for region in plan.regions:
        assert region.name.split("..")[0] in text
    assert "transformer.h.0" in text and "recomputed" in text and "total" in text
    assert str(plan).startswith("Plan(GPT2LMHeadModel, chain: peak")
    first = plan.regions[0]
    assert plan.region_of(first.first) == first and plan.region_of(first.last) == first
    assert plan.region_of(len(plan.ops)) is None
    assert plan.recomputed_bytes > 0 and plan.saved_bytes > 0
    with pytest.raises(remat.RematValueError, match=r"remat\.plan\.load: no such file \(/no/such\.json\)"):
        remat.Plan.load("/no/such.json")


def test_explain_gives_a_reason_per_block_in_bytes_and_milliseconds() -> None:
    """Each block's row says why, in the figures weighed: the time its saved tensors' ops take to
    run again against the bytes they hold ("kept: matmul outputs, 0.02 ms to recompute for 1.50
    KiB"); no bare units, and the gap said in words."""
    plan = _plan("gpt2", "chain")
    buffer = io.StringIO()
    plan.explain(file=buffer)
    text = buffer.getvalue()
    blocks = {line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│ transformer.h.")}
    assert len(blocks) == 2  # one row (wrapped over lines) per block, each with its reason:
    words = " ".join(text.replace("│", " ").split())
    for verb in ("kept", "recomputed"):
        assert re.search(
            verb + r": [a-z_]+ (and [a-z_]+ )?outputs?.*?, [\d.]+ ms to recompute for [\d.]+ (B|KiB|MiB)",
            words,
        )
    recomputed = [t for t in plan.tensors if t.action is Decision.RECOMPUTE]
    assert recomputed and all(t.seconds > 0 for t in recomputed)
    assert " units" not in buffer.getvalue().replace("units of", "")
    assert "gap" not in str(plan) and (
        "heuristic plan" in str(plan) or "costlier than the cheapest" in str(plan)
    )


# -- errors ---------------------------------------------------------------------------------


def test_budget_below_minimum_names_it_and_the_op() -> None:
    trace, _, low = _traced("gpt2")
    with pytest.raises(
        RematValueError,
        match=rf"remat.plan: budget below the smallest feasible peak \(budget 1000 < {low} bytes, .*\); "
        rf"the minimum is {low} bytes \(needed by op \d+ aten\.\w+\.\w+ in [\w.]+",
    ):
        plan_trace(trace, 1000)
    assert plan_trace(trace, low).predicted_peak_bytes <= low


class Branchy(nn.Module):
    """A model whose control flow a flag changes after planning."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.relu_in = 9
        self.skip = -1
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i == self.skip:
                continue
            x = block(x)
            if i == self.relu_in:
                x = torch.relu(x)
        loss = x.pow(2).mean()
        return loss * 2 if self.extra else loss


@pytest.fixture
def branchy() -> tuple[Branchy, Plan, torch.Tensor]:
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(64, 16)
    return model, remat.plan(model, (x,), budget=0.8, repeats=1), x


def test_divergent_op_is_named_with_position_and_module(branchy: tuple[Branchy, Plan, torch.Tensor]) -> None:
    model, plan, x = branchy
    model.relu_in = 1
    with (
        pytest.raises(
            RecomputationError,
            match=r"remat.plan: the model's forward diverged from the traced step \(op #\d+: expected "
            r"aten\.t\.default in blocks\.2\.0, got aten\.relu\.default in Branchy\)",
        ),
        plan.apply(model),
    ):
        model(x)
    model.relu_in = 9
    with plan.apply(model):  # the same plan and model run again once the path is the traced one
        model(x).backward()


def test_only_the_forward_runs_under_the_plans_dispatch_mode(
    branchy: tuple[Branchy, Plan, torch.Tensor],
) -> None:
    model, plan, x = branchy
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with plan.apply(model):
        model.relu_in = 1
        with pytest.raises(RecomputationError, match="diverged"):
            model(x)
        model.relu_in = 9
        loss = model(x)  # a forward that raised left the mode pushed; the next one starts over
        assert _get_current_dispatch_mode() is None, "the loss, backward and optimizer run without it"
        loss.backward()
    assert _get_current_dispatch_mode() is None
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_more_ops_are_refused(branchy: tuple[Branchy, Plan, torch.Tensor]) -> None:
    model, plan, x = branchy
    model.extra = True
    n = len(plan.ops)
    with (
        pytest.raises(
            RecomputationError,
            match=rf"remat.plan: the model ran more ops than the traced step \(op #{n} aten\.mul\.Tensor in "
            rf"Branchy, after the {n} traced ops\)",
        ),
        plan.apply(model),
    ):
        model(x)


def test_fewer_ops_are_refused() -> None:
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(64, 16)
    model.extra = True
    plan = remat.plan(model, (x,), budget=0.8, repeats=1)
    model.extra = False
    n = len(plan.ops)
    with (
        pytest.raises(
            RecomputationError,
            match=rf"remat.plan: the model ran fewer ops than the traced step \(ran {n - 1} of {n}; "
            rf"op #{n - 1} would be aten\.mul\.Tensor in Branchy\)",
        ),
        plan.apply(model),
    ):
        model(x)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"model": "gpt2"}, RematTypeError, r"remat.plan: model must be an nn.Module \(got str\)"),
        ({"budget": 1.5}, RematValueError, r"remat.plan: a ratio budget must lie in \(0, 1\] \(got 1.5\)"),
        ({"budget": "lots"}, RematValueError, r"remat.plan: "),
        (
            {"solver": "rotor"},
            RematValueError,
            r"remat.plan: unknown solver \(got 'rotor'\); use one of auto",
        ),
        (
            {"solver": 3},
            RematTypeError,
            r"remat.plan: a solver is named by a string \(got 3\); use one of auto",
        ),
        ({"example_inputs": 3}, RematTypeError, r"remat.plan: example_inputs must be a tensor"),
        ({"loss_fn": "mse"}, RematTypeError, r"remat.plan: loss_fn must be callable"),
        (
            {"repeats": "3"},
            RematTypeError,
            r"remat.plan: repeats \(timed runs per op\) must be a whole number",
        ),
        ({"repeats": 0}, RematValueError, r"remat.plan: repeats .* \(got 0\)"),
        (
            {"loss_fn": lambda m, x: m.blocks[0](x)},
            RematValueError,
            r"remat.plan: the step's loss must be a real scalar tensor that requires grad "
            r"\(got tensor of shape \[64, 16\], float32, requiring grad\)",
        ),
        (
            {"loss_fn": lambda m, x: m(x).sum().detach()},
            RematValueError,
            r"loss must be a real scalar .*\(got tensor of shape \[\], float32, not requiring grad \(",
        ),
        (
            {"loss_fn": lambda m, x: m(x).sum() * (1 + 1j)},
            RematValueError,
            r"loss must be a real scalar .*\(got tensor of shape \[\], complex64, requiring grad\)",
        ),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], text: str) -> None:
    args: dict[str, Any] = {"model": Branchy(), "example_inputs": (torch.randn(64, 16),), "budget": 0.5}
    args.update(kwargs)
    with pytest.raises(error, match=text):
        remat.plan(args.pop("model"), args.pop("example_inputs"), **args)


def test_planning_under_no_grad_says_grad_is_off() -> None:
    with (
        torch.no_grad(),
        pytest.raises(
            RematValueError,
            match=r"remat\.plan: the step's loss must be a real scalar tensor that requires grad \(got "
            r"tensor of shape \[\], float32, not requiring grad .*, made with grad disabled "
            r"\(torch\.no_grad\)\); plan outside torch\.no_grad\(\)",
        ),
    ):
        remat.plan(Branchy(), (torch.randn(64, 16),), budget=0.5, loss_fn=lambda m, x: m(x).sum())


def test_the_two_steps_refuse_what_they_cannot_take() -> None:
    model = Branchy()
    with pytest.raises(
        RematTypeError, match=r"remat\.plan: plan_trace takes a captured step \(got Branchy\)"
    ):
        plan_trace(model, 0.5)  # type: ignore[arg-type]
    with pytest.raises(RematTypeError, match=r"remat\.plan: loss_fn must be callable \(got str\)"):
        trace_step(model, (torch.randn(64, 16),), loss_fn="mse")  # type: ignore[arg-type]


def test_load_refuses_other_files(tmp_path: Any) -> None:
    path = tmp_path / "x.json"
    path.write_text('{"format": "something/2"}')
    with pytest.raises(
        RematValueError, match=r"remat.plan.load: not a remat.plan/1 plan \(format 'something/2'\)"
    ):
        Plan.load(path)
    path.write_text("{")
    with pytest.raises(RematValueError, match=r"remat.plan.load: the plan file is not JSON"):
        Plan.load(path)


class DoubleConv(nn.Sequential):
    """A block written as a Sequential subclass."""

    def __init__(self) -> None:
        super().__init__(nn.Conv2d(1, 1, 1), nn.ReLU())


def test_block_key_follows_the_model_structure() -> None:
    model = nn.Module()
    model.inc = DoubleConv()
    model.down = nn.ModuleList([DoubleConv(), DoubleConv()])
    model.stem = nn.Sequential(nn.Conv2d(1, 1, 1), nn.ReLU())
    model.head = nn.Linear(1, 1)
    key = block_key(model)
    assert key("inc.0") == key("inc.1") == "inc"
    assert key("down.1.0") == "down.1"
    assert key("stem.1") == "stem.1"  # a plain Sequential holds blocks
    assert key("head") == "head"
    assert key("Module") == "Module"  # the root's own ops, named after its class by the capture


SUFFIX = ", keeping matmul, convolution and attention outputs"


def test_keeping_compute_keeps_matmul_outputs_and_replays_less() -> None:
    trace, _, _ = _traced("gpt2")
    step = Step(trace)
    plain = simple(step, chain_from_trace(trace))
    kept = keeping_compute(step, plain)
    assert kept and len(kept) <= len(plain)
    for candidate in kept:
        saved = {i for _, ops in candidate.regions for i in ops.save}
        assert saved and all(trace.ops[i].packet in {"mm", "addmm", "bmm", "baddbmm"} for i in saved)
        base = next(c for c in plain if candidate.notes.removesuffix(SUFFIX) == c.notes)
        assert candidate.pred.recompute_cost < base.pred.recompute_cost
        assert candidate.pred.peak_bytes >= base.pred.peak_bytes


def test_a_filled_plan_of_a_cnn_with_batch_norm_trains_exactly_and_measures_its_peak() -> None:
    """NOTE [room under the peak] on a CNN with batch norm, in-place ReLU and dropout (hidden writes,
    blank writes): every block checkpointed, filled up to its peak, keeps more at the same predicted
    peak, drops the last region, measures that peak, and trains bit for bit."""
    trace, _, _ = _traced("cnn")
    step = Step(trace)
    every = next(c for c in simple(step, chain_from_trace(trace)) if c.notes == "every block checkpointed")
    full = filled(step, every)
    assert full is not None
    assert full.pred.peak_bytes <= every.pred.peak_bytes
    assert full.pred.recompute_cost < every.pred.recompute_cost
    assert len(full.regions) < len(every.regions)
    plan = dataclasses.replace(plan_trace(trace, 1.0), regions=tuple(r for r, _ in full.regions))
    model, batch, _ = build("cnn")
    planned = twin(model)
    plain = train(model, batch, steps=2)
    ran = train(planned, batch, steps=2, region=lambda: plan.apply(planned))
    assert_same(plain, ran)
    assert _measured_peak(planned, batch(0), plan) <= full.pred.peak_bytes


def test_filling_stops_when_its_predictions_run_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """``remat.planner.room`` fills the plans lowest in peak first while its count of predictions
    lasts: a count, so the candidates are the same on every run; the plan begun is finished."""
    trace, _, _ = _traced("gpt2")
    step = Step(trace)
    candidates = [c for c in simple(step, chain_from_trace(trace)) if c.regions]
    everything = filled_all(step, candidates)
    assert len(everything) > 1
    monkeypatch.setattr(room, "_PREDICTIONS", 1)
    lowest = min(candidates, key=lambda c: c.pred.peak_bytes)
    (first,) = filled_all(step, candidates)
    assert first.notes.startswith(lowest.notes) and first.pred.peak_bytes <= lowest.pred.peak_bytes


def _candidate(solver: str, overhead: float, peak: int) -> Candidate:
    prediction = Prediction(peak, 0, "op 0", 1.0, overhead - 1.0, ())
    return Candidate(solver, None, solver, [], prediction)


def test_ties_between_plans_go_by_a_fixed_solver_order() -> None:
    """NOTE [plan ties]: of two plans within 0.1%, the one of the first solver of chain, greedy,
    milp, sqrt, plain checkpointing (then the lower peak) drops the other where its peak is no
    higher, so op times a few microseconds apart never swap the pick; a plan with a lower peak
    stays, since it fits budgets the other does not (NOTE [monotone plans])."""
    greedy, chain = _candidate("greedy", 1.2500, 100), _candidate("chain", 1.2510, 100)
    assert untied([greedy, chain]) == untied([chain, greedy]) == [chain]
    cheaper = _candidate("greedy", 1.20, 100)  # 4% cheaper: no tie
    assert best(untied([cheaper, chain])) is cheaper
    lower = _candidate("greedy", 1.2500, 90)
    assert untied([lower, chain]) == [lower, chain] and best([lower, chain]) is lower
    assert untied([_candidate("auto", 1.2500, 100), greedy]) == [greedy]
    assert untied([_candidate("chain", 1.25, 120), chain]) == [chain]  # same solver: the lower peak


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
@pytest.mark.parametrize("rerun", [False, True], ids=["tape", "rerun"])
def test_a_plan_steps_aside_in_inference_mode(rerun: bool, mode: Any) -> None:
    """In inference mode or under no_grad (a validation pass) nothing is saved, and composite ops
    (``linear``) reach a dispatch mode whole in inference mode: the model runs as it is, and the
    next training step under the plan is unaffected."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)]
    model, x = nn.Sequential(*blocks, nn.Linear(64, 1)), torch.randn(256, 64)
    plan = remat.plan(model, (x,), 0.6, loss_fn=lambda m, x: m(x).square().mean(), rerun_modules=rerun)
    assert plan.regions
    with mode(), plan.apply(model):
        out = model(x)
    assert torch.equal(out, model(x))
    with plan.apply(model):
        model(x).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("transform", ["grad", "vmap", "forward AD"])
@pytest.mark.parametrize("rerun", [False, True], ids=["tape", "rerun"])
def test_a_plan_steps_aside_under_a_torch_func_transform_or_forward_ad(rerun: bool, transform: str) -> None:
    """Under ``torch.func.grad``, ``vmap`` or forward-mode AD the model runs as it is, as the manual
    forms run (they carry their own derivatives, and refuse saved-tensor hooks): the plan raised
    torch's errors from inside, or called the child's call a bypass of the model's."""
    import torch.autograd.forward_ad as forward_ad

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(6)]
    model, x = nn.Sequential(*blocks, nn.Linear(32, 1)), torch.randn(64, 32)
    plan = remat.plan(model, (x,), 0.6, loss_fn=lambda m, x: m(x).square().mean(), rerun_modules=rerun)
    assert plan.regions

    def run() -> torch.Tensor:
        if transform == "grad":
            return torch.func.grad(lambda a: model(a).square().sum())(x)
        if transform == "vmap":
            return torch.func.vmap(model)(x.view(4, 16, 32))
        with forward_ad.dual_level():
            return forward_ad.unpack_dual(model(forward_ad.make_dual(x, torch.ones_like(x)))).tangent

    expected = run()
    with plan.apply(model):
        got = run()
    assert torch.equal(got, expected)
    with plan.apply(model):
        model(x).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_solver_options_files_and_keys_that_cannot_work_are_clear_errors(tmp_path: Any) -> None:
    trace, _, _ = _traced("gpt2")
    for solver, options, error, rule in [
        ("chain", {"time_limit": 5}, RematTypeError, r"unknown option for solver 'chain' \(got time_limit\)"),
        ("auto", {"bogus": 1}, RematTypeError, r"unknown option for solver 'auto' \(got bogus\)"),
        (
            "chain",
            {"slots": 0},
            RematValueError,
            r"option slots of solver 'chain' must be an int of at least 1",
        ),
        ("milp", {"time_limit": "x"}, RematValueError, r"option time_limit of solver 'milp' must be a float"),
        ("milp", {"time_limit": -1.0}, RematValueError, r"option time_limit"),
        ("milp", {"max_nodes": 2.5}, RematValueError, r"option max_nodes"),
        ("sqrt", {"segments": 2.5}, RematValueError, r"option segments of solver 'sqrt' must be an int"),
        (
            "sqrt",
            {"segments": 0},
            RematValueError,
            r"option segments of solver 'sqrt' must be an int .* \(0\)",
        ),
    ]:
        with pytest.raises(error, match=rule):
            plan_trace(trace, 1.0, solver=solver, **options)
    with pytest.raises(RematValueError, match=r"block_key maps a module path"):
        plan_trace(trace, 1.0, block_key="x")  # type: ignore[arg-type]
    with pytest.raises(RematValueError, match=r"executor_cost must be an ExecutorCost"):
        plan_trace(trace, 1.0, executor_cost="x")  # type: ignore[arg-type]
    with pytest.raises(RematValueError, match=r"remat\.plan\.load: cannot read this file"):
        Plan.load(tmp_path)
    with pytest.raises(RematValueError, match=r"remat\.trace\.save: the path names a file"):
        remat.trace.save(trace, tmp_path)
    with pytest.raises(RematTypeError, match=r"remat\.sim\.simulate: trace must be a Trace"):
        remat.sim.simulate("x", 0.5)  # type: ignore[arg-type]
    plan = plan_trace(trace, 0.8)
    body = plan.to_json()
    body["regions"] = [{**body["regions"][0], "first": 5, "last": 2}]
    with pytest.raises(RematValueError, match=r"regions must be disjoint spans"):
        Plan.from_json(body)


class _Residual(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2, self.drop = (
            nn.LayerNorm(w),
            nn.Linear(w, 2 * w),
            nn.Linear(2 * w, w),
            nn.Dropout(0.1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))


class _ThreeBlocks(nn.Module):
    def __init__(self, w: int = 48) -> None:
        super().__init__()
        self.inp, self.layers, self.head = (
            nn.Linear(16, w),
            nn.ModuleList(_Residual(w) for _ in range(3)),
            nn.Linear(w, 4),
        )

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), target.flatten())


def test_auto_reaches_every_sqrt_plans_floor() -> None:
    """``auto`` weighs Chen's plans at every segment count on both chains: its smallest plan is no
    higher than any of sqrt's (it named a minimum 6% above one sqrt reached here)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(12)
    x, target = torch.randn(4, 16, 16, generator=generator), torch.randint(0, 4, (4, 16), generator=generator)
    trace = fixed_costs(trace_step(_ThreeBlocks(), (x, target), lambda m, x, t: m(x, t), repeats=1))
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1)
    sqrt = min(c.pred.peak_bytes for c in remat.planner.frontier.frontier(trace, "sqrt").candidates)
    assert info.value.minimum_bytes <= sqrt


def test_a_solvers_refusal_says_what_that_solver_reaches() -> None:
    """A budget below the minimum names it; where the solver asked for cannot reach it (sqrt with
    one segment recomputes nothing), the error says what that solver reaches and that auto
    reaches the minimum, instead of leaving the user to find out at the next call."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(12)
    x, target = torch.randn(4, 16, 16, generator=generator), torch.randint(0, 4, (4, 16), generator=generator)
    trace = fixed_costs(trace_step(_ThreeBlocks(), (x, target), lambda m, x, t: m(x, t), repeats=1))
    with pytest.raises(BudgetTooSmall, match=r"solver 'sqrt' itself reaches \d+ bytes at least") as info:
        plan_trace(trace, 1, solver="sqrt", segments=1)
    with pytest.raises(RematValueError, match="solver 'sqrt' found no plan within the budget"):
        plan_trace(trace, info.value.minimum_bytes, solver="sqrt", segments=1)
    assert plan_trace(trace, info.value.minimum_bytes).predicted_peak_bytes <= info.value.minimum_bytes


def test_every_solver_names_the_minimum_auto_reaches() -> None:
    """A budget below every plan's peak names the same minimum whichever solver was asked: the
    greedy solver's error named 690,360 bytes on the zoo's GPT-2 (the coarse chain's floor plans)
    where auto, and the chain solver on the finer chain, reach 613,152."""
    wl = remat.zoo.build("gpt2", tiny=True, batch=8)
    trace = fixed_costs(trace_step(wl.model, wl.inputs, lambda m, *i: wl.loss_fn(m(*i)), repeats=1))
    minimum = {}
    for solver in ("auto", "greedy", "chain", "sqrt"):
        with pytest.raises(BudgetTooSmall) as info:
            plan_trace(trace, 1, solver=solver)
        minimum[solver] = info.value.minimum_bytes
    assert len(set(minimum.values())) == 1, minimum
    assert plan_trace(trace, minimum["auto"]).predicted_peak_bytes <= minimum["auto"]


class _InPlace(nn.Module):
    """In-place adds, scalings and activations between linear layers: sqrt's segments and auto's
    fills reach lower than the chain and greedy solvers' own floors."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.layers):
            z = layer(h)
            z += h
            y = self.act(z.mul_(0.5))
            if i % 2:
                y = nn.functional.silu(y * 2, inplace=True)
            h = y
        return h.square().mean()


def test_every_solver_names_the_minimum_auto_reaches_where_its_own_plans_stop_higher() -> None:
    """The chain and greedy solvers (and the MILP) named their own floor (a third above auto's) as
    the minimum; now the step's, and that they stop higher."""
    torch.manual_seed(0)
    model = _InPlace()
    trace = fixed_costs(trace_step(model, (torch.randn(8, 16, 32),), repeats=1))
    minimum = {}
    for solver in ("auto", "chain", "greedy", "sqrt"):  # the MILP takes minutes here
        with pytest.raises(BudgetTooSmall) as info:
            plan_trace(trace, 1, solver=solver, block_key=block_key(model))
        minimum[solver] = info.value.minimum_bytes
        if solver in ("chain", "greedy"):
            assert f"solver {solver!r} itself reaches" in str(info.value)
    assert len(set(minimum.values())) == 1, minimum
    assert (
        plan_trace(trace, minimum["auto"], block_key=block_key(model)).predicted_peak_bytes <= minimum["auto"]
    )


def test_a_plans_errors_in_backward_name_remat_plan() -> None:
    """A weight a plan's region read, written between forward and backward, is refused by the
    region's replay; the error named ``remat.scope``, which the program never called."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Sigmoid(), nn.Linear(64, 32)) for _ in range(3)]
    model, x = nn.Sequential(*blocks), torch.randn(2, 16, 32)

    def loss(m: nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    trace = fixed_costs(trace_step(model, (), loss, repeats=1))
    with pytest.raises(BudgetTooSmall) as info:
        plan_trace(trace, 1)
    plan = plan_trace(trace, info.value.minimum_bytes)
    assert plan.regions
    with plan.apply(model):
        out = loss(model)
    with torch.no_grad():
        model[0][0].weight.add_(0.5)  # x needs no gradient: plain autograd saved no copy of it
    with pytest.raises(RecomputationError, match=r"^remat\.plan: a tensor the region read was modified"):
        out.backward()


class _OwnNoise(nn.Module):
    """Blocks whose residual is masked by draws from a generator the model holds (``self.g``), or
    holds one attribute down (``self.config.g``)."""

    def __init__(self, deep: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(3)
        )
        self.config = types.SimpleNamespace(g=torch.Generator().manual_seed(3))
        self.g = None if deep else self.config.g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x) * (torch.rand(x.shape, generator=self.config.g) > 0.2)
        return x.square().mean()


@pytest.mark.parametrize("deep", [False, True], ids=["self.g", "self.config.g"])
def test_planning_puts_back_a_generator_the_model_holds(deep: bool) -> None:
    """Planning put back the default generator's state but advanced the model's own (three
    forwards of draws): the first planned step drew other masks than the same step run plainly.
    One attribute down, past what ``untouched`` reaches, the capture's own mode puts it back."""
    torch.manual_seed(0)
    model, x = _OwnNoise(deep), torch.randn(2, 16, 32)
    twin = copy.deepcopy(model)
    before = model.config.g.get_state()
    plan = remat.plan(model, (x,), "min")
    assert plan.regions and torch.equal(model.config.g.get_state(), before)
    with plan.apply(model):
        loss = model(x)
    loss.backward()
    expected = twin(x)
    expected.backward()
    assert torch.equal(loss, expected)
    assert all(
        torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )


class _Cached(nn.Module):
    """A block that builds a table at its first call and keeps it, as a plain attribute or as a
    buffer registered as None (not in the state dict)."""

    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)
        if as_buffer:
            self.register_buffer("table", None, persistent=False)
        else:
            self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.sin(torch.arange(x.shape[1]).float()[:, None] * torch.arange(32).float() / 32)
        h = torch.tanh(self.a(x + self.table))
        return x + self.b(torch.sigmoid(h) * h)


@pytest.mark.parametrize("as_buffer", [False, True], ids=["attribute", "buffer"])
def test_a_table_built_at_the_first_call_is_built_before_the_step_is_traced(as_buffer: bool) -> None:
    """NOTE [built at first call]: planning traced the call that builds the table; training then
    ran the others, and the plan refused step 0 (a plain attribute, left built) or step 1 (a
    buffer, put back unbuilt). Now three SGD steps under the plan equal the plain ones."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Cached(as_buffer) for _ in range(3)])
    twin = copy.deepcopy(model)
    xs = [torch.randn(2, 16, 32) for _ in range(3)]
    plan = remat.plan(model, (xs[0],), "min", loss_fn=lambda m, x: m(x).square().mean())
    assert plan.regions
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
    for x in xs:
        with plan.apply(model):
            loss = model(x).square().mean()
        loss.backward()
        expected = twin(x).square().mean()
        expected.backward()
        assert torch.equal(loss, expected)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert all(map(torch.equal, model.parameters(), twin.parameters()))


def test_a_plan_applied_to_a_model_of_other_parameters_says_so() -> None:
    """Applied to another model (two blocks where three were planned), the plan said its
    parameters required grad otherwise, as if some were frozen."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)

    def model(n: int) -> nn.Module:
        return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n)), nn.Linear(8, 1))

    plan = remat.plan(model(3), (x,), 1.0, loss_fn=lambda m, x: m(x).sum())
    with (
        pytest.raises(
            RematValueError, match=r"remat.plan.apply: the plan runs the model it was made for \(a model "
        ),
        plan.apply(model(2)),
    ):
        pass
