"""The offloader: copy a tensor's bytes to the host pool now, bring them back when they are needed.

Every form of offload in remat (the ``remat.offload`` region, OFFLOAD decisions in
``remat.checkpoint`` and ``remat.scope``, a plan's offloaded tensors) ends here, in two calls::

    parcel = offloader.out(t)      # forward: t's storage -> host buffer; t's device memory can go
    t2 = offloader.back(parcel)    # backward: host buffer -> a device tensor, equal to t bit for bit

``out`` moves the whole storage of ``t`` (so any strided view comes back with its strides, offset
and dtype) into a ``Cargo``, which every parcel of a view of that storage shares while the storage
is unchanged: the bytes cross once however many views autograd saves (a view on a version counter
of its own moves its own bytes: NOTE [a view on a counter of its own]). A parcel keeps a weak
reference to ``t`` with its version, so a caller can refuse a tensor written in place after it was
moved (``Parcel.written``), as autograd does. The host buffer goes back to the pool when the last
parcel of its cargo dies (autograd frees saved tensors as backward runs).

Copies and streams. On CUDA, ``out`` runs the copy on a side stream that first waits for the
compute stream (the tensor was just made there) and records an event; ``back`` copies into memory
allocated on the side stream after that event, and the compute stream waits only on the event of
the copy it needs (``record_stream`` keeps the caching allocator from reusing either memory too
early). On CPU the copies are plain ``copy_`` calls; no time passes on a link, so the time the
``Link`` model predicts is charged instead (``OffloadStats.d2h_seconds``, ``h2d_seconds``).

Prefetch. Backward needs offloaded tensors in the reverse of the order they were moved out, so after
each ``back`` the offloader starts bringing back the next ``prefetch`` cargos in that order (older
than the one just asked for, not yet brought back in this backward, and whose storage the program
no longer holds: NOTE [read where it lives] in ``back``). On CUDA the copies overlap
with backward's compute; on CPU they are made at once, so the device holds them from then on, as it
would on CUDA.
"""

from __future__ import annotations

import bisect
import numbers
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from remat._errors import RematRuntimeError, RematTypeError, RematValueError, message
from remat._units import format_bytes, parse_bytes, parse_size
from remat.aten import describe, same_counter, version_witness
from remat.host.link import Link
from remat.host.parcel import Cargo, Parcel, rebuilt, unmovable
from remat.host.pool import HostPool

__all__ = ["OffloadStats", "Offloader", "movable_here"]


@dataclass(frozen=True)
class OffloadStats:
    """What an offloader did: tensors moved out, bytes each way (prefetches included), the time the
    link model predicts for those copies, copies made ahead by prefetch, and the host pool's peak."""

    moved: int = 0
    bytes_out: int = 0
    bytes_back: int = 0
    d2h_seconds: float = 0.0
    h2d_seconds: float = 0.0
    prefetched: int = 0
    host_peak_bytes: int = 0

    def __str__(self) -> str:
        return (
            f"offloaded {self.moved} tensors, {format_bytes(self.bytes_out)} out "
            f"({self.d2h_seconds * 1e3:.3f} ms), {format_bytes(self.bytes_back)} back "
            f"({self.h2d_seconds * 1e3:.3f} ms), {self.prefetched} prefetched, host peak "
            f"{format_bytes(self.host_peak_bytes)}"
        )


_Moved = tuple[weakref.ref[Any], weakref.ref[Cargo], int, torch.Tensor, weakref.ref[torch.Tensor]]


