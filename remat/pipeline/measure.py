"""Measuring one pipeline stage as a rank runs it: its step on one micro-batch traced on one
intra-op thread after an untimed trace, as the costs a ``StagePlan`` starts from.

Why apart from ``remat.pipeline.api``: what a stage costs is a measurement, the same whatever plan
is then chosen for it, and its rules (the thread count, the untimed first trace, the output
counted once) hold for every stage and schedule. The plans chosen from these costs are ``api``'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._state import untouched
from remat.aten import describe
from remat.pipeline.schedule import Schedule
from remat.pipeline.stage_plan import StagePlan
from remat.planner.api import block_key, plan_trace, trace_step
from remat.planner.predict import predict
from remat.trace.capture import capture
from remat.trace.events import Phase
from remat.trace.let_go import with_let_go
from remat.trace.types import Op, Trace

__all__ = ["measure", "one_thread"]

_UNLIMITED = 2**62


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Inside, torch runs one intra-op thread, as each rank does (``remat.pipeline.launch``).
    NOTE [stage times on one thread] the ranks of a pipeline share their host's cores, one
    process each; op times measured with the caller's thread pool are not those of a rank, and on
    a loaded machine each parallel op waits for its threads to be scheduled (a 256 x 64 x 256
    matmul took 40 ms on two threads of two busy cores, 0.15 ms on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _seconds(trace: Trace, phase: Phase) -> float:
    return math.fsum(op.cost for op in trace.ops if op.phase is phase)


def measure(
    order: Schedule,
    stage: int,
    module: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    op_costs: str = "measured",
) -> tuple[StagePlan, Trace, torch.Tensor, Trace | None]:
    """Stage ``stage`` of ``order`` run as it is (``module`` may checkpoint inside) on the
    micro-batch ``x`` it receives: its ``StagePlan`` with nothing planned, costs from the traced
    step (``op_costs``: its measured op times, after one untimed trace, or the cost model's
    estimates), the trace, and its output (detached; the buffers and the RNG are the caller's to
    restore). The last stage's step ends in ``loss_fn(output, target)``, the others' in a sum."""
    last = stage == order.n_stages - 1
    if stage == 0:  # its first module may write its input (a later stage's cannot): not the caller's
        x = x.detach().clone()
    inputs = x.detach().requires_grad_(stage > 0 and x.is_floating_point())
    if not inputs.requires_grad and not any(p.requires_grad for p in module.parameters()):
        raise RematValueError(
            message(
                "pipeline.plan",
                "every stage has something to differentiate: torch's schedules run a backward on each",
                f"stage {stage} has no parameter that requires grad, and its input none",
                "put the frozen modules in the next stage (boundaries=), or run them before the pipeline",
            )
        )
    outputs: list[torch.Tensor] = []

    def step_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # NOTE [the output until its backward] torch's stage holds the output until the micro-batch's
        # backward has run: so does the traced step, whether autograd saved the output or not
        # what the stage sends, as torch holds it: one contiguous tensor (``execute.sendable``)
        outputs.append(out := m(x).contiguous())
        return _loss(loss_fn, out, target) if last else out.sum()

    if op_costs == "measured":
        # NOTE [an untimed trace first] an op's first run in a process, and the capture's first sight
        # of it, are slower, and the ops the capture times once (those that draw random numbers
        # or write, such as dropout and batch norm) would carry that into the first plan's choice:
        # the step is traced once untimed first
        trace_step(module, (x.detach().requires_grad_(inputs.requires_grad),), step_loss, repeats=1)
        outputs.clear()
    trace = trace_step(module, (inputs,), step_loss, repeats=3 if op_costs == "measured" else 1)
    outputs.clear()
    if op_costs == "model":
        events = tuple(replace(e, cost=e.est_cost) if isinstance(e, Op) else e for e in trace.events)
        trace = replace(trace, events=events)
    saved, out, loss = _held(module, inputs, target, loss_fn, last)
    sizes = [t.numel() * t.element_size() for t in (inputs, out)]
    shapes = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in (inputs, out)]
    plain = plan_trace(trace, _UNLIMITED, block_key=block_key(module))
    grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    f, b = _seconds(trace, Phase.FORWARD), _seconds(trace, Phase.BACKWARD)
    # a contiguous slice keeps its whole storage: so does the send that holds it (``transfer_bytes``);
    # the last stage's loss too is kept to the end of the step (NOTE [the output counted once])
    held_out = out.untyped_storage().nbytes() + loss
    peak = plain.predicted_peak_bytes
    later = _later(module, x, stage, step_loss, trace)
    outputs.clear()
    later_peak = 0 if later is None else predict(later, ()).peak_bytes
    base = StagePlan(
        stage, order.rank_of(stage), order.in_flight(stage), None, False, f, b, 0.0,
        saved, peak, saved, peak,
        held_out, grads, (0 if last else held_out) + (sizes[0] if stage > 0 else 0),
        shapes[0], shapes[1], later_peak, later_peak, sizes[1],
        tuple(tuple(p.shape) for p in module.parameters()),
    )  # fmt: skip
    return base, trace, out, later


def _later(
    module: nn.Module,
    x: torch.Tensor,
    stage: int,
    step_loss: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    trace: Trace,
) -> Trace | None:
    """The stage's step traced with its parameters' gradients there already, on a fresh input.

    NOTE [later backwards] the first backward of a stage makes its gradients, which then stay
    (the pipeline model counts them apart from then on); a later micro-batch's backward adds into
    them. Its peak is the step's with the gradients made before the capture (constants, which a
    prediction leaves out). The forward is the same op for op, so a plan's regions (forward op
    indices) hold on this trace too; where it is not, None (the first step's peak stands in)."""
    inputs = x.detach().requires_grad_(stage > 0 and x.is_floating_point())
    with untouched([module]):
        for p in module.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        later = capture(lambda: step_loss(module, inputs).backward(), name=type(module).__name__, repeats=1)
        later = with_let_go(later, lambda: step_loss(module, inputs))
    later = replace(later, unseen_bytes=trace.unseen_bytes)  # NOTE [unseen bytes]: as the first step's
    forward = [(op.index, op.name) for op in trace.ops if op.phase is Phase.FORWARD]
    return (
        later if [(op.index, op.name) for op in later.ops if op.phase is Phase.FORWARD] == forward else None
    )


def _held(
    module: nn.Module,
    inputs: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    last: bool,
) -> tuple[int, torch.Tensor, int]:
    """The bytes one micro-batch's step (the loss's included) saves for its backward beside the
    stage's output, the output (detached), and the bytes of the last stage's loss (0 elsewhere).

    NOTE [the output counted once] the pipeline model holds every micro-batch's output beside what
    it saves (torch's stage keeps the output until the backward), so a saved output (a stage ending
    in a ReLU, a loss that saves its input such as ``mse_loss``) is left out here; what only the
    loss saves (cross entropy's log-probabilities, the size of the logits) is in. The output counts
    its whole storage (a slice of a saved tensor keeps all of it). Parameters, buffers, the input
    (the stage's receive buffer) and the target are held anyway. torch's schedule keeps each
    micro-batch's loss to the end of the step too (its list of losses, a copy of its own size:
    NOTE [compact losses] in ``remat.pipeline.execute``), so the last stage's output counts its
    loss beside it (cross entropy's 4 bytes; three of them made a rank 12 bytes over a budget)."""
    held = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers(), inputs, target)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    loss = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(inputs).contiguous()  # as the stage sends it (``execute.sendable``)
        if last:
            loss = _loss(loss_fn, out, target).nbytes  # as the schedule keeps it (NOTE [compact losses])
    seen.pop(out.untyped_storage().data_ptr(), None)
    return sum(seen.values()), out.detach(), loss


