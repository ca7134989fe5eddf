"""Record the ATen ops of a code region as a tape of value ids, and replay any slice of it.

``remat.scope`` wraps a block of code, not a callable, so in backward there is nothing to call
again. Instead a TorchDispatchMode sees every ATen op the block runs (below autograd and autocast,
so decompositions and dtype casts are already explicit) and writes it down with its tensors
replaced by *value ids*. Backward replays exactly the ops that lead to the tensors it asks for.

Value ids
    Every tensor the tape sees gets one, and an in-place op gives the tensor it writes a new one.
    A tensor no recorded op produced is *external* (a parameter, an input of the region): the tape
    keeps it, with its version counter, and that is the region's memory cost. An internal tensor is
    known only through a weak reference: the tape keeps it alive only when the policy says SAVE.
    When the policy says OFFLOAD, the tape moves it to host memory (``remat.host``) when something
    will read it back: autograd saving it, or a later op that reads it and may replay (one whose
    outputs are neither kept nor moved); it keeps the parcel, and replay and backward bring it back
    instead of recomputing it. A value nothing reads back never crosses the link.

NOTE [aliasing]
    Values that share storage form a *group*: a view joins the group of the tensor it views (per
    the op schema, or found on its storage: ``aten.UNSAID_VIEWS``), anything else starts its own.
    An in-place op writes the whole group, so every later op that reads a member of the group
    replays after it (``Node.after``); a saved member is stale where a later write touched its
    bytes (``Tape.spans``: ``unsafe_chunk``'s results share a storage, not bytes). A write to an
    external is replayed into a clone of a snapshot taken just before the write, so replay never
    touches parameters or batch-norm running statistics, and earlier reads replay against the value
    they saw. A write into a view of an external (instance norm's ``at::alias(running_mean).copy_``)
    is replayed the same way, into a clone of the view, and earlier reads of the external replay on
    a snapshot of it taken before the write. Reads of the external or its views after it was
    written are refused: replay would see the snapshot, not what the forward saw.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from remat import aten
from remat._errors import RecomputationError, message
from remat._module_path import ModulePaths
from remat.aten import OpFacts, RngState, describe
from remat.host.offloader import Offloader
from remat.host.parcel import Parcel
from remat.policy import Decision, OpContext, Policy, RecomputeAll, decided

EXTERNAL = -1  # the producer of a value that no recorded op produced


class Ref(NamedTuple):
    """A tensor argument of a recorded op, by value id."""

    vid: int


class Seq(tuple[Any, ...]):
    """A list argument of a recorded op that holds tensors (as ``Ref``)."""


class Write(NamedTuple):
    """A tensor an op writes: where it sits in the arguments (``item`` >= 0 inside a tensor list)
    and the value id the write makes. ``clone``: the tensor is an external's snapshot, so replay
    writes into a clone of it. ``blank``: replay writes into a new tensor of this shape, strides,
    dtype and device instead, and no snapshot is kept (NOTE [blank writes] in ``remat.manual.blank``)."""

    key: int | str
    item: int
    vid: int
    clone: bool
    blank: tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device] | None = None


class Node(NamedTuple):
    """One recorded op. ``outs`` is the value id of the output, or one per output (-1 where it is
    not a tensor); ``after`` lists the in-place writers it must follow (NOTE [aliasing])."""

    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: int | tuple[int, ...]
    reads: tuple[int, ...]
    writes: tuple[Write, ...]
    after: tuple[int, ...]
    rng: RngState | None
    draws_on: bool = False  # NOTE [one state per run of draws] in ``remat.aten.generators``


class Step(NamedTuple):
    """A node to replay and the value ids no later step reads (dropped after it runs)."""

    node: Node
    free: tuple[int, ...]


@dataclass(frozen=True)
class Slice:
    """The part of a tape that recomputes ``targets``: its steps, the kept tensors it reads (with
    the version each had when the tape took it), the offloaded ones it reads (``moved``), the
    generators whose state it sets and the place of each step's node on the tape."""

    steps: tuple[Step, ...]
    kept: dict[int, tuple[torch.Tensor, int]]
    rng_sources: tuple[torch.Generator | torch.device, ...]
    targets: frozenset[int]
    moved: dict[int, Parcel] = field(default_factory=dict)
    at: tuple[int, ...] = ()


