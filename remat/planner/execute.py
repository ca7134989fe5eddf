"""Run a Plan in eager PyTorch: open a recomputed region at each planned op, check every op.

Why not wrap modules in checkpoints: a plan's regions are runs of ops, and a block boundary in the
trace (the ops a module issued) need not be a function anyone can call again: the residual add
between two blocks belongs to their parent. So the executor works at the op level, with the
machinery of ``remat.scope``: one dispatch mode counts the forward's ops, compares each with the
traced one, and at a region's first op starts a tape (``remat.manual.tape``) and the saved-tensor hooks
of a scope region; right after the region's last op it stops them (NOTE [region end]). Inside a
region the tape's policy is switched per op: SAVE for the op positions the plan keeps, RECOMPUTE
for the rest. In backward the region replays, as a scope does, just before the first op that
needs it, with the RNG and batch-norm buffers handled there::

    forward ops:   0 1 2 | 3 4 5 6 | 7 8 | 9 ...     (| = region boundary, from the plan)
                         [ region A]     [B]
    dispatch mode: check op i == plan.ops[i]; i == A.first -> start tape + hooks;
                   after op A.last -> stop (region A now holds only its replay slice)

A region the plan marks ``rerun`` (one module's one call, NOTE [module re-run] in
``remat.planner.rerun_regions``) runs instead through the module's ``forward``, wrapped while the
plan runs: at the expected count the mode steps aside, the call runs bare under
``remat.planner.rerun``'s hooks, and the count moves past the region.

Counting starts when the model's own forward starts (a forward pre-hook on the model) and a
forward must run exactly the traced ops: another op, or fewer or more of them, raises
RecomputationError with the position, the expected and the executed op and the module.

Where every region is one call of one module, forwards after the first in a setting run without the
mode outside the taped regions (NOTE [bare forward] in ``remat.planner.module_calls``), and a taped
region recorded once in a setting runs later calls from its template, with no mode (NOTE [taped call
run bare] in ``remat.planner.taped_calls``).

The dispatch mode is pushed when the model's forward starts and popped when it returns, so the
loss, the backward (where regions replay through their saved-tensor hooks, not through the mode)
and the optimizer run without a Python call per op.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from remat import aten
from remat._dispatch import Unguarded, skip_dynamo
from remat._errors import RecomputationError, RematError, RematTypeError, RematValueError, message
from remat.manual.checkpoint import checkpointed
from remat.manual.fused import ReplayMode, executor
from remat.manual.replay import Executor
from remat.manual.scope import TapedRegion
from remat.manual.tape import Tape
from remat.manual.traced import transformed
from remat.planner.applied import Applied, refuse_second
from remat.planner.foreign import hooks_of_another, hooks_refused
from remat.planner.module_calls import Bare, anchor, anchored, submodule, wrap
from remat.planner.regions import Region
from remat.planner.results import expected, made
from remat.policy import Decision, OpContext, RecomputeAll

__all__ = ["UNCOUNTED", "Check", "apply"]

Check = Literal["first", "every"]

# Not ops of the program (as in the trace capture): profiler markers and metadata queries.
# NOTE [uncounted ops] Autograd itself issues ``detach`` when it saves an op's output with no
# saved-tensor hooks installed, so how many there are depends on the hooks around the op (the
# capture installs one everywhere, the executor only inside regions). They make no memory and are
# neither counted nor checked, on either side.
UNCOUNTED = frozenset({"aten.detach.default"})


@dataclass(frozen=True)
class _Keep:
    """The tape policy for an op whose outputs the plan keeps."""

    def decide(self, ctx: OpContext) -> Decision:
        return Decision.SAVE


_KEEP = _Keep()
_RECOMPUTE = RecomputeAll()


class _Runner(Unguarded):
    """Counts and checks the forward's ops and runs the plan's regions (see the module doc)."""

    def __init__(
        self,
        regions: Sequence[Region],
        ops: Sequence[str],
        modules: Sequence[str],
        model: nn.Module,
        execute: Executor,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.modules = modules
        self.shapes: Sequence[str] = ()  # per op, its first result's dtype and shape (``_checked``)
        self.execute = execute
        self.starts = {r.first: r for r in regions}
        self.position = 0
        self.active = False
        self.aside = False  # this forward runs outside the plan: inference mode, a transform
        self.open: Region | None = None
        self.tape: Tape | None = None
        self.region: TapedRegion | None = None
        self.model = model
        self.top = type(model).__name__
        self.pushed = False
        self.began = False  # a forward of the model ran under the plan (``bypassed``)
        self.bare: Bare | None = None  # NOTE [bare forward] in ``remat.planner.module_calls``
        # NOTE [taped call run bare] in ``remat.planner.taped_calls``: told what the region opened
        # now packs, and the region that told it, once finished
        self.note: Callable[..., None] | None = None
        self.learned: TapedRegion | None = None

    # -- regions ---------------------------------------------------------------------------------

    def _start(self, region: Region) -> None:
        self.tape = Tape(_RECOMPUTE)
        self.region = TapedRegion(self.tape, self.execute)
        self.tape.api = self.region.api = "plan"  # in errors
        self.region.note = self.note
        self.open = region
        skip_dynamo(self.region.pack, self.region.unpack)
        torch._C._autograd._push_saved_tensors_default_hooks(self.region.pack, self.region.unpack)

    def stop(self) -> None:
        """End the open region, if any (its tape becomes the replay plan)."""
        if self.region is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.region.finish()
            if self.region.note is not None:
                self.learned = self.region
        self.open = self.tape = self.region = None

    # -- the forward -------------------------------------------------------------------------------

    def begin(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # no autograd graph (inference mode, no_grad: a validation pass): nothing saved, runs as is;
        # so does a forward under a ``torch.func`` transform or forward-mode AD, as the manual forms
        # run theirs (``remat.manual.traced.transformed``)
        self.aside = torch.is_inference_mode_enabled() or not torch.is_grad_enabled() or transformed()
        running = self.active or (self.bare is not None and self.bare.running)
        if not running and not self.aside:
            if (error := hooks_of_another()) is not None:
                raise error
            self.stop()
            self.position = 0
            self.began = True
            if self.bare is not None and self.bare.start(args, kwargs):  # NOTE [bare forward]
                return
            self.active = True
            if not self.pushed:
                self.__enter__()
                self.pushed = True

    def bypassed(self, module: nn.Module) -> None:
        """A child of the model called before any forward of the model under the plan: the step
        calls submodules itself (``model.body(x)``, ``model.forward(x)``), which the plan, counting
        the ops of the model's call, would let run unplanned, over the budget."""
        if self.began or self.active or torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
            return
        if transformed():  # runs as is, as the model's own call does (``begin``)
            return
        name = next((n for n, m in self.model.named_children() if m is module), type(module).__name__)
        raise RematValueError(
            message(
                "plan",
                "the plan runs inside a call of the model (model(...)), where it counts the step's ops",
                f"{self.top}.{name} was called before any call of {self.top}",
                "call the model itself, as the traced step did",
            )
        )

    def pop(self) -> None:
        """Leave the dispatch stack, if this mode is on top of it (a forward that raised may have
        left it pushed; ``apply`` pops it at the end)."""
        if self.pushed and _get_current_dispatch_mode() is self:
            self.__exit__(None, None, None)
            self.pushed = False

    def leave(self) -> None:
        """End the forward: close the open region and leave the dispatch stack."""
        self.stop()
        self.active = False
        self.pop()

    def end(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        raised = output is None and sys.exc_info()[0] is not None
        if self.bare is not None and self.bare.running:
            return self.bare.finish(raised)  # NOTE [bare forward]
        self.leave()  # also where the forward raised (``always_call``): the next one starts anew
        if raised or self.aside:
            return
        if self.position != len(self.ops):
            nxt = self.position
            raise RecomputationError(
                message(
                    "plan",
                    "the model ran fewer ops than the traced step",
                    f"ran {nxt} of {len(self.ops)}; op #{nxt} would be {self.ops[nxt]} in "
                    f"{self.modules[nxt]}",
                    "plan again with inputs that take this path",
                )
            )
        if self.bare is not None:
            self.bare.checked()

    def _running_module(self) -> str:
        """The innermost module of this model whose forward is on the Python stack (only looked
        up for an error: module hooks on every call would cost every forward)."""
        names = {m: name or self.top for name, m in self.model.named_modules()}
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and owner in names:
                return names[owner]
            frame = frame.f_back
        return self.top

    def _diverged(self, position: int, func: Any) -> RematError:
        if (error := hooks_of_another(self.region)) is not None:  # their ops, not the model's
            self.stop()
            self.active = False
            return error
        self.stop()
        self.active = False
        where = self._running_module()
        if position >= len(self.ops):
            given = f"op #{position} {func} in {where}, after the {len(self.ops)} traced ops"
            rule = "the model ran more ops than the traced step"
        else:
            given = (
                f"op #{position}: expected {self.ops[position]} in {self.modules[position]}, "
                f"got {func} in {where}"
            )
            rule = "the model's forward diverged from the traced step"
        return RecomputationError(
            message(
                "plan",
                rule,
                given,
                "plan again with inputs that take this path (control flow, shapes, train or eval mode), "
                "and with the modules as they run (a checkpoint wrapped around one after planning)",
            )
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        info = aten.facts(func)
        if info.skipped or not self.active or torch._C._current_autograd_node() is not None:
            return func(*args, **kwargs)
        name = info.name
        if name in UNCOUNTED:
            return self.tape.record(func, args, kwargs) if self.tape is not None else func(*args, **kwargs)
        i = self.position
        self.position += 1
        if i >= len(self.ops) or self.ops[i] != name:
            raise self._diverged(i, func)
        if self.open is None and i in self.starts:
            self._start(self.starts[i])
        if self.tape is None:
            return self._checked(i, func, info, func(*args, **kwargs))
        assert self.open is not None
        self.tape.policy = _KEEP if i in self.open.save else _RECOMPUTE
        out = self.tape.record(func, args, kwargs)
        if i == self.open.last:
            # NOTE [region end] stop before autograd saves this op's outputs, and before the
            # next op's autograd saves its inputs (that happens before the op reaches this
            # mode): what only later ops save is theirs to keep, as the plan predicts
            self.stop()
        return self._checked(i, func, info, out)

    def _checked(self, i: int, func: Any, info: aten.OpFacts, out: Any) -> Any:
        """``out``, where op ``i``'s first result has the dtype and shape the plan was made for
        (the memory it predicts is theirs): another batch size, width or dtype is refused."""
        want = self.shapes[i] if self.shapes else ""
        if not want:
            return out
        single = type(out) is torch.Tensor and info.written_returns == (False,)  # most ops
        if single and expected(self.shapes)[i] == (out.dtype, out.shape):  # no string made
            return out
        got = made(out, info)
        if got is None or got == want:
            return out
        self.stop()
        self.active = False
        raise RecomputationError(
            message(
                "plan",
                "each op makes the dtype and shape of the traced step (the plan's memory is theirs)",
                f"op #{i} {func} in {self._running_module()} made {got}, planned {want}",
                "plan again for this batch size, model and dtype (where a size depends on the data, "
                "as nonzero's does, for data like this)",
            )
        )


@contextlib.contextmanager
def apply(
    regions: Sequence[Region],
    ops: Sequence[str],
    modules: Sequence[str],
    model: nn.Module,
    replay: ReplayMode = "eager",
    make_runner: Callable[..., _Runner] = _Runner,
    shapes: Sequence[str] = (),
    check: Check = "first",
) -> Iterator[None]:
    """See ``Plan.apply``: run ``model``'s forward with ``regions`` recomputed, checking that it runs
    ``ops`` (issued by ``modules``, one per op) in order; ``make_runner`` makes the dispatch mode
    (``remat.planner.offload_execute`` passes one that also notes what the plan offloads).
    ``check="first"``: where every region is one call of one module (``Region.anchor``), the first
    forward in each setting is checked and the later ones run bare outside the taped regions (NOTE
    [bare forward] in ``remat.planner.module_calls``); ``"every"``: every forward is checked."""
    execute = executor("plan.apply", replay)
    if check not in ("first", "every"):
        rule = "check is 'first' or 'every'"
        raise RematValueError(
            message("plan.apply", rule, f"got {check!r}", "pass check='every' or leave it out")
        )
    if not isinstance(model, nn.Module):
        given = f"got {type(model).__name__}"
        raise RematTypeError(
            message("plan.apply", "apply takes the model to run", given, "pass an nn.Module")
        )
    if checkpointed(model):  # its hooks come inside the forward, after the plan's start
        raise hooks_refused("remat.checkpoint (the model's forward is one)")
    refuse_second(model)
    runner = make_runner(regions, ops, modules, model, execute)
    runner.shapes = shapes
    again = [(region, submodule(model, region.rerun)) for region in regions if region.rerun]
    taped = anchored(model, regions) if check == "first" and make_runner is _Runner else None
    if taped is not None:
        plan = (tuple(ops), tuple(shapes), tuple(regions))  # compared whole: no two plans share it
        runner.bare = Bare(model, plan, [region.rerun or region.anchor for region in regions])
    hooks = [model.register_forward_pre_hook(Applied(runner.begin), with_kwargs=True)]  # a copy's are inert
    end = Applied(runner.end)
    hooks.append(model.register_forward_hook(end, with_kwargs=True, always_call=True))  # where it raised too
    hooks += [child.register_forward_pre_hook(Applied(_guard(runner, child))) for child in model.children()]
    wrapped = []
    try:
        wrapped += [wrap(runner, region, module, UNCOUNTED) for region, module in again]
        wrapped += [anchor(runner, region, module) for region, module in taped or ()]
        yield
    finally:
        runner.leave()
        if runner.bare is not None:
            runner.bare.running = False
        for h in hooks:
            h.remove()
        for module, before in reversed(wrapped):
            if before is None:
                del module.forward
            else:
                module.forward = before


def _guard(runner: _Runner, child: nn.Module) -> Callable[..., None]:
    """``child``'s pre-hook for ``_Runner.bypassed`` (wrapped in ``Applied``: a copy of the model
    gets an inert one)."""

    def hook(module: nn.Module, args: Any) -> None:
        if module is child:
            runner.bypassed(child)

    return hook
