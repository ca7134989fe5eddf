"""A taped region that is one module's call, run bare from what a recorded call of it learned.

NOTE [taped call run bare] A bare forward (NOTE [bare forward] in ``remat.planner.module_calls``)
still records each taped region's ops through the executor's dispatch mode: a Python call per op,
which ``torch.utils.checkpoint`` around the same module does not pay. What a recording makes is the
same in every call of a setting but for the tensors: the ops and their arguments over value ids,
the slice that recomputes what autograd saved, and the order in which autograd saves tensors and
what the region gives it for each (the tensor itself, or a handle the slice recomputes). So a
recorded call of the region's module (``learn``) leaves a ``Template``: for each tensor autograd
saves in the call, in order, its shape, dtype and autograd node, and the handle given for it; and
for each tensor the slice reads from the forward, where a later call finds it (an argument of the
call, a parameter or buffer of the module, a tensor autograd saves in it, or the storage of one: a
linear's output that the next op saves reshaped). A later call in the
same setting runs the module's ``forward`` with no dispatch mode, under saved-tensor hooks only
(``Run``), as ``torch.utils.checkpoint`` does: each save gets what the recorded call gave, and the
slice, the same one, replays over this call's tensors. The memory is the recorded call's.

A call runs from its template only where the template is the call: each tensor autograd saves must
have the shape, dtype and autograd node the recorded call's had, and as many saves (else the
forward diverged: refused). The setting includes, besides the bare forward's, every plain value
(a number, a string, a flag) held by the region's modules or by a plain object one holds (a config),
or named as a global by their ``forward`` (``plain_values``), and the call's own arguments as the
forward's are seen (``call_key`` in ``remat.planner.module_calls``; a call given an object is
recorded every time). A region is recorded in every call, as before, where its replay would not
be the same one in a later call: it replays a random op that draws (the tape keeps the
generator's state for each; attention without dropout draws nothing: NOTE [no dropout draws
nothing] in ``remat.aten.schema``), it reads a tensor no later call gives it (a snapshot of an
input written in place, a tensor the region's code finds elsewhere), an op gave Python a value
(``item``, ``equal``: what the code did next may depend on the data), or it offloads.

What a call run from its template does not see, where the recorded call did: an op in the region
that changed with Python state ``plain_values`` does not reach (a global a helper function reads,
a number two objects deep) while every tensor autograd saves looks the same: its replay would
recompute with the recorded ops, and the gradients would be wrong without an error.
``Plan.apply(model, check="every")`` records every call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat import aten
from remat._errors import RecomputationError, message
from remat.host.parcel import Parcel
from remat.manual.scope import Handle, Kept, TapedRegion
from remat.manual.tape import Slice
from remat.trace.recorder import CALL_VALUES

__all__ = ["Learner", "Run", "Template", "learn", "plain_values"]


@dataclass(frozen=True)
class Pack:
    """The k-th tensor autograd saved in the recorded call: what it looked like (its shape, dtype,
    the type of its autograd node, whether its own op saved it after running) and what the region
    gave for it: ``handle`` (recomputed), or the tensor itself, then ``binds`` the value id of the
    slice's kept tensor it is, or (``place``) that sits in its storage (-1: none)."""

    shape: torch.Size
    dtype: torch.dtype
    node: type | None
    own: bool
    handle: Handle | None
    binds: int
    # the kept tensor shares the saved one's storage, at this (shape, strides, offset) in it: a
    # linear's output that the next op saves reshaped
    place: tuple[torch.Size, tuple[int, ...], int] | None = None


@dataclass(frozen=True)
class Source:
    """Where a call finds a tensor the slice reads from the forward (value id ``vid``): the call's
    ``arg``-th tensor leaf of its arguments, or the module's parameter or buffer ``attr``, or (both
    unset) a tensor autograd saves in the call (``Pack.binds``)."""

    vid: int
    arg: int = -1
    attr: str = ""


@dataclass(frozen=True)
class Template:
    """What a call of a taped region's module needs to run without recording (NOTE [taped call
    run bare]): its packs in order, the region's replay (``shape``: handles and writes, its plan
    cleared) and slice (its kept tensors cleared), and where each kept tensor comes from."""

    packs: tuple[Pack, ...]
    shape: TapedRegion
    plan: Slice | None
    sources: tuple[Source, ...]