def written_from(node: Node, w: Write) -> int:
    """The value id ``w`` overwrites (its argument's before the op ran)."""
    box: Any = node.args if isinstance(w.key, int) else node.kwargs
    value = box[w.key] if w.item < 0 else box[w.key][w.item]
    return int(value.vid)


def stale_view_error(view: torch.Tensor, api: str = "scope") -> RecomputationError:
    """A view of an external is used after an in-place op inside the region wrote the external
    (NOTE [aliasing]): replay would see the snapshot, not what the forward saw."""
    return RecomputationError(
        message(
            api,
            "a view of a tensor from outside the region was used after that tensor was modified in "
            "place inside the region",
            f"view {describe(view.dtype, view.shape)}",
            "take the view after the in-place op, or clone the tensor inside the region first",
        )
    )


class Tape:
    """The ops of one region, in the order they ran, over value ids; ``api`` names it in errors."""

    api = "scope"
    paths: ModulePaths | None = None  # where a policy is asked: the region's (NOTE [module paths])

    def __init__(self, policy: Policy, offloader: Offloader | None = None) -> None:
        self.policy = policy
        self.offloader = offloader  # made when the policy first says OFFLOAD, if None
        self.moved: dict[int, Parcel] = {}  # value id -> its bytes in host memory (OFFLOAD)
        self.offloading: dict[int, weakref.ref[torch.Tensor]] = {}  # OFFLOAD, not moved yet
        self.nodes: list[Node] = []
        self.producer: list[int] = []  # value id -> index of the node that made it, or EXTERNAL
        self.group: list[int] = []  # value id -> its storage group (NOTE [aliasing])
        self.kept: dict[int, tuple[torch.Tensor, int]] = {}  # value id -> (tensor, version or -1)
        self.writers: dict[int, int] = {}  # group -> last node that wrote it (-1: refused)
        self.declared: dict[int, int] = {}  # group -> last node that wrote it as its schema says
        self.spans: dict[int, list[tuple[int, aten.Geometry]]] = {}  # group -> each declared write's place
        self._saved_in_group: dict[int, list[int]] = {}
        self._ids: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._drawn_to: tuple[Any, ...] | None = None  # ``aten.standing`` after the last draw

    def lookup(self, t: torch.Tensor) -> int:
        """The value id the tensor holds now, or -1 if the tape has not seen it."""
        entry = self._ids.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else -1

    def _bind(self, t: torch.Tensor, producer: int, group: int) -> int:
        vid = len(self.producer)
        self.producer.append(producer)
        self.group.append(vid if group < 0 else group)
        self._ids[id(t)] = (weakref.ref(t), vid)
        return vid

    def _read(self, t: torch.Tensor, reads: list[int], after: list[int]) -> Ref:
        entry = self._ids.get(id(t))
        if entry is not None and entry[0]() is t:
            vid = entry[1]
        else:
            vid = self._bind(t, EXTERNAL, -1)
            self.kept[vid] = (t, -1 if t.is_inference() else t._version)  # -1: no version counter
        reads.append(vid)
        if self.writers:
            writer = self.writers.get(self.group[vid])
            if writer is not None:
                if writer < 0:
                    raise stale_view_error(t, self.api)
                after.append(writer)
        return Ref(vid)

    def _seq(self, a: Iterable[Any], reads: list[int], after: list[int]) -> Seq:
        return Seq(self._read(b, reads, after) if isinstance(b, torch.Tensor) else b for b in a)

    def _written(
        self,
        info: OpFacts,
        places: tuple[tuple[int, str], ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> list[tuple[torch.Tensor, int | str, int, torch.Tensor | None]]:
        """The tensors the op is about to write (at ``places``, hidden writes included), each with its
        place in the arguments and, for an external, a snapshot of its value before the write."""
        found: list[tuple[torch.Tensor, int | str, int, torch.Tensor | None]] = []
        for pos, name in places:
            key: int | str = pos if pos < len(args) else name
            value = args[pos] if isinstance(key, int) else kwargs.get(name)
            items = [(-1, value)] if isinstance(value, torch.Tensor) else enumerate(value or ())
            for index, t in items:
                if not isinstance(t, torch.Tensor):
                    continue
                vid = self.lookup(t)
                root = self.group[vid]
                if self.producer[root] == EXTERNAL and vid != root:  # a view of an external
                    self.kept[root] = (self.kept[root][0].clone(), 0)  # earlier reads replay on this
                found.append((t, key, index, t.clone() if self.producer[root] == EXTERNAL else None))
        return found

    def _commit_write(
        self, t: torch.Tensor, key: int | str, index: int, snapshot: torch.Tensor | None, hidden: bool
    ) -> Write:
        node = len(self.nodes)
        old = self.lookup(t)
        group = self.group[old]
        if snapshot is not None:
            self.kept[old] = (snapshot, snapshot._version)
            self.writers[group] = -1
            return Write(key, index, self._bind(t, node, -1), True)
        # Kept (SAVE) members of the group no longer hold the value later reads expect.
        for vid in self._saved_in_group.pop(group, ()):
            self.kept.pop(vid, None)
            if (parcel := self.moved.pop(vid, None)) is not None and self.offloader is not None:
                self.offloader.refill(parcel, t)  # handed out before this op wrote it: RReLU's noise
            self.offloading.pop(vid, None)
        self.writers[group] = node
        if not hidden:
            self.declared[group] = node
            self.spans.setdefault(group, []).append((node, aten.geometry(t)))
        return Write(key, index, self._bind(t, node, group), False)

    def _output(
        self,
        o: Any,
        alias: tuple[int, str] | None,
        shared: tuple[Any, ...],
        targs: tuple[Any, ...],
        fresh: list[tuple[int, torch.Tensor]],
    ) -> int:
        if not isinstance(o, torch.Tensor):
            return -1
        vid = self.lookup(o)
        if vid >= 0:  # an argument returned as is: in-place ops return what they wrote
            return vid
        k = alias[0] if alias is not None else aten.sharing(o, shared) if shared else -1
        group = self.group[targs[k].vid] if 0 <= k < len(targs) and type(targs[k]) is Ref else -1
        vid = self._bind(o, len(self.nodes), group)
        fresh.append((vid, o))
        return vid

    def record(self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one op and append it to the tape."""
        info = aten.facts(func)
        reads: list[int] = []
        after: list[int] = []
        targs = tuple(
            [
                self._read(a, reads, after)
                if isinstance(a, torch.Tensor)
                else self._seq(a, reads, after)
                if i in info.tensor_lists and a is not None
                else a
                for i, a in enumerate(args)
            ]
        )
        tkwargs = {
            k: self._read(v, reads, after)
            if isinstance(v, torch.Tensor)
            else self._seq(v, reads, after)
            if isinstance(v, (list, tuple))
            else v
            for k, v in kwargs.items()
        }
        places = info.all_writes(args) if info.hidden_writes else info.writes
        written = self._written(info, places, args, kwargs) if places else []
        drawn = info.random and aten.draws(info, args, kwargs)  # NOTE [no dropout draws nothing]
        rng = aten.capture((aten.source_of(args, kwargs),)) if drawn else None
        draws_on = rng is not None and self._drawn_to == aten.standing(rng)

        out = func(*args, **kwargs)
        # NOTE [where a draw left the generators]: after a draw, the tape notes where it left the
        # generators, so that the next draw knows whether it continues from there (one state per
        # run of draws); the note is bytes, but taking it makes a state tensor (5 KB on CPU) that
        # lives beside the op's results for a moment: the planner's prediction counts it there
        if rng is not None:
            self._drawn_to = aten.standing(aten.capture(rng.sources))

        writes = tuple([self._commit_write(*w, w[1] in _keys(info, args)) for w in written])
        fresh: list[tuple[int, torch.Tensor]] = []
        outs: int | tuple[int, ...]
        shared = args if info.packet in aten.UNSAID_VIEWS else ()  # what a result may view unsaid
        if isinstance(out, (tuple, list)):
            aliases = info.aliases if len(info.aliases) == len(out) else info.aliases[:1] * len(out)
            outs = tuple(self._output(o, a, shared, targs, fresh) for o, a in zip(out, aliases, strict=True))
        else:
            outs = self._output(out, info.aliases[0] if info.aliases else None, shared, targs, fresh)
        asks = type(self.policy) is not RecomputeAll  # that one keeps nothing: not asked
        owned = [(vid, t) for vid, t in fresh if self.group[vid] == vid] if asks or self.offloading else []
        if owned and asks:
            self._decide(info, owned, (func, args, kwargs))
        if self.offloading and not (owned and all(v in self.kept or v in self.offloading for v, _ in owned)):
            for vid in reads:  # this op may replay: what it reads that is to move moves now
                self.move(vid)
        self.nodes.append(Node(func, targs, tkwargs, outs, tuple(reads), writes, tuple(after), rng, draws_on))
        return out

    def _decide(
        self,
        info: OpFacts,
        owned: list[tuple[int, torch.Tensor]],
        call: tuple[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]],
    ) -> None:
        """Ask the policy about the op's new, non-view outputs. Views are always recomputed: they
        own no memory, and replaying them is free."""
        func, args, kwargs = call
        ctx = OpContext(
            op=info.name,
            packet=info.packet,
            module=self.paths.now() if self.paths is not None else "",
            out_bytes=sum(t.nbytes for _, t in owned if t.layout is torch.strided),
            random=info.random,
            overload=func,
            args=args,
            kwargs=kwargs,
        )
        decision = decided(self.policy, ctx)
        if decision is Decision.OFFLOAD and self.offloader is None:
            self.offloader = Offloader()
        for vid, t in owned if decision is not Decision.RECOMPUTE else ():
            offloader = self.offloader
            if decision is Decision.OFFLOAD and offloader is not None and offloader.takes(t, demanded=True):
                offloader.check(t)
                self.offloading[vid] = weakref.ref(t)
            else:  # SAVE, or too small to move
                self.kept[vid] = (t, t._version)
            self._saved_in_group.setdefault(vid, []).append(vid)

    def move(self, vid: int) -> Parcel | None:
        """The parcel of value ``vid`` if it is decided OFFLOAD, moving it now if it has not
        moved yet; None for another value."""
        ref = self.offloading.pop(vid, None)
        if ref is not None:
            t = ref()
            assert t is not None and self.offloader is not None, "a value is moved while it is read"
            self.moved[vid] = self.offloader.out(t)
        return self.moved.get(vid)

    def slice(self, targets: Iterable[int], also: Iterable[int]) -> Slice:
        """The steps that recompute ``targets`` (value ids) after running the nodes ``also``."""
        wanted = frozenset(targets)
        producer, kept, moved = self.producer, self.kept, self.moved
        need = bytearray(len(self.nodes))
        for vid in wanted:
            if producer[vid] >= 0 and vid not in kept and vid not in moved:
                need[producer[vid]] = 1
        for index in also:
            need[index] = 1
        for index in range(len(self.nodes) - 1, -1, -1):
            if need[index]:
                node = self.nodes[index]
                for vid in node.reads:
                    if producer[vid] >= 0 and vid not in kept and vid not in moved:
                        need[producer[vid]] = 1
                for writer in node.after:
                    need[writer] = 1
        chosen: list[Node] = []
        at: list[int] = []
        follows = False  # the tape's last drawing node so far is replayed: NOTE [one state per run of draws]
        for index, (node, n) in enumerate(zip(self.nodes, need, strict=True)):
            if node.rng is not None:
                continues = n and follows and node.draws_on
                node, follows = node._replace(rng=aten.CONTINUES) if continues else node, bool(n)
            if n:
                chosen.append(node)
                at.append(index)

        last: dict[int, int] = {}
        for s, node in enumerate(chosen):
            outs = (node.outs,) if isinstance(node.outs, int) else node.outs
            for vid in (*node.reads, *outs, *(w.vid for w in node.writes)):
                last[vid] = s
        frees: list[list[int]] = [[] for _ in chosen]
        for vid, s in last.items():
            if vid >= 0 and vid not in wanted and vid not in kept:  # moved ones come back as copies
                frees[s].append(vid)
        sources = {source: None for node in chosen if node.rng is not None for source in node.rng.sources}
        return Slice(
            steps=tuple(Step(node, tuple(free)) for node, free in zip(chosen, frees, strict=True)),
            kept={vid: kept[vid] for node in chosen for vid in node.reads if vid in kept},
            rng_sources=tuple(sources),
            targets=wanted,
            moved={vid: moved[vid] for node in chosen for vid in node.reads if vid in moved},
            at=tuple(at),
        )


def _keys(info: OpFacts, args: tuple[Any, ...]) -> set[int | str]:
    """Where ``info``'s hidden writes sit in a call of positional ``args`` (keyed as ``_written``)."""
    return {pos if pos < len(args) else name for pos, name in info.hidden_writes}