class Offloader:
    """Moves tensors to a host pool and back (see the module's docstring).

    ``link``: the link model that charges time on CPU (default ``remat.Link()``). ``prefetch``: how
    many parcels to bring back ahead, in backward order. ``host_budget``: bytes the host pool may hold
    (a size such as ``"8GiB"``), None for no limit; past it ``out`` raises. ``min_bytes``: tensors
    smaller than this stay on the device (``takes``).
    """

    def __init__(
        self,
        link: Link | None = None,
        prefetch: int = 2,
        host_budget: int | str | None = None,
        min_bytes: int | str = 0,
    ) -> None:
        if link is not None and not isinstance(link, Link):
            raise RematTypeError(
                message(
                    "offload", "link must be a remat.Link", f"got {link!r}", 'pass remat.Link(d2h="25GB/s")'
                )
            )
        whole = isinstance(prefetch, numbers.Integral) and not isinstance(prefetch, bool)  # numpy's too
        if not whole or int(prefetch) < 0:
            raise RematValueError(
                message(
                    "offload",
                    "prefetch must be a whole number of tensors, 0 or more",
                    f"got {prefetch!r}",
                    "pass e.g. prefetch=2",
                )
            )
        self.link = Link() if link is None else link
        self.prefetch = int(prefetch)
        self.min_bytes = parse_size(min_bytes, "offload")
        self.pool = HostPool(None if host_budget is None else parse_bytes(host_budget, "offload"))
        self._lock = threading.RLock()
        self._next = 0
        self._live: list[int] = []  # indices of the cargos alive, in the order they moved out
        self._cargos: dict[int, weakref.ref[Cargo]] = {}
        self._ahead: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        # (device, storage address) -> its latest copy: the storage, the cargo, and the version and
        # counter of the tensor copied: a witness (``remat.aten.version_witness``), and the tensor
        # while it lives (moved inside a dispatch mode, as the tape moves, the witness has a counter
        # of its own, and only the tensor tells that a view of it saved later shares its counter)
        self._same: dict[tuple[Any, ...], _Moved] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._stats = OffloadStats()

    def takes(self, t: torch.Tensor, demanded: bool) -> bool:
        """Whether to move ``t``: when it holds at least ``min_bytes``. One that cannot move
        (``unmovable``) is taken only when a policy ``demanded`` it, so that ``out`` refuses it
        with a clear error; otherwise it stays."""
        if unmovable(t) is not None:
            return demanded
        return t.untyped_storage().nbytes() >= max(self.min_bytes, 1)

    def stats(self) -> OffloadStats:
        """What the offloader did so far."""
        with self._lock:
            return replace(self._stats, host_peak_bytes=self.pool.peak_bytes)

    # out ---------------------------------------------------------------------------------------
    def check(self, t: torch.Tensor) -> None:
        """Raise the error ``out`` raises for a tensor that cannot move (``unmovable``), without
        moving anything."""
        reason = unmovable(t)
        if reason is not None:
            raise RematValueError(
                message(
                    "offload",
                    "this tensor cannot be moved to host memory",
                    f"{reason}: {describe(t.dtype, t.shape)}",
                    "keep it on the device: decide SAVE or RECOMPUTE for the op that makes it",
                )
            )

    def out(self, t: torch.Tensor, witness: torch.Tensor | None = None, follows: bool = False) -> Parcel:
        """Copy ``t``'s storage to the host pool. The same tensor moved twice (unchanged) gives the
        same parcel. Raises for a tensor that cannot move (``check``). ``witness``: ``t``'s version
        witness, made where autograd runs, for the parcel (else it makes one). ``follows``: ``back``
        reads the device storage instead of the copy while the program still holds it (NOTE [read
        where it lives]): for a caller whose backward reads what autograd's saved tensor would."""
        self.check(t)
        movable_here(t)
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        with self._lock:
            known = self._same.get(key)
            if known is not None:  # the same content only if written by nothing since, views and
                # all: the results of ``unsafe_chunk`` on one storage each have a counter of their own
                storage_ref, cargo_ref, version, counter, tensor_ref = known
                cargo, moved = cargo_ref(), tensor_ref()
                same = cargo is not None and storage_ref() is storage and t._version == version
                shared = same and (same_counter(counter, t) or (moved is not None and same_counter(moved, t)))
                if shared and cargo is not None:
                    cargo.uses += 1
                    cargo.follows = cargo.follows and follows
                    return Parcel(t, cargo, witness, follows)
                if same:  # another counter on a storage moved whole: this view's bytes alone
                    return self._compact(t, witness)
            cargo = self._moved(storage, follows, key)
            self._same[key] = (
                weakref.ref(storage),
                weakref.ref(cargo),
                t._version,
                version_witness(t),
                weakref.ref(t),
            )
        return Parcel(t, cargo, witness, follows)

    def _moved(self, storage: torch.UntypedStorage, follows: bool, key: tuple[Any, ...] | None) -> Cargo:
        """A new cargo of ``storage``'s bytes, on its way to host memory; ``key``: where ``out``
        finds it again (None: nowhere). Called under the lock: another thread's prefetch or parcel
        of the same storage finds the cargo only once its bytes are on their way (on CUDA, behind
        the recorded event)."""
        nbytes, on_cuda = storage.nbytes(), storage.device.type == "cuda"
        buffer = self.pool.take(nbytes, pinned=on_cuda)
        cargo = Cargo(self._next, buffer, storage, follows)
        self._next += 1
        self._live.append(cargo.index)
        self._cargos[cargo.index] = weakref.ref(cargo)
        weakref.finalize(cargo, self._forget, cargo.index, key, buffer, on_cuda, cargo.read)
        self._charge(moved=1, bytes_out=nbytes, d2h_seconds=self.link.d2h_seconds(nbytes))
        self._copy_out(cargo, storage)
        return cargo

    def _compact(self, t: torch.Tensor, witness: torch.Tensor | None) -> Parcel:
        """NOTE [a view on a counter of its own] The results of ``unsafe_chunk`` and
        ``unsafe_split`` view one storage, each on a version counter of its own: a write through
        one is not seen by the others', so a view cannot share the host copy of the whole storage
        another moved. Copying the whole storage again for each (three times a fused projection's
        output for a query, a key and a value) took more memory than keeping them on the device;
        such a view moves its own bytes alone, and comes back contiguous. Called under the lock."""
        alone = t.detach().clone(memory_format=torch.contiguous_format)
        parcel = Parcel(t, self._moved(alone.untyped_storage(), False, None), witness)
        parcel.stride, parcel.offset = alone.stride(), 0  # where it sits in the copy
        return parcel

    def refill(self, parcel: Parcel, t: torch.Tensor) -> None:
        """Copy ``t``'s storage to ``parcel``'s host bytes again: an op wrote it after it moved
        without moving its version (RReLU fills the noise autograd saved before it ran), and
        backward reads what the op left. Not counted again in the stats."""
        storage = t.untyped_storage()
        if parcel.cargo.buffer.numel() == storage.nbytes():
            self._copy_out(parcel.cargo, storage)

    def _copy_out(self, cargo: Cargo, storage: torch.UntypedStorage) -> None:
        raw = torch.empty((0,), dtype=torch.uint8, device=cargo.device).set_(storage)
        if cargo.device.type == "cuda":
            side = self._side(cargo.device)
            side.wait_stream(torch.cuda.current_stream(cargo.device))
            with torch.cuda.stream(side):
                cargo.buffer.copy_(raw, non_blocking=True)
                cargo.ready = torch.cuda.Event()
                cargo.ready.record(side)
            cargo.read[0] = cargo.ready  # a buffer freed unread is reused after this copy
            raw.record_stream(side)  # the device memory is not reused before the copy is done
        else:
            cargo.buffer.copy_(raw)

    # back --------------------------------------------------------------------------------------
    def back(self, parcel: Parcel) -> torch.Tensor:
        """A new device tensor equal to the one moved out (shape, strides, dtype, bits), from a
        prefetched copy if one is ready; then start the next prefetches.

        NOTE [read where it lives] A parcel that ``follows`` its storage (``remat.offload``'s) is
        read from the device storage itself while the program still holds that storage (a
        tensor it keeps, or the base of a view autograd saved): a copy would sit beside the
        bytes it copies, and autograd's own saved tensor would read that storage too. Prefetch
        skips such cargos while their storage lives."""
        cargo = parcel.cargo
        live = cargo.on_device() if parcel.follows else None
        with self._lock:
            task = torch._C._current_graph_task_id()
            if cargo.served != task:  # a new backward: no read from the device storage yet
                cargo.lived = 0
            cargo.served = task
        if live is not None:
            with self._lock:
                cargo.lived += 1
            self._prefetch_before(cargo.index)
            return rebuilt(live, parcel)
        with self._lock:
            data = cargo.held
            if data is not None:  # NOTE [moved once, read twice]
                cargo.left -= 1
                if cargo.left <= 0:
                    cargo.held = None
                return rebuilt(data.untyped_storage(), parcel)
            ahead = self._ahead.pop(cargo.index, None)
        data, done = ahead if ahead is not None else self._copy_back(cargo, prefetch=False)
        if done is not None:
            compute = torch.cuda.current_stream(cargo.device)
            compute.wait_event(done)  # only on the copy this tensor needs
            data.record_stream(compute)
        if cargo.uses > 1 + cargo.lived:  # held for the reads left (some may have read the device's)
            cargo.held, cargo.left = data, cargo.uses - 1 - cargo.lived
        self._prefetch_before(cargo.index)
        return rebuilt(data.untyped_storage(), parcel)

    def _copy_back(self, cargo: Cargo, prefetch: bool) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        nbytes = cargo.nbytes
        with self._lock:
            self._charge(
                bytes_back=nbytes, h2d_seconds=self.link.h2d_seconds(nbytes), prefetched=int(prefetch)
            )
        if cargo.device.type != "cuda":
            data = torch.empty((nbytes,), dtype=torch.uint8, device=cargo.device)
            data.copy_(cargo.buffer)
            return data, None
        side = self._side(cargo.device)
        if cargo.ready is not None:
            side.wait_event(cargo.ready)
        with torch.cuda.stream(side):
            data = torch.empty((nbytes,), dtype=torch.uint8, device=cargo.device)
            data.copy_(cargo.buffer, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        cargo.read[0] = done  # the buffer is reused only after this copy
        return data, done

    def _prefetch_before(self, index: int) -> None:
        if self.prefetch == 0:
            return
        with self._lock:
            task = torch._C._current_graph_task_id()
            at = bisect.bisect_left(self._live, index)
            cargos: list[Cargo] = []
            in_flight = 0
            # Backward's order is not always the reverse of the forward's (branches, a tensor saved
            # twice): one already brought back in this backward is skipped, not fetched again.
            for i in reversed(self._live[max(at - 4 * self.prefetch, 0) : at]):
                cargo = self._cargos[i]()
                if cargo is None or cargo.served == task or cargo.on_device() is not None:
                    continue
                if i not in self._ahead:
                    cargos.append(cargo)
                in_flight += 1
                if in_flight == self.prefetch:
                    break
        for cargo in cargos:
            copy = self._copy_back(cargo, prefetch=True)
            with self._lock:
                self._ahead[cargo.index] = copy

    # bookkeeping -------------------------------------------------------------------------------
    def _side(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _charge(self, **add: float) -> None:
        self._stats = replace(
            self._stats, **{name: getattr(self._stats, name) + value for name, value in add.items()}
        )

    def _forget(
        self,
        index: int,
        key: tuple[Any, ...] | None,  # None: a cargo of one view (NOTE [a view on a counter of its own])
        buffer: torch.Tensor,
        pinned: bool,
        read: list[torch.cuda.Event | None],
    ) -> None:
        with self._lock:
            self._cargos.pop(index, None)
            self._ahead.pop(index, None)
            at = bisect.bisect_left(self._live, index)
            if at < len(self._live) and self._live[at] == index:
                del self._live[at]
            known = self._same.get(key) if key is not None else None
            if key is not None and known is not None and known[1]() is None:
                del self._same[key]
        self.pool.give(buffer, pinned, read[0])


def movable_here(t: torch.Tensor) -> None:
    """Raise where ``t`` is made inside ``remat.dynamic``, whose runtime evicts and moves the
    storages an offloader would copy (its dispatch mode says so: ``owns_storages``)."""
    if any(getattr(mode, "owns_storages", False) for mode in _get_current_dispatch_mode_stack()):
        raise RematRuntimeError(
            message(
                "offload",
                "nothing moves to host memory inside remat.dynamic, whose runtime evicts and moves "
                "the storages an offloader would copy",
                f"{describe(t.dtype, t.shape)} to offload",
                "let the region swap its victims to the host (remat.dynamic(..., swap=remat.Link())), "
                "or offload outside the region",
            )
        )
