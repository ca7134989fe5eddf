"""A plan's module regions reached through their module's ``forward``, and the forward run bare.

Each region the plan runs as its module called again (NOTE [module re-run] in
``remat.planner.rerun_regions``) has its module's ``forward`` wrapped while the plan runs
(``wrap``): at the call the plan expects, the call runs under ``remat.planner.rerun``'s hooks.

NOTE [bare forward] The executor's dispatch mode counts and checks every forward op, at a Python
call per op (``ExecutorCost.check``), which ``torch.utils.checkpoint`` around the same modules does
not pay; outside the regions it decides nothing. Where every region of a plan is anchored, that is
runs as its module called again or is taped and is exactly the ops of one call of one module
(``Region.anchor``: a layer, an MLP, an attention), the plan checks the first forward in each
setting op by op, as every plan does, and runs the later forwards of that setting bare: no dispatch
mode outside the regions; each region is reached through its module's call (``wrap``; ``anchor``
pushes the mode for the call, counting from the region's first op, and the region steps it aside at
its end; or, once a recorded call of it in the setting left a template, runs the call with no mode
at all: NOTE [taped call run bare] in ``remat.planner.taped_calls``). A plan with no region runs
bare too. The setting (``forward_key``) is what the path of a forward depends on that the executor
sees cheaply: the plan; each module's train or eval mode and dropout rate, the autocast state and
the attention kernels allowed (``remat.planner.rerun.setting``); each parameter's and buffer's
dtype, device, shape and whether it requires grad; and the forward's arguments (``call_key``):
their structure, each tensor's type, dtype, device, shape, strides and whether it requires grad,
each plain value (a number, a string, None, a dtype, an enum: ``CALL_VALUES``) as it is. A forward given
any other object (a cache, a dataclass batch: what it holds is not seen) is checked every time, and
so is every forward of a block where a region's module ran ops before its ``forward`` (a forward
pre-hook), or of a plan whose anchor the model does not have (``anchored``). A bare forward checks
that each region's module is called once (a second call, or none, is a forward that diverged from
the traced step, refused as the check refuses it) and each taped region's ops (recorded), or what
autograd saves in its call (from a template).

What a bare forward does not see, as ``torch.utils.checkpoint`` does not: a path that changes,
outside the taped regions, with the data alone (a branch on a tensor's values, a size that depends
on them) or with Python state outside the arguments and modules (a flag in a config object). Such a
change moves what the step holds, not its gradients: outside the regions autograd runs as it does
without a plan, and a module run again checks each tensor it makes again against the one the
forward saved. ``Plan.apply(model, check="every")`` checks every forward.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from remat._dispatch import saved_hooks
from remat._errors import RecomputationError, RematTypeError, message
from remat._leaves import flat, leaves
from remat._modules import below, buffers, parameters
from remat.planner.plain_values import plain_values
from remat.planner.regions import Region
from remat.planner.rerun import CallCheck, run_again, setting
from remat.planner.results import made
from remat.planner.taped_calls import Learner, Run, Template, learn
from remat.trace.recorder import CALL_VALUES


class Runner(Protocol):
    """What this module uses of the executor's dispatch mode (``remat.planner.execute``)."""

    ops: Sequence[str]
    shapes: Sequence[str]
    position: int
    active: bool
    open: Region | None
    bare: Bare | None
    note: Callable[..., None] | None
    learned: Any

    def stop(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, kind: Any, value: Any, trace: Any, /) -> Any: ...


__all__ = ["Bare", "Runner", "anchor", "anchored", "call_key", "forward_key", "submodule", "wrap"]

# module regions whose call was checked op by op, per module: (first op, ops, setting)
_CHECKED: weakref.WeakKeyDictionary[nn.Module, set[tuple[object, ...]]] = weakref.WeakKeyDictionary()

# NOTE [bare forward] the settings whose forward was checked, per model (across apply blocks: a
# training loop opens one per step)
_SEEN: weakref.WeakKeyDictionary[nn.Module, set[Hashable]] = weakref.WeakKeyDictionary()

