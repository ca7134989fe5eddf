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
or named as a global by their ``forward`` (``remat.planner.plain_values``), and the call's own
arguments as the forward's are seen (``call_key`` in ``remat.planner.module_calls``; a call given
an object is recorded every time). The generator state a random op of the replay draws from
(dropout in training) is taken in the saved-tensor hook just before it (NOTE [random ops of a
template]). A region is recorded in every call, as before, where its replay would not be the same
one in a later call: a random op of it has no save before it to take its state in, or draws from a
generator the code hands it; it reads a tensor no later call gives it (a snapshot of an input
written in place, a tensor the region's code finds elsewhere); an op gave Python a value
(``item``, ``equal``: what the code did next may depend on the data); or it offloads.

What a call run from its template does not see, where the recorded call did: an op in the region
that changed with Python state ``remat.planner.plain_values`` does not reach (a global a helper
function reads, a number two objects deep) while every tensor autograd saves looks the same: its
replay would recompute with the recorded ops. Each tensor the replay recomputes is checked
against a sample of the values the call saved (NOTE [a template's replay checked]), so such a
change is refused in backward unless it left every sampled element as it was (on an accelerator,
when the backward pass ends). ``Plan.apply(model, check="every")`` records every call.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat import aten
from remat._errors import RecomputationError, message
from remat.host.parcel import Parcel
from remat.manual.handles import Handle, Kept
from remat.manual.replay import eager_steps
from remat.manual.scope import TapedRegion
from remat.manual.tape import Slice, Step
from remat.planner import samples

__all__ = ["Learner", "Run", "Template", "learn"]


@dataclass(frozen=True)
class Pack:
    """The k-th tensor autograd saved in the recorded call: what it looked like (its shape, dtype,
    the type of its autograd node, whether its own op saved it after running), when (``at``) and
    what the region gave for it: ``handle`` (recomputed), or the tensor itself, then ``binds`` the
    value id of the slice's kept tensor it is, or (``place``) that sits in its storage (-1: none)."""

    shape: torch.Size
    dtype: torch.dtype
    node: str | None  # ``node_of`` the saved tensor
    own: bool
    handle: Handle | None
    binds: int
    # the kept tensor shares the saved one's storage, at this (shape, strides, offset) in it: a
    # linear's output that the next op saves reshaped
    place: tuple[torch.Size, tuple[int, ...], int] | None = None
    at: int = 0  # how many of the region's ops had run when autograd saved it (after it: ``AFTER``)


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
    cleared) and slice (its kept tensors and generator states cleared), where each kept tensor
    comes from, and where each generator state its random ops replay from is taken."""

    packs: tuple[Pack, ...]
    shape: TapedRegion
    plan: Slice | None
    sources: tuple[Source, ...]
    # per step of the slice that draws random numbers: the pack in whose hook a call takes the
    # state of the generators it draws from (-1: before the call), the step, and those generators
    draws: tuple[tuple[int, int, tuple[torch.device, ...]], ...] = ()


class Learner:
    """The saved-tensor hooks around a recorded call of the region's module: what autograd saves
    outside the region's own hooks (the first op's inputs, saved before the op reaches the
    executor, and the last op's outputs, saved after the region ended) is kept as a plain save
    would keep it. Each save, there and in the region (``TapedRegion.note``), is noted in order:
    what it looked like, and the tensor where the region keeps it (not where it recomputes it: the
    memory is the plan's)."""

    steps_aside = True  # ``hooks_of_another``: the executor's own

    def __init__(self, ended: Callable[[], bool]) -> None:
        self.packs: list[Pack] = []
        self.kept: list[tuple[torch.Tensor, int] | None] = []  # per pack, the tensor kept
        region = TapedRegion(None)
        region.api = "plan"  # in errors
        self.unpack = region.unpack
        self.moved = False
        self.ended = ended  # whether the region has ended (else it has not begun)

    def pack(self, t: torch.Tensor) -> Kept:
        kept = Kept(aten.detached(t) if aten.made_last(t) else t, t._version)
        self.note(t, kept, AFTER if self.ended() else 0)
        return kept

    def note(self, t: torch.Tensor, packed: Kept | Handle | Parcel, at: int) -> None:
        self.moved |= isinstance(packed, Parcel)
        # a copy: the one autograd holds may die with its node (NOTE [dead handles])
        handle = dataclasses.replace(packed) if isinstance(packed, Handle) else None
        self.packs.append(Pack(t.shape, t.dtype, node_of(t), aten.made_last(t), handle, -1, at=at))
        self.kept.append((t, t._version) if isinstance(packed, Kept) else None)


AFTER = sys.maxsize  # ``Pack.at`` of a tensor saved after the region's last op

# NOTE [a reshape's node] ``reshape`` of a tensor it can view is ``_reshape_alias`` in eager torch
# and ``view`` under any dispatch mode (torch's ``isTensorSubclassLike`` counts an active mode): a
# call recorded under the tape's mode saves a tensor of ``ViewBackward0`` where the same code run
# bare saves one of ``ReshapeAliasBackward0``, the same view of the same storage (``matmul`` of a
# transposed key in attention: Mistral, Qwen2, GPT-NeoX). The two count as one node.
_SAME_NODE = {"ReshapeAliasBackward0": "ViewBackward0"}


def node_of(t: torch.Tensor) -> str | None:
    """The name of ``t``'s autograd node (None: a leaf or no history), a reshape's as a view's
    (NOTE [a reshape's node])."""
    if t.grad_fn is None:
        return None
    name = type(t.grad_fn).__name__
    return _SAME_NODE.get(name, name)


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
    drawn, region.drawn = region.drawn, ()
    if not exact or region.reads_values or learner.moved:
        return None
    plan = region.plan
    draws: tuple[tuple[int, int, tuple[torch.device, ...]], ...] = ()
    if plan is not None and plan.moved:
        return None
    if plan is not None and plan.rng_sources:
        anchored = _anchors(learner.packs, drawn, plan)
        if anchored is None:
            return None
        draws, plan = anchored
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
    return Template(packs, region.replica(None), plan, tuple(sources), draws)


# NOTE [random ops of a template] A recorded call keeps, for each random op its replay runs, the
# state of the generator the op drew from, taken by the dispatch mode just before the op. A call run
# from its template has no mode to stop before an op, but it has its saved-tensor hooks: a tensor
# autograd saves when ``at`` of the region's ops have run is saved after op ``at - 1`` and before op
# ``at`` (an op's inputs are saved before it runs, its outputs after). So for a random op ``i`` of
# the replay, the state is taken in the hook of the last save between the draw before it and it
# (dropout saves its mask just after drawing it; the op after it saves its inputs), or at the call's
# start where nothing drew before it: no draw comes between, so the state is the one the op drew
# from. A region whose random op has no such place (two draws with no save between), or draws from
# a generator the code hands it, or found the generators moved since the draw before it where no
# op shows (``Node.draws_on``: a seed set between), stays recorded. Not seen: the generators moved
# in the call before its first draw and after the save chosen (a seed set there). Memory: a state
# per run of draws replayed, as the recorded call kept; the template keeps none. On CPU, NOTE [a
# template's replay checked] would catch a state taken at the wrong place (the mask differs).
def _anchors(
    packs: Sequence[Pack], drawn: Sequence[int], plan: Slice
) -> tuple[tuple[tuple[int, int, tuple[torch.device, ...]], ...], Slice] | None:
    """Where a later call takes the generator state each random op of ``plan`` drew from (NOTE
    [random ops of a template]), and the plan with those states cleared; None where one of them has
    no such place or draws from a generator of its own. ``drawn``: the place on the tape of every
    op of the recorded call that drew."""
    draws: list[tuple[int, int, tuple[torch.device, ...]]] = []
    steps = list(plan.steps)
    for s, step in enumerate(steps):
        rng = step.node.rng
        if rng is None or not rng.states:  # draws on from the state of the one before it
            continue
        sources = tuple(source for source in rng.sources if isinstance(source, torch.device))
        if len(sources) != len(rng.sources):
            return None  # a generator the code hands the op: a later call may hand another
        i = plan.at[s]
        before = max((j for j in drawn if j < i), default=-1)  # the draw before this one
        if before >= 0 and not step.node.draws_on:
            return None  # the generators moved between the two draws, where no op shows
        # a tensor saved when ``at`` ops had run was saved after op ``at - 1`` and before op ``at``
        places = [k for k, p in enumerate(packs) if before < p.at <= i]
        if places:
            draws.append((places[-1], s, sources))
        elif before < 0:
            draws.append((-1, s, sources))
        else:
            return None
        steps[s] = Step(step.node._replace(rng=aten.RngState(())), step.free)
    return tuple(draws), dataclasses.replace(plan, steps=tuple(steps))


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
        self.k = 0
        self.bound: dict[int, tuple[torch.Tensor, int]] = {}
        # NOTE [random ops of a template]: pack -> (step, generators), and the states taken
        self.draws = {k: (s, sources) for k, s, sources in template.draws}
        self.states: dict[int, aten.RngState] = {}
        self.take(-1)
        # NOTE [a template's replay checked]: id of a handle given -> (pack, the forward's sample)
        self.samples: dict[int, tuple[int, samples.Sample]] = {}
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

    def take(self, k: int) -> None:
        """Take the generator states a random op of the replay draws from, if pack ``k`` (-1: the
        call's start) is where (NOTE [random ops of a template])."""
        draw = self.draws.get(k)
        if draw is not None:
            self.states[draw[0]] = aten.capture(draw[1])

    def pack(self, t: torch.Tensor) -> Kept | Handle:
        k = self.k
        self.k += 1
        self.take(k)
        packs = self.template.packs
        if k >= len(packs):
            raise self._diverged(f"autograd saved more than the {len(packs)} tensors it saved")
        want = packs[k]
        node = node_of(t)
        if t.shape != want.shape or t.dtype != want.dtype or node != want.node:
            got = f"{aten.describe(t.dtype, t.shape)} of {node}"
            wanted = f"{aten.describe(want.dtype, want.shape)} of {want.node}"
            raise self._diverged(f"saved tensor #{k} is {got}, recorded {wanted}")
        if want.handle is not None:
            written = (want.handle.vid, want.handle.after) in self.region.rewritten
            values = None if written else samples.sample(t)  # it stands for what the write leaves
            if values is not None:
                self.samples[id(want.handle)] = (k, values)
            self.region.versions.saw(want.handle.vid, t)  # NOTE [written after the region]
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
        self.region.versions.ended()
        plan = self.template.plan
        if plan is None:
            return
        steps = list(plan.steps)
        for s, state in self.states.items():
            steps[s] = Step(steps[s].node._replace(rng=state), steps[s].free)
        self.region.plan = dataclasses.replace(plan, kept=self.bound, steps=tuple(steps))

    def unpack(self, packed: Kept | Handle) -> torch.Tensor:
        t = self.region.unpack(packed)
        given = self.samples.get(id(packed))
        if given is not None:
            k, rounded, name, what = (
                given[0],
                self.region.execute is not eager_steps,
                self.name,
                (t.dtype, t.shape),
            )
            samples.check(given[1], t, rounded, lambda: _differs(name, k, *what))
        return t

    def _diverged(self, what: str) -> RecomputationError:
        return RecomputationError(
            message(
                "plan",
                "the model's forward diverged from the traced step",
                f"{self.name}'s call run bare: {what}",
                "plan again with inputs that take this path, or apply the plan with check='every'",
            )
        )


def _differs(name: str, k: int, dtype: torch.dtype, shape: torch.Size) -> RecomputationError:
    """The error of a recomputed tensor that differs from its sample (it holds no tensor: NOTE [a
    template's replay checked] may wait to the end of the backward)."""
    return RecomputationError(
        message(
            "plan",
            "a tensor recomputed from a template differs from the one the call saved",
            f"{name}'s call run bare: saved tensor #{k}, {aten.describe(dtype, shape)}",
            "something the module's code reads changed since its first call in this setting "
            "(a global a helper function reads, a number deep in an object); the gradients "
            "of this backward are not the model's: apply the plan with check='every'",
        )
    )
