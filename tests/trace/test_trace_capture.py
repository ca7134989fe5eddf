"""remat.trace.capture: what a captured step records (tensors, aliases, mutations, phases, modules,
saved tensors, releases) and that its liveness gives the memory remat.memory.track measures."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import remat
from remat.trace import Op, Phase, Release, Trace, capture, op_time
from remat.trace.liveness import live_bytes


def _op(trace: Trace, name: str, nth: int = 0) -> Op:
    return [op for op in trace.ops if op.name == name][nth]


def test_views_alias_their_storage_and_in_place_ops_mutate() -> None:
    x = torch.ones(1000)

    def step() -> None:
        y = x * 2  # 4000 bytes, a new storage
        v = y.view(10, 100)  # an alias: no bytes
        v.add_(1)  # in place: mutates v, makes nothing
        del y, v

    trace = capture(step, repeats=1, scratch=False)
    mul, view, add = trace.ops
    assert mul.name == "aten.mul.Tensor" and trace.tensors[mul.inputs[0]].constant
    y = trace.tensors[mul.outputs[0]]
    assert (y.nbytes, y.alias_of, y.shape, y.dtype) == (4000, None, (1000,), "float32")
    v = trace.tensors[view.outputs[0]]
    assert (v.nbytes, v.alias_of, v.shape) == (0, y.id, (10, 100))
    assert add.outputs == () and add.mutates == (v.id,) and add.inputs == (v.id,)
    # The storage dies when its last handle goes: both handles are released together, after add_.
    releases = [e for e in trace.events if isinstance(e, Release)]
    assert {r.tensor for r in releases} == {y.id, v.id}
    assert trace.events.index(releases[0]) > trace.events.index(add)
    assert trace.activation_peak_bytes == 4000
    assert trace.peak_bytes == 4000 + 4000  # with the constant x


def test_random_ops_are_marked_and_constants_are_never_made() -> None:
    x = torch.randn(8, 16)
    trace = capture(lambda: nn.functional.dropout(x, 0.5, training=True), repeats=1)
    assert any(op.random for op in trace.ops)
    assert all(not op.random for op in trace.ops if "bernoulli" not in op.name)
    made = {t for op in trace.ops for t in op.outputs}
    assert all(not trace.tensors[t].constant for t in made)
    assert [t.constant for t in trace.tensors].count(True) == 1


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_phases_and_module_paths() -> None:
    torch.manual_seed(0)
    net = _Net()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt = torch.optim.Adam(net.parameters())
    trace = capture(net, (x,), lambda out: nn.functional.cross_entropy(out, y), optimizer=opt, repeats=1)
    phases = [op.phase for op in trace.ops]
    first_bwd, first_opt = phases.index(Phase.BACKWARD), phases.index(Phase.OPTIMIZER)
    assert set(phases[:first_bwd]) == {Phase.FORWARD}
    assert set(phases[first_bwd:first_opt]) == {Phase.BACKWARD}
    assert set(phases[first_opt:]) == {Phase.OPTIMIZER}
    assert _op(trace, "aten.addmm.default").module == "layers.0"
    assert _op(trace, "aten.relu.default").module == "layers.1"
    # Backward ops are attributed to the module whose forward op made the node they run.
    assert _op(trace, "aten.threshold_backward.default").module == "layers.1"
    assert {op.module for op in trace.ops if op.name == "aten.mm.default"} == {"layers.0", "layers.2"}
    assert trace.name == "_Net"
    assert str(trace).startswith("Trace(_Net, capture on cpu:")


def test_saved_tensors_and_the_backward_ops_that_read_them() -> None:
    x = torch.randn(256, requires_grad=True)

    def step() -> None:
        x.exp().sum().backward()  # exp saves its output for backward

    trace = capture(step, repeats=1)
    exp = _op(trace, "aten.exp.default")
    (out,) = exp.outputs
    assert out in trace.saved
    reads = trace.saved_reads()[out]
    assert reads and all(trace.ops[i].phase is Phase.BACKWARD for i in reads)
    assert any(trace.ops[i].name == "aten.mul.Tensor" for i in reads)
    assert trace.activation_peak_bytes > 0 and x.grad is not None
    # exp saves its output after it ran: between it and the next op
    assert (out, exp.index + 1) in trace.saved_at
    assert {t for t, _ in trace.saved_at} == trace.saved


def test_fake_tensors_have_estimated_costs_only() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        net = _Net()
        x, y = torch.randn(4096, 16), torch.randint(0, 4, (4096,))
    trace = capture(net, (x,), lambda out: nn.functional.cross_entropy(out, y))
    assert trace.source == "capture-fake"
    assert trace.total_cost == 0.0 and trace.total_est_cost > 0.0
    assert trace.activation_peak_bytes > 4096 * 32 * 4  # at least the hidden activations


def test_measured_cost_is_the_median_of_the_timed_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fixed clock, not this machine's: the timed runs of an op take 1, 5 and 2 µs, in turn.
    runs = itertools.cycle([1e-6, 5e-6, 2e-6])
    now, calls = [0.0], itertools.count()

    def clock() -> float:  # read twice around each run: at its start, then at its end
        if next(calls) % 2:
            now[0] += next(runs)
        return now[0]

    monkeypatch.setattr(op_time, "time", SimpleNamespace(perf_counter=clock))
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    trace = capture(lambda: a @ b, repeats=3, scratch=False)
    assert [op.name for op in trace.ops] == ["aten.mm.default"]
    assert trace.ops[0].cost == pytest.approx(2e-6)


@pytest.mark.parametrize("optimizer", [None, "sgd"])
def test_liveness_follows_memory_track_op_by_op(optimizer: str | None) -> None:
    # remat.memory.track counts the same storages; with the capture's saved-tensor hooks installed
    # the two see the same ops, so the whole timeline must agree, not only the peak.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) if optimizer else None

    def step() -> None:
        nn.functional.cross_entropy(net(x), y).backward()
        if opt is not None:
            opt.step()

    step()
    net.zero_grad(set_to_none=True)
    gc.collect()
    with saved_tensors_hooks(lambda t: t, lambda t: t), remat.memory.track() as m:
        step()
    net.zero_grad(set_to_none=True)
    trace = capture(step, repeats=1, scratch=False)  # track counts tensors, not kernels' buffers
    measured = [s.bytes for s in m.timeline if not s.op.startswith("profiler.")]
    assert [made for _, made in live_bytes(trace)] == measured
    assert trace.activation_peak_bytes == m.peak_bytes


def test_argument_errors() -> None:
    with pytest.raises(remat.RematValueError, match=r"remat\.trace\.capture: repeats is a whole number"):
        capture(lambda: None, repeats=0)
    with pytest.raises(remat.RematTypeError, match=r"remat\.trace\.capture: a model needs inputs and a loss"):
        capture(nn.Linear(2, 2))
    with pytest.raises(remat.RematTypeError, match=r"remat\.trace\.capture: the step must be a callable"):
        capture(42)  # type: ignore[call-overload]


def test_hooks_are_removed_even_when_the_step_fails() -> None:
    hooks = (nn.modules.module._global_forward_pre_hooks, nn.modules.module._global_forward_hooks)
    before = [len(h) for h in hooks]

    def step() -> None:
        nn.Linear(2, 2)(torch.ones(2))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        capture(step)
    assert [len(h) for h in hooks] == before
    assert capture(lambda: torch.ones(3) + 1).ops[0].phase is Phase.FORWARD


def test_scratch_is_what_the_allocator_sees_beyond_the_tensors() -> None:
    # A CPU convolution unfolds or reorders its input in buffers it frees before returning: no
    # tensor of the trace, but memory. The capture measures it per op, and the trace's liveness
    # then gives the peak the allocator itself reports.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(8, 4, 7, padding=3), nn.ReLU())
    x = torch.randn(2, 8, 64, 64)

    def step() -> None:
        net(x).square().mean().backward()

    step()
    net.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False) as tensors_only, remat.memory.track(allocator=True) as allocator:
        step()
    net.zero_grad(set_to_none=True)
    trace = capture(step, repeats=1)
    net.zero_grad(set_to_none=True)
    without = capture(step, repeats=1, scratch=False)
    assert without.activation_peak_bytes == tensors_only.peak_bytes
    assert any(op.scratch > 0 for op in trace.ops if "convolution" in op.name)
    assert allocator.peak_bytes > tensors_only.peak_bytes
    assert trace.activation_peak_bytes == allocator.peak_bytes


def _gelu(h: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU: three of its Python numbers multiply a tensor that wants a gradient."""
    return 0.5 * h * (1.0 + torch.tanh(0.79788 * (h + 0.044715 * torch.pow(h, 3.0))))