def _loss(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], out: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """``loss_fn(out, target)``, refused in the pipeline's words where it is not a micro-batch's
    scalar loss (the planner would name its own ``loss_fn(model, *inputs)``)."""
    try:
        loss = loss_fn(out, target)
    except TypeError as error:
        raise RematTypeError(
            message(
                "pipeline.plan",
                "loss_fn(output, target) takes the last stage's output and the micro-batch's target",
                f"{type(error).__name__}: {error}",
                "pass a function of two tensors, such as torch.nn.functional.mse_loss",
            )
        ) from error
    except RuntimeError as error:  # a target that does not fit the output (its shape, its dtype)
        aim = (
            describe(target.dtype, target.shape)
            if isinstance(target, torch.Tensor)
            else type(target).__name__
        )
        raise RematValueError(
            message(
                "pipeline.plan",
                "loss_fn(output, target) runs on the last stage's output and the micro-batch's target",
                f"output {describe(out.dtype, out.shape)}, target {aim}: {str(error).splitlines()[0]}"[:300],
                "pass the target of one micro-batch, as the loss takes it",
            )
        ) from error
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        given = (
            type(loss).__name__
            if not isinstance(loss, torch.Tensor)
            else f"tensor of shape {list(loss.shape)}"
        )
        raise RematValueError(
            message(
                "pipeline.plan",
                "loss_fn(output, target) returns the micro-batch's loss, a scalar tensor that requires grad",
                f"got {given}",
                "reduce it to one number (reduction='mean' or 'sum')",
            )
        )
    return loss
