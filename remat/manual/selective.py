"""Selective recomputation for ``remat.checkpoint``: keep the outputs a policy says to save.

In forward, a dispatch mode asks the policy about each op and keeps the outputs it says to SAVE,
with the position of the op among all ops of the region. In the recomputation the same mode hands
those outputs back instead of running the op again, so expensive ops (matmul, attention) are not
recomputed while cheap pointwise ones are. The ops are matched per op, as torch's selective
checkpoint matches them: the n-th call of an op in the recomputation gets what the n-th call of
that op saved in the forward, so an op that only the forward runs (a cache a module fills on its
first call) shifts no other op's outputs (matched by position among all ops, it handed one matmul's
output to the next). Queries of metadata (``remat.aten.METADATA_PACKETS``: sizes, strides) take no
position: some tensors send them through dispatch and some do not. Nor do casts (``aten._to_copy``)
under autocast: autocast caches the cast of a leaf that requires grad for as long as its context
lasts, so the forward and the recomputation may cast a different number of times (the
recomputation's inputs are such leaves, a weight cast before the region is cached in the forward
only); there a cast is never kept, whatever the policy says of it, and runs wherever it comes.

A saved output may be written in place later in the region (``h = x @ w; h.mul_(2)``), or after
it. Its version counter then differs from the one recorded with it: the recomputation runs that op
again instead of handing back the written value (NOTE [written saved outputs]). Outputs written
during the forward are dropped from the cache when the forward ends; the others are kept as
aliases made then, outside the mode, because only those share the output's version counter (an
alias made inside a dispatch mode, below autograd, gets a counter of its own).

NOTE [aliases of saved outputs] An op that returns its input's storage without saying so in its
schema (``aten._unsafe_view``: what a 3-D ``nn.Linear`` or a 4-D ``@`` returns after its ``mm``) makes a
tensor with a version counter of its own, and that tensor is what the program holds and writes
(``y = proj(x); y += x``). So every op output made in the region on a saved output's storage is
kept beside it with its version, and a write to any of them is a write to the saved output. During
the forward they are held (with the saved output, whose memory they share); when the forward ends
each is replaced by a witness (``remat.aten.version_witness``: its version counter without its
memory), so that a write the program makes and then drops the tensor is still seen, and an
offloaded output's device memory is not held.

An output the policy decides OFFLOAD is kept the same way, but when the forward ends its tensors
move to host memory (``remat.host.Offloader.out``) and the cache holds parcels; the recomputation
brings them back (``Offloader.back``) where it would have handed back a saved output. Outputs under
the offloader's ``min_bytes`` stay on the device; one that cannot move is an error. They move last
to first, so the offloader's prefetch (the reverse of the order moved out) follows the order the
recomputation asks for them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from remat import aten
from remat._dispatch import Unguarded
from remat._module_path import ModulePaths
from remat.host.offloader import Offloader, movable_here
from remat.host.parcel import Parcel
from remat.policy import Decision, OpContext, Policy, decided

_CAST = torch.ops.aten._to_copy.default
_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _unpositioned(func: Any, autocast: bool) -> bool:
    """Whether ``func`` takes no position: a query of metadata, or a cast under ``autocast``."""
    return aten.facts(func).metadata or (func is _CAST and autocast)


def _out_bytes(out: Any) -> int:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(o.untyped_storage().nbytes() for o in outs if _strided(o))


def _strided(o: Any) -> bool:
    """Whether ``o`` is a tensor with a storage of its own (a sparse one has none)."""
    return isinstance(o, torch.Tensor) and o.layout is torch.strided


def _cacheable(func: Any) -> bool:
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


class SaveCache:
    """The outputs a policy chose to keep, in the order the forward produced them."""

    def __init__(self, policy: Policy, offloader: Offloader | None = None) -> None:
        self.policy = policy
        self.offloader = offloader
        self.entries: dict[int, tuple[str, Any, tuple[int, ...]]] = {}
        self.offloaded: set[int] = set()  # positions whose outputs go to host memory at ``seal``
        self.storages: dict[int, int] = {}  # storage of a saved output -> its position
        self.calls: dict[tuple[str, int], int] = {}  # (op, its n-th call) -> its position
        # NOTE [aliases of saved outputs]: the tensors themselves until ``seal``, their witnesses after
        self.aliases: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self.autocast = False  # the forward ran under autocast (read outside the modes: ``Recording``)

    def decision(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, paths: ModulePaths
    ) -> Decision:
        if not _cacheable(func):
            return Decision.RECOMPUTE
        if aten.facts(func).packet in aten.UNSAID_VIEWS and any(  # new tensors on an argument's
            isinstance(o, torch.Tensor) and aten.sharing(o, args) >= 0  # storage (``unsafe_chunk``):
            for o in (out if isinstance(out, (tuple, list)) else (out,))  # the storage is not theirs
        ):  # to keep or move, and running them again costs nothing
            return Decision.RECOMPUTE
        ctx = OpContext(
            op=str(func),
            packet=str(func.overloadpacket),
            module=paths.now(),
            out_bytes=_out_bytes(out),
            random=torch.Tag.nondeterministic_seeded in func.tags,
            overload=func,
            args=args,
            kwargs=kwargs,
        )
        return decided(self.policy, ctx)

    def keep(self, position: int, func: Any, out: Any, decision: Decision) -> None:
        """Hold ``out`` itself until ``seal``: an alias made here would not see later writes."""
        self.entries[position] = (str(func), out, _versions(out))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if _strided(o):
                self.storages.setdefault(o.untyped_storage()._cdata, position)
        if decision is Decision.OFFLOAD:
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):  # moved at ``seal``, where the modes are off
                    movable_here(o)
            self.offloaded.add(position)

    def alias(self, out: Any) -> None:
        """Keep the outputs of an op of the region that lie on a saved output's storage."""
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.layout == torch.strided and not o.is_inference():
                position = self.storages.get(o.untyped_storage()._cdata)
                if position is not None:
                    self.aliases.setdefault(position, []).append((o, o._version))

    def current(self, position: int) -> tuple[str, Any] | None:
        """The saved output at ``position``, unless it was written in place since it was saved."""
        entry = self.entries.get(position)
        if entry is None:
            return None
        name, saved, versions = entry
        # NOTE [written saved outputs]: a version that moved means the value is no longer the op's
        # output; running the op again gives it exactly.
        if any(a._version != v for a, v in self.aliases.get(position, ())):
            return None
        if isinstance(saved, Moved):
            assert self.offloader is not None
            return None if _moved_written(saved, versions) else (name, _brought_back(saved, self.offloader))
        if _versions(saved) != versions:
            return None
        return name, saved

    def seal(self) -> None:
        """At the end of the forward: forget the outputs written in place during it (they are
        recomputed), keep detached aliases of the others that share their version counters."""
        with _disable_current_modes():
            for position in list(self.entries):
                if self.current(position) is None:
                    del self.entries[position]
                elif position not in self.offloaded:
                    name, out, versions = self.entries[position]
                    self.entries[position] = (name, _detached(out), versions)
            self.storages.clear()
            self.aliases = {
                p: [(aten.version_witness(a), v) for a, v in kept]
                for p, kept in self.aliases.items()
                if p in self.entries
            }
            moving = sorted((p for p in self.offloaded if p in self.entries), reverse=True)
            if moving:
                offloader = self.offloader = self.offloader or Offloader()
                for position in moving:
                    name, out, versions = self.entries[position]
                    self.entries[position] = (name, _moved(out, offloader), versions)