def plain_values(module: nn.Module) -> tuple[Hashable, ...]:
    """The plain values (``CALL_VALUES`` but tensors) the region's code may branch on or compute
    with, beside the forward's setting: each of its modules' own, those of a plain object a module
    holds (a config, read once however many modules hold it), and the globals its modules'
    ``forward`` names."""
    values: list[Hashable] = []
    read: set[int] = set()
    for m in module.modules():
        for name, v in vars(m).items():
            if _plain(v):
                values.append((name, v))
            elif (
                id(v) not in read
                and type(v) not in _NOT_OBJECTS
                and isinstance(getattr(v, "__dict__", None), dict)
            ):
                read.add(id(v))
                if not isinstance(v, (nn.Module, torch.Tensor)):
                    values += [(name, key, w) for key, w in vars(v).items() if _plain(w)]
        forward = type(m).forward
        code, names = getattr(forward, "__code__", None), getattr(forward, "__globals__", {})
        if code is not None:
            values += [(name, names[name]) for name in code.co_names if name in names and _plain(names[name])]
    return tuple(values)


_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device})
_NOT_OBJECTS = frozenset({dict, list, tuple, set, type(None)})  # containers: not read


def _plain(v: object) -> bool:
    kind = type(v)
    return kind in _PLAIN or (
        kind not in _NOT_OBJECTS and isinstance(v, CALL_VALUES) and not isinstance(v, torch.Tensor)
    )


class Learner:
    """The saved-tensor hooks around a recorded call of the region's module: what autograd saves
    outside the region's own hooks (the first op's inputs, saved before the op reaches the
    executor, and the last op's outputs, saved after the region ended) is kept as a plain save
    would keep it. Each save, there and in the region (``TapedRegion.note``), is noted in order:
    what it looked like, and the tensor where the region keeps it (not where it recomputes it: the
    memory is the plan's)."""

    steps_aside = True  # ``hooks_of_another``: the executor's own

    def __init__(self) -> None:
        self.packs: list[Pack] = []
        self.kept: list[tuple[torch.Tensor, int] | None] = []  # per pack, the tensor kept
        self.unpack = TapedRegion(None).unpack
        self.moved = False

    def pack(self, t: torch.Tensor) -> Kept:
        kept = Kept(aten.detached(t) if aten.made_last(t) else t, t._version)
        self.note(t, kept)
        return kept

    def note(self, t: torch.Tensor, packed: Kept | Handle | Parcel) -> None:
        self.moved |= isinstance(packed, Parcel)
        handle = packed if isinstance(packed, Handle) else None
        node = type(t.grad_fn) if t.grad_fn is not None else None
        self.packs.append(Pack(t.shape, t.dtype, node, aten.made_last(t), handle, -1))
        self.kept.append((t, t._version) if isinstance(packed, Kept) else None)