def test_numbers_autograd_saves_are_made_by_their_op() -> None:
    """``0.5 * h`` hands ``mul`` a 0-dim tensor made before dispatch, which autograd keeps until
    backward (NOTE [wrapped numbers] in ``remat.aten.schema``): 8 bytes the allocator counts, which
    the trace takes as the op's own (the peak was 24 bytes short before)."""
    lin = nn.Linear(16, 64)
    x = torch.randn(8, 16)

    def step() -> None:
        _gelu(lin(x)).sum().backward()

    step()
    lin.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False, allocator=True) as allocator:
        step()
    lin.zero_grad(set_to_none=True)
    trace = capture(step, repeats=1)
    made = [trace.tensors[t] for op in trace.ops if op.name == "aten.mul.Tensor" for t in op.outputs]
    numbers = [t for t in made if t.shape == ()]
    assert [(t.nbytes, t.dtype, t.constant) for t in numbers] == [(8, "float64", False)] * 3
    assert not trace.saved & {t.id for t in numbers}  # no plan's to drop: autograd keeps them
    assert trace.activation_peak_bytes == allocator.peak_bytes


@pytest.mark.parametrize(
    "expression",
    [
        lambda x: x * 2,
        lambda x: 2 * x,
        lambda x: x / 3.0,
        lambda x: (x * 1).mul_(0.5),
        lambda x: x * True,
        lambda x: x + 1.0,
        lambda x: torch.maximum(x, torch.tensor(0.0)),
    ],
    ids=["x*2", "2*x", "x/3.0", "mul_", "x*True", "x+1.0", "torch.tensor"],
)
def test_numbers_are_counted_once(expression: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A number's 0-dim tensor, saved or not, in forward and in backward, is counted once: as the
    op's output where autograd saves it, else in the op's scratch (which running the op again to
    measure it makes anew); ``torch.tensor(0.0)`` is made in the step, not a constant."""
    x = torch.randn(4096, requires_grad=True)

    def step() -> None:
        expression(x).sum().backward()

    step()
    x.grad = None
    with remat.memory.track(timeline=False, allocator=True) as allocator:
        step()
    x.grad = None
    assert capture(step, repeats=1).activation_peak_bytes == allocator.peak_bytes


def test_batch_norm_runs_once_so_its_statistics_move_once() -> None:
    torch.manual_seed(0)
    net, twin = nn.BatchNorm1d(8), nn.BatchNorm1d(8)
    x = torch.randn(16, 8)
    net(x).sum().backward()
    capture(lambda: twin(x).sum().backward(), repeats=3)
    assert torch.equal(net.running_mean, twin.running_mean) and torch.equal(net.running_var, twin.running_var)
    assert int(net.num_batches_tracked) == int(twin.num_batches_tracked) == 1


def test_a_step_autograd_refuses_is_refused_not_recorded() -> None:
    """A tensor autograd saved, written in place before backward: the plain step raises, and so
    does its capture (its saved-tensor hook took autograd's version check away: the step was
    recorded, and the gradient came from the written values)."""
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(4, 8)

    def step() -> None:
        h = (x @ w).sigmoid()  # sigmoid saves its output
        h.mul_(2)
        h.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        step()
    w.grad = None
    with pytest.raises(
        remat.RematRuntimeError,
        match=r"remat\.trace\.capture: a tensor autograd saved for backward was modified by an in-place "
        r"operation since, which autograd refuses \(float32\[4, 4\] at version 1, saved at version 0\)",
    ):
        capture(step, repeats=1)
    assert w.grad is None


@pytest.mark.parametrize(
    ("loss_fn", "given"),
    [
        (lambda out: None, "NoneType"),
        (lambda out: (out.sum(), None), "tuple"),
        (lambda out: out, r"tensor of shape \[4, 8\]"),
    ],
    ids=["none", "tuple", "not-a-scalar"],
)
def test_a_loss_fn_that_returns_no_loss_is_a_clear_error(
    loss_fn: Callable[[torch.Tensor], object], given: str
) -> None:
    layer, x = nn.Linear(8, 8), torch.randn(4, 8)
    with pytest.raises(
        remat.RematValueError,
        match=rf"remat\.trace\.capture: loss_fn\(output\) returns the step's loss.*\(got {given}",
    ):
        remat.trace.capture(layer, (x,), loss_fn, repeats=1)


@pytest.mark.parametrize("grow", ["out=", "resize_"])
def test_a_storage_grown_in_place_is_a_clear_error(grow: str) -> None:
    """A trace gives each storage the size the op that made it gave it: ``out=`` into an empty
    tensor (or ``resize_``) grew it behind the trace's back, and a plan measured three such masks
    over its prediction and its budget."""
    w = nn.Parameter(torch.randn(32, 32))

    def step() -> None:
        x = torch.randn(16, 32) @ w
        mask = torch.empty(0)
        if grow == "out=":
            torch.rand(x.shape, out=mask)
        else:
            mask.resize_(16, 32).uniform_()
        (x * mask).sum().backward()

    with pytest.raises(
        remat.RematValueError,
        match=r"remat\.trace\.capture: an op changed the size of a tensor's storage in place",
    ):
        capture(step, repeats=1)
