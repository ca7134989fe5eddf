"""``remat.scope``: checkpoint a block of code, with no function to re-run, by replaying its ops.

``torch.utils.checkpoint`` needs a callable to run again in backward. A region such as
``h = h + attn(norm(h))`` in the middle of a forward has none, so the scope records the ATen ops the
block runs (``remat.manual.tape``) and, in backward, replays the ones that lead to what autograd saved.
This is OneFlow's checkpointing scope done eagerly: its "fake subgraph" is the replayed slice of the
tape, and it runs just before the first backward op that needs it::

    forward                                   backward
    inputs --[op]--[op]--[op]--> outputs      first unpack of the region, per backward:
              |     |     |                     replay the slice of the tape -> every saved
             pack  pack  pack                   tensor of the region at once; each unpack
              v     v     v                     takes its own and drops it from the cache
           handles (value id, shape, dtype)

What autograd saves inside the block goes through ``saved_tensors_hooks``: an internal tensor the
policy recomputes is swapped for a small handle, anything else (an input, a parameter, a SAVE output)
is kept as is, with its version counter checked at unpack as autograd would without hooks.

Replay is exact: the recorded ops are already past autocast, random ops restore the generator state
they drew from, and in-place writes to tensors from outside the block (batch-norm running statistics,
``num_batches_tracked``) replay into copies, so those buffers are updated once, in forward.

A scope inside a scope joins the outer region: the outer policy decides, and the inner one is
ignored. With grad disabled or in inference mode, the block simply runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from remat import aten
from remat._dispatch import Unguarded, saved_hooks
from remat._errors import RecomputationError, RematTypeError, message
from remat._module_path import ModulePaths
from remat._reusable import reusable
from remat.aten import describe
from remat.host.offloader import Offloader
from remat.host.parcel import Parcel, unmovable
from remat.manual.blank import blank_writes
from remat.manual.fused import ReplayMode, executor
from remat.manual.handles import Handle, Kept, Versions, Watch
from remat.manual.plainly import plain
from remat.manual.replay import Executor, eager_steps, replay
from remat.manual.tape import EXTERNAL, Slice, Tape, stale_view_error, written_from
from remat.manual.traced import transformed
from remat.policy import Policy, RecomputeAll, checked

__all__ = ["TapedRegion", "joining", "recording", "scope"]


# NOTE [kept detached] The tensors a region's replay reads are kept detached once it has recorded
# (sharing their memory and version counters): kept with their graph, they would close a cycle
# through C++ (a kept tensor -> its node -> later nodes' saved tensors -> the region's hooks -> the
# region -> the kept tensor) that Python's collector cannot see, and a step whose loss never reached
# backward (a skipped step, an error before it) would stay in memory for good. So is an output a
# node saves of itself (kept by a SAVE policy, ``Kept``): its node -> its saved tensor -> the output.


class TapedRegion:
    """One ``with remat.scope()`` block: its tape while it records, then the plan that recomputes
    every tensor it handed to autograd as a handle. ``api`` names it in errors (a plan's: ``plan``)."""

    api = "scope"

    def __init__(self, tape: Tape | None, execute: Executor = eager_steps) -> None:
        self.tape: Tape | None = tape
        self.execute = execute
        self.plan: Slice | None = None
        self.declared: dict[int, int] = {}  # the tape's final declared writers, checked at unpack
        self.spans: dict[int, list[tuple[int, aten.Geometry]]] = {}  # and where each wrote
        self.handles: dict[int, int] = {}  # value id -> handles packed for it
        self.watch: Watch | None = Watch()  # NOTE [dead handles] in ``remat.manual.handles``
        self.versions = Versions()  # NOTE [written after the region] there
        self.packed: dict[tuple[int, int], int] = {}  # (value id, ``Handle.after``) -> handles
        self.own: dict[tuple[int, int], int] = {}  # NOTE [saved before its own write]
        self.results: set[tuple[int, int]] = set()  # (value id, ``after``) saved as a result
        self.writers_needed: set[int] = set()
        # graph task -> value id -> (recomputed tensor, unpacks left)
        self.cache: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}
        self.lock = threading.Lock()
        self.offloader: Offloader | None = tape.offloader if tape is not None else None
        self.moved_packs: dict[int, int] = {}  # value id of an offloaded tensor -> times packed
        # NOTE [taped call run bare] in ``remat.planner.taped_calls``: told each tensor packed and
        # what autograd got for it (with how many ops it had recorded then), and the plan's kept
        # tensors as the tape held them (``learn`` takes them, and clears both)
        self.note: Callable[[torch.Tensor, Kept | Handle | Parcel, int], None] | None = None
        self.log_kept: dict[int, tuple[torch.Tensor, int]] = {}
        self.reads_values = False  # an op of the region gave Python a value (``item``, ``equal``)
        self.drawn: tuple[int, ...] = ()  # the place of each node that drew random numbers
        # (value id, ``Handle.after``) of each handle whose storage an op writes after the save
        self.rewritten: frozenset[tuple[int, int]] = frozenset()

    def pack(self, t: torch.Tensor) -> Kept | Handle | Parcel:
        packed = self._pack(t)
        if self.note is not None:  # NOTE [taped call run bare] in ``remat.planner.taped_calls``
            assert self.tape is not None, "pack hooks only run while the region records"
            self.note(t, packed, len(self.tape.nodes))
        return packed

    def _pack(self, t: torch.Tensor) -> Kept | Handle | Parcel:
        tape = self.tape
        assert tape is not None, "pack hooks only run while the region records"
        vid = tape.lookup(t)
        if vid < 0 or tape.producer[vid] == EXTERNAL or vid in tape.kept:
            own = aten.made_last(t)  # an output its own node saves: NOTE [kept detached]
            return Kept(aten.detached(t) if own else t, t._version)
        moving = bool(tape.offloading or tape.moved)
        parcel = tape.move(vid) if moving else None
        if parcel is not None:
            self.moved_packs[vid] = self.moved_packs.get(vid, 0) + 1
            return parcel
        group = tape.group[vid]
        writer = tape.writers.get(group)
        off = tape.offloader if moving and tape.move(group) is not None else None
        if writer is None and off is not None and unmovable(t) is None:  # a view of an offloaded
            return off.out(t)  # tensor: its storage moves too (one with a lazy bit is recomputed)
        if writer is None and (group in tape.kept or tape.producer[group] == EXTERNAL):
            # a view of a kept or outside tensor that nothing wrote since: its memory is kept anyway
            return Kept(t, t._version)
        if writer is not None:
            if writer < 0:
                raise stale_view_error(t, self.api)
            self.writers_needed.add(writer)
        self.handles[vid] = self.handles.get(vid, 0) + 1
        self.packed[vid, len(tape.nodes)] = self.packed.get((vid, len(tape.nodes)), 0) + 1
        if aten.made_last(t):  # saved after its op ran: a write by the next op comes after the save
            self.results.add((vid, len(tape.nodes)))
        handle = Handle(
            vid, group, writer, tape.declared.get(group), t.shape, t.dtype, aten.geometry(t), len(tape.nodes)
        )
        assert self.watch is not None, "a region that records watches its handles"
        self.watch.add(handle)
        self.versions.saw(vid, t)
        return handle

    def finish(self) -> None:
        """Stop recording: keep only the plan (and the tensors it reads) if anything was packed."""
        tape, self.tape = self.tape, None
        self.versions.ended()
        if tape is not None and self.watch is not None:  # NOTE [dead handles]
            self.handles = self.watch.pruned(self.handles, self.packed, self.results)
        if tape is not None and self.handles:
            self._own_writes(tape)
            plan = blank_writes(tape, tape.slice(self.handles, self.writers_needed), self.writers_needed)
            if self.note is not None:
                self.log_kept = dict(plan.kept)
            kept = {vid: (aten.detached(t), version) for vid, (t, version) in plan.kept.items()}
            self.plan = dataclasses.replace(plan, kept=kept)  # NOTE [kept detached]
            self.declared, self.spans = tape.declared, tape.spans
        if tape is not None and self.note is not None:
            self.reads_values = any(aten.facts(node.func).packet in aten.VALUE_PACKETS for node in tape.nodes)
            self.drawn = tuple(i for i, node in enumerate(tape.nodes) if node.rng is not None)
            last: dict[int, int] = {}  # storage group -> the last node writing it
            for i, node in enumerate(tape.nodes):
                last.update((tape.group[written_from(node, w)], i) for w in node.writes)
            self.rewritten = frozenset(k for k in self.packed if last.get(tape.group[k[0]], -1) >= k[1])
        if tape is not None:
            self.offloader = tape.offloader
            # NOTE [moved once, read twice]: per backward, each offloaded value is read by the
            # replay (if it reads it) and by each unpack; the first read keeps its copy for the rest
            replayed = self.plan.moved if self.plan is not None else {}
            for vid, parcel in tape.moved.items():
                reads = self.moved_packs.get(vid, 0) + (vid in replayed)
                parcel.cargo.uses = max(parcel.cargo.uses + reads - 1, 1)  # ``out`` counted one

    def _own_writes(self, tape: Tape) -> None:
        """NOTE [saved before its own write] Autograd saves an op's inputs before the op runs, so
        before the tape records it: an input the op itself then writes (the noise ``rrelu`` fills)
        was packed as the value before the write, while backward reads what the write left. Such a
        handle stands for the value the write makes, and that write is not one after its save. An
        op's result saved after the op ran (``relu`` saves its output) is packed at the same place,
        before the next op: that op's write comes after the save, as autograd sees it."""
        for (vid, after), n in self.packed.items():
            if after >= len(tape.nodes) or (vid, after) in self.results:
                continue
            node = tape.nodes[after]
            for w in node.writes:
                if not w.clone and written_from(node, w) == vid:
                    self.own[vid, after] = w.vid
                    self.handles[vid] -= n
                    self.handles[w.vid] = self.handles.get(w.vid, 0) + n
        self.handles = {vid: n for vid, n in self.handles.items() if n > 0}

    def replica(self, plan: Slice | None) -> TapedRegion:
        """A region that unpacks what this one packed, replaying ``plan`` (the same slice over other
        kept tensors): for a call of the same code run without recording (NOTE [taped call run
        bare] in ``remat.planner.taped_calls``). What it shares is read only, once finished."""
        other = TapedRegion(None, self.execute)
        other.watch = None  # its handles are the template's, for every call: counted once
        other.plan, other.declared, other.spans = plan, self.declared, self.spans
        other.handles, other.packed, other.own = self.handles, self.packed, self.own
        other.results, other.writers_needed = self.results, self.writers_needed
        other.rewritten, other.api = self.rewritten, self.api
        return other

    def _written_since(self, packed: Handle) -> bool:
        """Whether a declared write after ``packed`` was saved touched the bytes it reads."""
        since = -1 if packed.declared is None else packed.declared
        if (packed.vid, packed.after) in self.own:  # NOTE [saved before its own write]
            since = max(since, packed.after)
        spans = self.spans.get(packed.group, ())
        return any(node > since and aten.overlaps(place, packed.place) for node, place in spans)

    def unpack(self, packed: Kept | Handle | Parcel) -> torch.Tensor:
        if isinstance(packed, Parcel):
            if packed.written():
                raise _written(self.api, describe(packed.dtype, packed.size), "")
            assert self.offloader is not None, "a parcel comes from the region's offloader"
            return self.offloader.back(packed)
        if isinstance(packed, Kept):
            if packed.tensor._version != packed.version:
                raise _written(
                    self.api,
                    describe(packed.tensor.dtype, packed.tensor.shape),
                    f" at version {packed.tensor._version}, saved at version {packed.version}",
                )
            return packed.tensor
        # NOTE [hidden writes after a save]: autograd saves batch norm's running statistics before
        # the kernel updates them, a write the schema does not declare; the plain backward reads
        # them without a version check, and batch norm's backward in training does not use them.
        # Only a declared write after the save changes what backward may read.
        if (now := self.versions.written(packed.vid)) is not None:
            raise _written(
                self.api, describe(packed.dtype, packed.shape), f" after the region, at version {now}"
            )
        if self.declared.get(packed.group) != packed.declared and self._written_since(packed):
            raise RecomputationError(
                message(
                    self.api,
                    "a tensor saved for backward was modified by an in-place op later in the region",
                    describe(packed.dtype, packed.shape),
                    "clone it before modifying it, or use the out-of-place op",
                )
            )
        t = self._recomputed(self.own.get((packed.vid, packed.after), packed.vid))
        if t.shape != packed.shape or t.dtype != packed.dtype:
            raise RecomputationError(
                message(
                    self.api,
                    "recomputed tensor differs from the forward",
                    f"{describe(t.dtype, t.shape)}, forward saved {describe(packed.dtype, packed.shape)}",
                    "make sure nothing the region read changed between forward and backward",
                )
            )
        return t

    def _recomputed(self, vid: int) -> torch.Tensor:
        """The tensor with value id ``vid``. The first unpack of a backward replays the plan for
        every handle at once; each unpack then takes its tensor out of the cache, so the memory goes
        as backward consumes it. The cache of a backward is dropped when that backward ends."""
        plan = self.plan
        if plan is None:
            raise RecomputationError(
                message(
                    self.api,
                    "backward reached a tensor saved by a region that is still recording",
                    "backward inside the `with remat.scope()` block",
                    "run backward after the block ends",
                )
            )
        graph_task, again = torch._C._current_graph_task_id(), (plan, self.execute, self.offloader, self.api)
        with self.lock:
            results = self.cache.get(graph_task) if graph_task >= 0 else None
            if results is None:
                held = self.handles if self.watch is None else self.watch.alive(self.own)
                results = {v: (t, held[v]) for v, t in replay(*again).items() if held.get(v, 0) > 0}
                if graph_task >= 0:
                    self.cache[graph_task] = results
                    # a weak reference: the callback runs when the whole backward ends, and holding
                    # the region until then would keep its inputs alive after its own backward
                    torch.autograd.Variable._execution_engine.queue_callback(
                        functools.partial(_forget, weakref.ref(self), graph_task)
                    )
            entry = results.get(vid)
            if entry is None:  # already handed out in this backward: a tensor unpacked twice
                return replay(*again)[vid]
            tensor, left = entry
            if left == 1:
                del results[vid]
            else:
                results[vid] = (tensor, left - 1)
            return tensor

    def forget(self, graph_task: int) -> None:
        with self.lock:
            self.cache.pop(graph_task, None)