def learn(
    learner: Learner, region: TapedRegion | None, module: nn.Module, leaves: Sequence[Any], exact: bool
) -> Template | None:
    """The template of the call ``learner`` watched, whose region (finished) is ``region``;
    ``leaves``: the call's arguments, flattened; ``exact``: the call ran the region's ops, no more
    and no fewer. None where a later call could not run from it (NOTE [taped call run bare]). Drops
    what the two held of the call's tensors."""
    kept, learner.kept = learner.kept, []
    if region is None:
        return None
    found, region.log_kept, region.note = region.log_kept, {}, None
    if not exact or region.reads_values or learner.moved:
        return None
    plan = region.plan
    if plan is not None and (plan.moved or plan.rng_sources):
        return None
    held = {id(t): name for name, t in (*module.named_parameters(), *module.named_buffers())}
    args = {id(x): i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
    sources: list[Source] = []
    binds: dict[int, tuple[int, Any]] = {}  # pack -> value id, and where in its storage
    for vid, (t, version) in found.items():
        if version >= 0 and t._version != version:  # written since: no later call gives it
            return None
        if id(t) in args and leaves[args[id(t)]] is t:
            sources.append(Source(vid, arg=args[id(t)]))
        elif id(t) in held:
            sources.append(Source(vid, attr=held[id(t)]))
        else:
            found_at = _saved(kept, t, version)
            if found_at is None:
                return None
            binds[found_at[0]] = (vid, found_at[1])
            sources.append(Source(vid))
    packs = tuple(
        dataclasses.replace(p, binds=binds[k][0], place=binds[k][1]) if k in binds else p
        for k, p in enumerate(learner.packs)
    )
    if plan is not None:
        plan = dataclasses.replace(plan, kept={})
    return Template(packs, region.replica(None), plan, tuple(sources))


def _saved(
    kept: Sequence[tuple[torch.Tensor, int] | None], t: torch.Tensor, version: int
) -> tuple[int, tuple[torch.Size, tuple[int, ...], int] | None] | None:
    """The pack that saved ``t`` at ``version`` itself (place None), or else a tensor sharing its
    storage (a linear's output reshaped, which the next op saves), with where ``t`` sits in it; None
    where none did."""
    for k, s in enumerate(kept):
        if s is not None and s[0] is t and s[1] == version:
            return k, None
    if not t.untyped_storage().nbytes():
        return None
    storage = t.untyped_storage().data_ptr()
    for k, s in enumerate(kept):
        if s is not None and s[0].dtype == t.dtype and s[0].untyped_storage().data_ptr() == storage:
            return k, (t.shape, t.stride(), int(t.storage_offset()))
    return None


class Run:
    """One call of the region's module run from ``template`` (NOTE [taped call run bare]): its
    saved-tensor hooks, and the region that replays for its backward."""

    steps_aside = True  # ``hooks_of_another``: the executor's own

    def __init__(self, template: Template, module: nn.Module, leaves: Sequence[Any], name: str) -> None:
        self.template, self.name = template, name
        self.region = template.shape.replica(None)
        self.unpack = self.region.unpack
        self.k = 0
        self.bound: dict[int, tuple[torch.Tensor, int]] = {}
        for source in template.sources:
            if source.arg >= 0:
                self._bind(source.vid, leaves[source.arg])
            elif source.attr:
                held = functools.reduce(getattr, source.attr.split("."), module)
                assert isinstance(held, torch.Tensor), "a parameter or buffer by its name"
                self._bind(source.vid, held)

    def _bind(self, vid: int, t: torch.Tensor, place: Any = None) -> None:
        kept = aten.detached(t)
        if place is not None:
            kept = kept.as_strided(*place)  # a view of the same storage: no memory
        self.bound[vid] = (kept, -1 if t.is_inference() else t._version)

    def pack(self, t: torch.Tensor) -> Kept | Handle:
        k = self.k
        self.k += 1
        packs = self.template.packs
        if k >= len(packs):
            raise self._diverged(f"autograd saved more than the {len(packs)} tensors it saved")
        want = packs[k]
        node = type(t.grad_fn) if t.grad_fn is not None else None
        if t.shape != want.shape or t.dtype != want.dtype or node is not want.node:
            got = f"{aten.describe(t.dtype, t.shape)} of {getattr(node, '__name__', None)}"
            wanted = f"{aten.describe(want.dtype, want.shape)} of {getattr(want.node, '__name__', None)}"
            raise self._diverged(f"saved tensor #{k} is {got}, recorded {wanted}")
        if want.handle is not None:
            return want.handle
        own = aten.made_last(t)
        if own is not want.own:
            raise self._diverged(f"saved tensor #{k} saved {'after' if own else 'before'} its op ran")
        if want.binds >= 0:
            self._bind(want.binds, t, want.place)
        return Kept(aten.detached(t) if own else t, t._version)

    def end(self) -> None:
        """After the call: every save came, and the region replays over this call's tensors."""
        packs = self.template.packs
        if self.k != len(packs):
            raise self._diverged(f"autograd saved {self.k} tensors, {len(packs)} when recorded")
        plan = self.template.plan
        if plan is None:
            return
        self.region.plan = dataclasses.replace(plan, kept=self.bound)

    def _diverged(self, what: str) -> RecomputationError:
        return RecomputationError(
            message(
                "plan",
                "the model's forward diverged from the traced step",
                f"{self.name}'s call run bare: {what}",
                "plan again with inputs that take this path, or apply the plan with check='every'",
            )
        )