# NOTE [taped call run bare] per model: (setting, region, plain values, the call's arguments) ->
# template (None: recorded)
_TEMPLATES: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, Template | None]]
_TEMPLATES = weakref.WeakKeyDictionary()


def forward_key(model: nn.Module, plan: Hashable, args: Any, kwargs: Any) -> Hashable | None:
    """The setting of one forward of ``model`` under ``plan`` (NOTE [bare forward]); None where an
    argument is an object whose contents it cannot see."""
    given = call_key(args, kwargs)
    if given is None:
        return None
    modules = below(model)
    held: list[Hashable] = [(t.dtype, t.device, t.shape, t.requires_grad) for t in parameters(model, modules)]
    held += [(t.dtype, t.device, t.shape) for t in buffers(model, modules)]
    return (plan, setting(model), tuple(held), given)


def call_key(args: Any, kwargs: Any) -> Hashable | None:
    """A call's arguments as the setting sees them (NOTE [bare forward]): their structure, each
    tensor's type, dtype, device, shape, strides, whether it requires grad and where it was given
    first (a template binds a tensor given twice to one place), each plain value as it is; None
    where one is an object whose contents it cannot see."""
    found = flat(args, kwargs)  # its structure then the count of arguments and the keywords' names
    items, structure = tree_flatten((args, kwargs)) if found is None else (found, (len(args), tuple(kwargs)))
    given: list[Hashable] = []
    first: dict[int, int] = {}  # one tensor given in two places (``pair(h, h)``) is part of the key
    for i, x in enumerate(items):
        if isinstance(x, torch.Tensor):
            where = first.setdefault(id(x), i)
            given.append((type(x), x.dtype, x.device, x.shape, x.stride(), x.requires_grad, where))
        elif isinstance(x, CALL_VALUES):
            given.append((type(x), x))
        else:
            return None
    return (structure, tuple(given))


class Bare:
    """One apply block's bare forwards (NOTE [bare forward]): which settings were checked, and
    which region modules the running forward has called."""

    def __init__(self, model: nn.Module, plan: Hashable, names: Sequence[str]) -> None:
        self.model, self.plan, self.names = model, plan, tuple(names)
        self.key: Hashable | None = None  # the setting of the forward running checked
        self.unanchored = False  # a region's ops did not start at its module's call (``anchor``)
        self.running = False
        self.called: set[str] = set()
        # NOTE [taped call run bare]: the templates this forward's recorded calls left
        self.pending: dict[Hashable, Template | None] = {}

    def start(self, args: Any, kwargs: Any) -> bool:
        """At a forward's start: True where it runs bare (its setting was checked); otherwise it
        runs checked, and ``checked`` notes its setting once it ran the traced ops."""
        self.key = forward_key(self.model, self.plan, args, kwargs)
        self.running = self.key is not None and self.key in _SEEN.get(self.model, ())
        self.called.clear()
        self.pending.clear()
        return self.running

    def checked(self) -> None:
        """At the end of a checked forward that ran the traced ops: its setting runs bare from now."""
        if self.key is not None and not self.unanchored:
            _SEEN.setdefault(self.model, set()).add(self.key)
            _keep(self.model, self.pending)
        self.key = None

    def template(self, region: Region, module: nn.Module, args: Any, kwargs: Any) -> Template | None | bool:
        """The template a recorded call of ``region``'s module left in this setting (the forward's,
        the module's plain values and the call's arguments); None where its calls are recorded;
        False where none was recorded yet (NOTE [taped call run bare])."""
        given = call_key(args, kwargs)
        if given is None:
            return None
        key = (self.key, region.first, plain_values(module), given)
        return _TEMPLATES.get(self.model, {}).get(key, False)

    def learned(
        self, region: Region, module: nn.Module, args: Any, kwargs: Any, template: Template | None
    ) -> None:
        """A recorded call of ``region``'s module left ``template``: kept once the forward ends well."""
        given = call_key(args, kwargs)
        if given is not None:
            self.pending[self.key, region.first, plain_values(module), given] = template

    def call(self, region: Region) -> None:
        """A region's module called in the bare forward."""
        name = region.rerun or region.anchor
        if name in self.called:
            raise _diverged(f"{name} called again in one forward; the traced step calls it once")
        self.called.add(name)

    def finish(self, raised: bool) -> None:
        """At a bare forward's end (``raised``: by an exception): every region's module was called."""
        self.running = False
        missing = [n for n in self.names if n not in self.called]
        if missing and not raised:
            raise _diverged(f"{missing[0]} not called; the traced step calls it once")
        if not raised:
            _keep(self.model, self.pending)


