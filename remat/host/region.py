"""``remat.offload``: a block of code whose tensors saved for backward wait in host memory.

Like ``torch.autograd.graph.save_on_cpu``, but selective, with prefetch and a reused host pool::

    with remat.offload(min_bytes="1MiB", prefetch=2) as offloader:
        loss = model(x).sum()
    loss.backward()            # offloaded tensors come back just before their backward op
    print(offloader.stats())

A dispatch mode notes the storage each op of the block makes and what the policy decides for it;
the saved-tensor pack hook then moves a saved tensor to the host pool when its storage was made
inside the block, was decided OFFLOAD and holds at least ``min_bytes``. Everything else stays on
the device: parameters, buffers and the block's inputs (made outside it; moving them frees
nothing), small tensors, and tensors that cannot move (sparse, meta, subclasses) — those are an
error only when a policy demanded OFFLOAD for them. Without a policy, every tensor made inside the
block is a candidate; with one, only OFFLOAD decisions are (SAVE and RECOMPUTE both keep: the
block runs once, there is nothing to recompute from; use ``remat.checkpoint`` or ``remat.scope``
with the same policy for that).

A saved tensor written in place after the block saved it is refused at backward, as autograd
refuses it without hooks (hooks turn autograd's own check off).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

import torch

from remat import aten
from remat._dispatch import Unguarded, saved_hooks
from remat._errors import RecomputationError, message
from remat._module_path import ModulePaths
from remat._reusable import reusable
from remat.aten import describe, version_witness
from remat.host.link import Link
from remat.host.offloader import Offloader
from remat.host.parcel import Parcel, unmovable
from remat.manual.plainly import plain
from remat.manual.traced import transformed
from remat.policy import Decision, OpContext, Policy, checked, decided

__all__ = ["offload"]


class Kept(NamedTuple):
    """A saved tensor left on the device, and its version when autograd saved it."""

    tensor: torch.Tensor
    version: int


def _owner(t: torch.Tensor) -> tuple[Hashable, Any]:
    """What holds ``t``'s memory, as a key and the object to compare with it: its storage for a
    dense tensor, the tensor itself for anything else (sparse, meta, a subclass)."""
    if unmovable(t) is None:
        storage = t.untyped_storage()
        return (t.device, storage.data_ptr()), storage
    return id(t), t


class Makers(Unguarded):
    """Notes the memory the block's ops make, by storage (so a view counts as what it views), with
    the policy's decision for each op."""

    def __init__(self, policy: Policy | None, paths: ModulePaths | None = None) -> None:
        super().__init__()
        self.policy, self.paths = policy, paths
        self.made: dict[Hashable, tuple[weakref.ref[Any], Decision]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        info = aten.facts(func)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        fresh = [
            o
            for i, o in enumerate(outs)
            if isinstance(o, torch.Tensor) and (i >= len(info.fresh_returns) or info.fresh_returns[i])
        ]
        if info.packet in aten.UNSAID_VIEWS:  # a new tensor on an argument's storage (``_unsafe_view``
            # after a 3-D linear's ``mm``): the storage keeps the decision of the op that made it
            fresh = [o for o in fresh if aten.sharing(o, args) < 0]
        if not fresh:
            return out
        decision = Decision.OFFLOAD
        if self.policy is not None:
            ctx = OpContext(
                op=info.name,
                packet=info.packet,
                module=self.paths.now() if self.paths is not None else "",
                out_bytes=sum(o.nbytes for o in fresh if o.layout is torch.strided),
                random=info.random,
                overload=func,
                args=args,
                kwargs=kwargs,
            )
            decision = decided(self.policy, ctx)
        for o in fresh:
            key, owner = _owner(o)
            self.made[key] = (weakref.ref(owner), decision)
        return out

    def decision(self, t: torch.Tensor) -> Decision | None:
        """What the policy decided for the op that made ``t``'s memory; None if made outside."""
        key, owner = _owner(t)
        entry = self.made.get(key)
        if entry is None or entry[0]() is not owner:
            return None
        return entry[1]


class Later:
    """A saved tensor to move once the op that saved it has run (NOTE [moved after its op])."""

    __slots__ = ("node", "parcel", "tensor", "version", "witness")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = t
        self.version = t._version
        self.witness = version_witness(t)  # in the pack hook: its counter (``Parcel.witness``)
        self.node = _next_node()  # the autograd node the next op makes, as the save happened
        self.parcel: Parcel | None = None


class Around(NamedTuple):
    """A saved tensor an inner block handed to the block around it (NOTE [nested blocks])."""

    region: OffloadRegion
    packed: Kept | Later | Around


class OffloadRegion:
    """The pack and unpack hooks of one ``with remat.offload()`` block.

    NOTE [moved after its op] Autograd saves an op's inputs before the op runs, and an op may write
    what it saved without moving its version (RReLU fills the noise it saved): a copy taken at the
    save would hold what the memory held before. So a tensor to move waits, held, until a later
    save by an op whose autograd node was made after it (the saving op is over by then, its
    version counted; the inputs the op now saving was given were saved after its node was made,
    and wait on), or the block ends, or backward asks for it (``flush``: all three run where
    autograd runs, so the parcel's witness shares the tensor's version counter). Its version at the
    save is the one backward checks."""

    def __init__(self, makers: Makers, offloader: Offloader, demanded: bool) -> None:
        self.makers = makers
        self.offloader = offloader
        self.demanded = demanded
        self.later: list[Later] = []
        self.outer = enclosing()  # NOTE [nested blocks]

    def pack(self, t: torch.Tensor) -> Kept | Later | Around:
        if self.later:  # what was saved before the newest node was made: its op is over
            self.flush(_next_node())
        decision = self.makers.decision(t)
        if decision is None and self.outer is not None:
            return Around(self.outer, self.outer.pack(t))
        if decision is not Decision.OFFLOAD or not self.offloader.takes(t, self.demanded):
            return Kept(t, t._version)
        base = t if t._base is None else t._base
        if base.is_leaf and base.requires_grad:  # a parameter made in the block (a lazy module's
            return Kept(t, t._version)  # first forward), or a view of one (``weight.t()``): it stays
        self.offloader.check(t)
        self.later.append(later := Later(t))
        return later

    def flush(self, before: int | None = None) -> None:
        """Move the saved tensors waiting (NOTE [moved after its op]); with ``before`` (the number the
        next node gets now), those saved before the newest node was made."""
        waiting = [w for w in self.later if before is None or w.node < before]
        self.later = [w for w in self.later if not (before is None or w.node < before)]
        for later in waiting:
            assert later.tensor is not None
            later.parcel = self.offloader.out(later.tensor, later.witness, follows=True)
            later.parcel.version = later.version
            later.tensor = None

    def unpack(self, packed: Kept | Later | Around) -> torch.Tensor:
        if isinstance(packed, Around):  # back through the block, and offloader, that packed it
            return packed.region.unpack(packed.packed)
        if isinstance(packed, Kept):
            if packed.tensor._version != packed.version:
                raise _written(describe(packed.tensor.dtype, packed.tensor.shape))
            return packed.tensor
        if packed.parcel is None:
            self.flush()
        assert packed.parcel is not None
        return self._back(packed.parcel)

    def _back(self, packed: Parcel) -> torch.Tensor:
        if packed.written():
            raise _written(describe(packed.dtype, packed.size))
        return self.offloader.back(packed)  # from the device while the program holds it
        # (NOTE [read where it lives])


def enclosing() -> OffloadRegion | None:
    """The ``remat.offload`` block whose saved-tensor hooks are the innermost now, if any.

    NOTE [nested blocks] A tensor made around a block and saved inside it (a layer's input saved by
    its first matmul) is the business of the block that made it: an inner ``remat.offload`` block
    hands such a tensor to the ``remat.offload`` block right around it, whose policy moves it as it
    would have without the inner block. Only a ``remat.offload`` block directly around: other
    saved-tensor hooks in between (a checkpoint's) own what their region saves."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    owner = getattr(top[0], "__self__", None) if top else None
    return owner if isinstance(owner, OffloadRegion) else None


def _next_node() -> int:
    """The number the next autograd node gets (a large one where torch cannot tell: then every
    tensor waits for the block's end or its backward)."""
    found = aten.next_node()
    return 1 << 62 if found is None else found


def _written(what: str) -> RecomputationError:
    return RecomputationError(
        message(
            "offload",
            "a tensor saved for backward was modified in place after it was saved",
            what,
            "clone it before modifying it, or use the out-of-place op",
        )
    )


@reusable
def offload(
    policy: Policy | None = None,
    *,
    min_bytes: int | str = 0,
    prefetch: int = 2,
    link: Link | None = None,
    host_budget: int | str | None = None,
) -> Iterator[Offloader]:
    """Move what the block saves for backward to host memory; bring it back in backward.

    ``policy``: which ops' outputs to move (``Decision.OFFLOAD``, e.g. ``remat.policy.OffloadLarger``);
    None moves every tensor the block makes. ``min_bytes``: smaller tensors stay. ``prefetch``:
    tensors brought back ahead, in backward order. ``link``: the link model that charges time on CPU.
    ``host_budget``: the bytes host memory may hold; offloading past it raises
    ``RematRuntimeError`` (NOTE [host budget] in ``remat.host.pool``). Yields the ``Offloader``
    (``.stats()``), which ``remat.checkpoint`` and ``remat.scope`` also take as ``offloader=``.
    With grad disabled, in inference mode, or under a ``torch.func`` transform or forward-mode AD, the
    block runs as is.
    """
    policy = checked("offload", policy)
    offloader = Offloader(link=link, prefetch=prefetch, host_budget=host_budget, min_bytes=min_bytes)
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled() or plain() or transformed():
        yield offloader
        return
    makers = Makers(policy, ModulePaths() if policy is not None else None)
    region = OffloadRegion(makers, offloader, demanded=policy is not None)
    hooks: Any = saved_hooks(region.pack, region.unpack)
    try:
        with makers, hooks:
            yield offloader
    finally:
        region.flush()