def _versions(out: Any) -> tuple[int, ...]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(o._version for o in outs if isinstance(o, torch.Tensor))


class Moved(NamedTuple):
    """An op's output at home in host memory: per output a parcel, or the tensor itself where it is
    under the offloader's ``min_bytes`` (or not a tensor); ``single`` if the op returned one."""

    items: tuple[Any, ...]
    single: bool
    kind: type


def _moved(out: Any, offloader: Offloader) -> Moved:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    items = tuple(
        offloader.out(o)
        if isinstance(o, torch.Tensor) and offloader.takes(o, demanded=True)
        else _detached(o)
        for o in outs
    )
    return Moved(items, not isinstance(out, (tuple, list)), type(out))


def _moved_written(moved: Moved, versions: tuple[int, ...]) -> bool:
    tensors = [m for m in moved.items if isinstance(m, (Parcel, torch.Tensor))]
    return any(
        m.written() if isinstance(m, Parcel) else m._version != v
        for m, v in zip(tensors, versions, strict=True)
    )


def _brought_back(moved: Moved, offloader: Offloader) -> Any:
    back = [offloader.back(m) if isinstance(m, Parcel) else m for m in moved.items]
    return back[0] if moved.single else moved.kind(back)


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out)
    return out


class Recording(Unguarded):
    """Forward side: run every op, keep the outputs the policy saves."""

    def __init__(self, cache: SaveCache, paths: ModulePaths) -> None:
        super().__init__()
        self.cache, self.paths = cache, paths
        self.position = 0
        self.counts: dict[str, int] = {}
        cache.autocast = _AUTOCAST()  # below autocast's dispatch key it reads as off

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _unpositioned(func, self.cache.autocast):  # see the module's docstring
            return out
        if self.cache.storages:
            self.cache.alias(out)
        decision = self.cache.decision(func, args, kwargs, out, self.paths)
        name = aten.facts(func).name
        n = self.counts[name] = self.counts.get(name, -1) + 1
        if decision is not Decision.RECOMPUTE:
            self.cache.keep(self.position, func, out, decision)
            self.cache.calls[name, n] = self.position
        self.position += 1
        return out

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.cache.seal()


class Replaying(Unguarded):
    """Recomputation side: hand saved outputs back in order, run everything else."""

    def __init__(self, cache: SaveCache, api: str) -> None:
        super().__init__()
        self.cache = cache
        self.api = api
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if _unpositioned(func, self.cache.autocast):
            return func(*args, **(kwargs or {}))
        facts = aten.facts(func)
        name = facts.name
        n = self.counts[name] = self.counts.get(name, -1) + 1
        position = self.cache.calls.get((name, n))
        entry = None if position is None else self.cache.current(position)
        if entry is None:
            return func(*args, **(kwargs or {}))
        if aten.draws(facts, args, kwargs or {}):  # NOTE [no dropout draws nothing]
            # NOTE [kept, run all the same] a kept random op still draws, so that the random ops
            # after it draw what they drew in forward (a kept batch norm does not run: its
            # statistics may be the program's own where the buffer shield does not reach them)
            func(*args, **(kwargs or {}))
        return _detached(entry[1])