_MOST_TEMPLATES = 4096  # per model: settings that change every step (a length) leave one each


def _keep(model: nn.Module, templates: dict[Hashable, Template | None]) -> None:
    """Keep the templates a forward's recorded calls left (NOTE [taped call run bare]), the oldest
    going first past ``_MOST_TEMPLATES``."""
    kept = _TEMPLATES.setdefault(model, {})
    kept.update(templates)
    while len(kept) > _MOST_TEMPLATES:
        del kept[next(iter(kept))]


def _diverged(what: str) -> RecomputationError:
    return RecomputationError(
        message(
            "plan",
            "the model's forward diverged from the traced step",
            f"a forward run bare: {what}",
            "plan again with inputs that take this path (control flow, shapes, train or eval mode)",
        )
    )


def submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise RematTypeError(
            message(
                "plan",
                "a module the plan runs again is not in the model",
                f"{name!r} in {type(model).__name__}",
                "apply the plan to the model it was made for",
            )
        ) from None


def wrap(runner: Runner, region: Region, module: nn.Module, skip: frozenset[str]) -> tuple[nn.Module, Any]:
    """Wrap ``module.forward`` to run ``region`` as the module called again (``remat.planner.rerun``)
    at the call the plan expects, or at its call in a bare forward; the forward it had as an
    attribute of its own (or None) goes back when the plan's block ends. ``skip``: op names the
    check does not count."""
    before = module.__dict__.get("forward")
    forward = module.forward
    expected_ops = list(runner.ops[region.first : region.last + 1])
    shapes = list(runner.shapes[region.first : region.last + 1]) if runner.shapes else []
    ops = hash((tuple(expected_ops), tuple(shapes)))  # the region's ops, in a key of the checked calls

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self is not module:  # a copy made while the plan runs (``copy.deepcopy``) is not the plan's
            return type(self).forward(self, *args, **kwargs)
        bare = runner.bare
        if bare is not None and bare.running:
            bare.call(region)
            return (
                run_again(module, forward, args, kwargs)
                if torch.is_grad_enabled()
                else forward(*args, **kwargs)
            )
        if runner.active and region.first < runner.position <= region.last:
            raise RecomputationError(
                message(
                    "plan",
                    "a module the plan runs again ran ops of its call before its forward",
                    f"{region.rerun} called at op #{runner.position}, its region starts at op "
                    f"#{region.first} (a forward pre-hook?)",
                    "plan without rerun_modules, or move the hook's work out of the module",
                )
            )
        if not (
            runner.active
            and runner.position == region.first
            and runner.open is None
            and torch.is_grad_enabled()
            and _get_current_dispatch_mode() is runner
        ):
            return forward(*args, **kwargs)
        runner.__exit__(None, None, None)
        try:
            # NOTE [a call run bare is checked once] per module, region and setting
            key = (region.first, ops, setting(module))
            seen = _CHECKED.setdefault(module, set())
            check = None
            if key not in seen:
                check = CallCheck(expected_ops, shapes, made, skip, region.rerun, region.first)
            out = run_again(module, forward, args, kwargs, check)
            seen.add(key)
        except BaseException:
            runner.stop()  # the forward is abandoned: the next one starts from its first op
            runner.active = False
            raise
        finally:
            runner.__enter__()
        runner.position = region.last + 1
        return out

    return _wrapped(module, call), before