class Recorder(Unguarded):
    """The dispatch mode that appends every op run under it to a tape."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.tape.record(func, args, kwargs or {})


def _written(api: str, what: str, versions: str) -> RecomputationError:
    rule = "a tensor saved for backward was modified in place after it was saved"
    todo = "clone it before modifying it, or use the out-of-place op"
    return RecomputationError(message(api, rule, f"{what}{versions}", todo))


def _forget(region: weakref.ref[TapedRegion], graph_task: int) -> None:
    alive = region()
    if alive is not None:
        alive.forget(graph_task)


# NOTE [a scope joined again] A scope inside a recorded region joins it, its saves going to the nearest
# hooks: a ``remat.checkpoint``'s, where one sits between. Run again in backward, where no scope
# records, the inner scope opened a region whose hooks took the checkpoint's saves; a checkpoint whose
# forward ran where a scope recorded runs again inside ``joining()``, where scopes join as before.
_JOINING = threading.local()


def recording() -> bool:
    """Whether a scope opened now joins another (NOTE [a scope joined again])."""
    depth = getattr(_JOINING, "depth", 0)
    return depth > 0 or any(isinstance(mode, Recorder) for mode in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def joining() -> Iterator[None]:
    """Scopes opened inside join, as inside a recorded region (NOTE [a scope joined again])."""
    depth = getattr(_JOINING, "depth", 0)
    _JOINING.depth = depth + 1
    try:
        yield
    finally:
        _JOINING.depth = depth


@reusable
def scope(
    policy: Policy | None = None, *, replay: ReplayMode = "eager", offloader: Offloader | None = None
) -> Iterator[None]:
    """Recompute in backward what the block saves for backward, instead of keeping it.

    ``policy`` (default ``RecomputeAll()``) is asked once per op whether to keep its outputs
    (``Decision.SAVE``), to move them to host memory through ``offloader`` until backward needs them
    (``Decision.OFFLOAD``; a default ``remat.Offloader`` if None) or to drop them and recompute them
    from the region's inputs. The block's
    inputs and parameters are kept; everything the block computes is replayed at most once per
    backward, just before the first backward op that needs it.

    ``replay="compiled"`` replays the block's runs of deterministic ops through ``torch.compile``d
    graphs, one fused kernel where eager replay runs one per op (``remat.manual.fused``): compiled once per
    structure in the first backward, equal to eager up to floating-point rounding.

    A nested scope joins the outer region (the outer policy decides). With grad disabled or in
    inference mode, or under a ``torch.func`` transform or forward-mode AD, the block runs as is. Usable
    as a decorator too.
    """
    execute = executor("scope", replay)
    policy = checked("scope", policy)
    if offloader is not None and not isinstance(offloader, Offloader):
        raise RematTypeError(
            message(
                "scope",
                "offloader must be a remat.Offloader",
                f"got {type(offloader).__name__}",
                "pass remat.Offloader(link=..., prefetch=...) or leave it out",
            )
        )
    off = not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or plain() or transformed()
    if off or recording():
        yield
        return
    tape = Tape(RecomputeAll() if policy is None else policy, offloader)
    if policy is not None:
        tape.paths = ModulePaths()
    region = TapedRegion(tape, execute)
    try:
        with Recorder(tape), saved_hooks(region.pack, region.unpack):
            yield
    finally:
        region.finish()