def anchored(model: nn.Module, regions: Sequence[Region]) -> list[tuple[Region, nn.Module]] | None:
    """Each taped region and the module whose call it is, where every region of the plan is one
    module's call found in ``model`` (NOTE [bare forward]); None otherwise: every forward is
    checked, and a taped region is found by its ops' count alone, as ever."""
    found = []
    for region in regions:
        if region.rerun:
            continue
        if not region.anchor:
            return None
        try:
            found.append((region, model.get_submodule(region.anchor)))
        except AttributeError:
            return None
    return found


def _wrapped(module: nn.Module, call: Callable[..., Any]) -> nn.Module:
    """Set ``call`` as ``module``'s forward. A deep copy of the module binds it to the copy, which
    it runs plainly; a pickle (``torch.save`` of the model) names it ``forward``, which a loaded
    copy finds on its class: the copies of a model under a plan run plainly."""
    call.__name__ = call.__qualname__ = "forward"
    module.forward = types.MethodType(call, module)
    return module


def anchor(runner: Runner, region: Region, module: nn.Module) -> tuple[nn.Module, Any]:
    """Wrap ``module.forward``, whose one call is exactly the taped ``region``'s ops: in a bare
    forward the call runs from its template where a recorded call in this setting left one (NOTE
    [taped call run bare] in ``remat.planner.taped_calls``), else under the executor's mode, counted
    from the region's first op, which records the region and checks its ops, and steps aside at its
    end (NOTE [bare forward]); in a checked forward the call runs as it is, and a call whose ops did
    not start the region (a forward pre-hook that runs ops) keeps every forward of the block
    checked. A recorded call leaves its template. The forward it had as an attribute of its own (or
    None) goes back when the plan's block ends."""
    before = module.__dict__.get("forward")
    forward = module.forward

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self is not module:  # a copy made while the plan runs (``copy.deepcopy``) is not the plan's
            return type(self).forward(self, *args, **kwargs)
        bare = runner.bare
        if bare is None or not bare.running:
            if bare is not None and runner.active and runner.position != region.first:
                bare.unanchored = True
            if bare is None or bare.key is None or not runner.active or runner.position != region.first:
                return forward(*args, **kwargs)
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            return _learning(runner, bare, region, module, forward, args, kwargs)
        bare.call(region)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        template = bare.template(region, module, args, kwargs)
        if isinstance(template, Template):
            run = Run(template, module, leaves(args, kwargs), region.anchor)
            with saved_hooks(run.pack, run.unpack):
                out = forward(*args, **kwargs)
            run.end()
            return out
        runner.position, runner.active = region.first, True
        runner.__enter__()
        try:
            if template is None:
                out = forward(*args, **kwargs)
            else:
                out = _learning(runner, bare, region, module, forward, args, kwargs)
        except BaseException:
            runner.stop()
            raise
        finally:
            runner.active = False
            runner.__exit__(None, None, None)
        if runner.position != region.last + 1:
            runner.stop()
            ran, traced = runner.position - region.first, region.last + 1 - region.first
            raise _diverged(f"{region.anchor} ran {ran} of its {traced} traced ops")
        return out

    return _wrapped(module, call), before


def _learning(
    runner: Runner, bare: Bare, region: Region, module: nn.Module, forward: Any, args: Any, kwargs: Any
) -> Any:
    """Run a recorded call of ``region``'s module, and note the template it leaves (NOTE [taped
    call run bare]): kept once the forward ran the traced ops."""
    learner = Learner(lambda: runner.learned is not None)
    runner.note, runner.learned = learner.note, None
    try:
        with saved_hooks(learner.pack, learner.unpack):
            out = forward(*args, **kwargs)
        learned = runner.learned
    finally:
        runner.note = runner.learned = None
    exact = runner.position == region.last + 1 and runner.open is None
    template = learn(learner, learned, module, leaves(args, kwargs), exact)
    bare.learned(region, module, args, kwargs, template)
    return out
