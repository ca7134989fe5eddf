"""The offloader: copy a tensor's bytes to the host pool now, bring them back when they are needed.

Every form of offload in remat (the ``remat.offload`` region, OFFLOAD decisions in
``remat.checkpoint`` and ``remat.scope``, a plan's offloaded tensors) ends here, in two calls::

    parcel = offloader.out(t)      # forward: t's storage -> host buffer; t's device memory can go
    t2 = offloader.back(parcel)    # backward: host buffer -> a new device tensor, equal to t bit for bit

``out`` moves the whole storage of ``t`` (so any strided view comes back with its strides, offset
and dtype) and keeps a weak reference to ``t`` with its version, so a caller can refuse a tensor
written in place after it was moved (``Parcel.written``), as autograd does. The host buffer goes
back to the pool when the parcel dies (autograd frees saved tensors as backward runs).

Copies and streams. On CUDA, ``out`` runs the copy on a side stream that first waits for the
compute stream (the tensor was just made there) and records an event; ``back`` copies into memory
allocated on the side stream after that event, and the compute stream waits only on the event of
the copy it needs (``record_stream`` keeps the caching allocator from reusing either memory too
early). On CPU the copies are plain ``copy_`` calls; no time passes on a link, so the time the
``Link`` model predicts is charged instead (``OffloadStats.d2h_seconds``, ``h2d_seconds``).

Prefetch. Backward needs offloaded tensors in the reverse of the order they were moved out, so after
each ``back`` the offloader starts bringing back the next ``prefetch`` parcels in that order
(parcels older than the one just asked for). On CUDA the copies overlap with backward's compute; on
CPU they are made at once, so the device holds them from then on, as it would on CUDA.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from remat._errors import RematTypeError, RematValueError, message
from remat._units import format_bytes, parse_bytes
from remat.aten import describe
from remat.host.link import Link
from remat.host.pool import HostPool

__all__ = ["OffloadStats", "Offloader", "Parcel", "unmovable"]


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


def unmovable(t: torch.Tensor) -> str | None:
    """Why ``t`` cannot be offloaded, or None if it can: only dense strided tensors of plain type
    on a CPU or CUDA device, without a lazy conjugate or negative bit, have bytes to move."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return f"a tensor subclass ({type(t).__name__})"
    if t.layout is not torch.strided:
        return f"a {t.layout} tensor"
    if t.device.type not in ("cpu", "cuda"):
        return f"a tensor on {t.device}"
    if t.is_conj() or t.is_neg():
        return "a tensor with a lazy conjugate or negative bit"
    if t.is_quantized or t.is_nested:
        return "a quantized or nested tensor"
    return None


class Parcel:
    """A tensor moved to host memory: its bytes there and how to rebuild it on its device."""

    __slots__ = (
        "__weakref__",
        "buffer",
        "device",
        "dtype",
        "index",
        "held",
        "left",
        "offset",
        "read",
        "ready",
        "size",
        "served",
        "source",
        "stride",
        "uses",
        "version",
    )

    def __init__(self, t: torch.Tensor, index: int, buffer: torch.Tensor) -> None:
        self.index = index
        self.buffer = buffer
        self.device = t.device
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.source = weakref.ref(t)
        self.version = t._version
        self.ready: torch.cuda.Event | None = None  # on CUDA: the copy out has finished
        self.read: list[torch.cuda.Event | None] = [None]  # on CUDA: the last copy back has finished
        # NOTE [moved once, read twice]: autograd often saves one tensor for two nodes (a linear's
        # input is the activation's output). ``out`` then returns the same parcel and counts a use;
        # the first ``back`` of a backward keeps its copy for the other uses, so the bytes cross
        # the link once each way, and the device holds them as long as without offload.
        self.uses = 1
        self.held: torch.Tensor | None = None
        self.left = 0
        self.served = -2  # the autograd graph task of the last ``back`` (-1: outside backward)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def written(self) -> bool:
        """Whether the tensor moved out is still alive and was written in place since."""
        source = self.source()
        return source is not None and source._version != self.version

    def __repr__(self) -> str:
        return f"Parcel({describe(self.dtype, self.size)} on {self.device}, {format_bytes(self.nbytes)})"


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
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise RematValueError(
                message(
                    "offload",
                    "prefetch must be a whole number of tensors, 0 or more",
                    f"got {prefetch!r}",
                    "pass e.g. prefetch=2",
                )
            )
        self.link = Link() if link is None else link
        self.prefetch = prefetch
        self.min_bytes = 0 if min_bytes in (0, "0") else parse_bytes(min_bytes, "offload")
        self.pool = HostPool(None if host_budget is None else parse_bytes(host_budget, "offload"))
        self._lock = threading.RLock()
        self._next = 0
        self._live: list[int] = []  # indices of the parcels alive, in the order they moved out
        self._parcels: dict[int, weakref.ref[Parcel]] = {}
        self._ahead: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._same: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], weakref.ref[Parcel], int]] = {}
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
    def out(self, t: torch.Tensor) -> Parcel:
        """Copy ``t``'s storage to the host pool. The same tensor moved twice (unchanged) gives the
        same parcel. Raises for a tensor that cannot move (``unmovable``)."""
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
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.dtype, t.size(), t.stride(), t.storage_offset(), t.device)
        with self._lock:
            known = self._same.get(key)
            if known is not None:
                source, parcel_ref, version = known
                parcel = parcel_ref()
                if parcel is not None and source() is t and t._version == version:
                    parcel.uses += 1
                    return parcel
            nbytes = storage.nbytes()
            on_cuda = t.device.type == "cuda"
            buffer = self.pool.take(nbytes, pinned=on_cuda)
            parcel = Parcel(t, self._next, buffer)
            self._next += 1
            self._live.append(parcel.index)
            self._parcels[parcel.index] = weakref.ref(parcel)
            self._same[key] = (weakref.ref(t), weakref.ref(parcel), t._version)
            weakref.finalize(parcel, self._forget, parcel.index, key, buffer, on_cuda, parcel.read)
            self._charge(moved=1, bytes_out=nbytes, d2h_seconds=self.link.d2h_seconds(nbytes))
        raw = torch.empty((0,), dtype=torch.uint8, device=t.device).set_(storage)
        if on_cuda:
            side = self._side(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                buffer.copy_(raw, non_blocking=True)
                parcel.ready = torch.cuda.Event()
                parcel.ready.record(side)
            raw.record_stream(side)  # the device memory is not reused before the copy is done
        else:
            buffer.copy_(raw)
        return parcel

    # back --------------------------------------------------------------------------------------
    def back(self, parcel: Parcel) -> torch.Tensor:
        """A new device tensor equal to the one moved out (shape, strides, dtype, bits), from a
        prefetched copy if one is ready; then start the next prefetches."""
        with self._lock:
            parcel.served = torch._C._current_graph_task_id()
            data = parcel.held
            if data is not None:  # NOTE [moved once, read twice]
                parcel.left -= 1
                if parcel.left <= 0:
                    parcel.held = None
                return _rebuilt(data, parcel)
            ahead = self._ahead.pop(parcel.index, None)
        data, done = ahead if ahead is not None else self._copy_back(parcel, prefetch=False)
        if done is not None:
            compute = torch.cuda.current_stream(parcel.device)
            compute.wait_event(done)  # only on the copy this tensor needs
            data.record_stream(compute)
        if parcel.uses > 1:
            parcel.held, parcel.left = data, parcel.uses - 1
        self._prefetch_before(parcel.index)
        return _rebuilt(data, parcel)

    def _copy_back(self, parcel: Parcel, prefetch: bool) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        nbytes = parcel.nbytes
        with self._lock:
            self._charge(
                bytes_back=nbytes, h2d_seconds=self.link.h2d_seconds(nbytes), prefetched=int(prefetch)
            )
        if parcel.device.type != "cuda":
            data = torch.empty((nbytes,), dtype=torch.uint8, device=parcel.device)
            data.copy_(parcel.buffer)
            return data, None
        side = self._side(parcel.device)
        if parcel.ready is not None:
            side.wait_event(parcel.ready)
        with torch.cuda.stream(side):
            data = torch.empty((nbytes,), dtype=torch.uint8, device=parcel.device)
            data.copy_(parcel.buffer, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        parcel.read[0] = done  # the buffer is reused only after this copy
        return data, done

    def _prefetch_before(self, index: int) -> None:
        if self.prefetch == 0:
            return
        with self._lock:
            task = torch._C._current_graph_task_id()
            at = bisect.bisect_left(self._live, index)
            parcels: list[Parcel] = []
            in_flight = 0
            # Backward's order is not always the reverse of the forward's (branches, a tensor saved
            # twice): one already brought back in this backward is skipped, not fetched again.
            for i in reversed(self._live[max(at - 4 * self.prefetch, 0) : at]):
                parcel = self._parcels[i]()
                if parcel is None or parcel.served == task:
                    continue
                if i not in self._ahead:
                    parcels.append(parcel)
                in_flight += 1
                if in_flight == self.prefetch:
                    break
        for parcel in parcels:
            copy = self._copy_back(parcel, prefetch=True)
            with self._lock:
                self._ahead[parcel.index] = copy

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
        key: tuple[Any, ...],
        buffer: torch.Tensor,
        pinned: bool,
        read: list[torch.cuda.Event | None],
    ) -> None:
        with self._lock:
            self._parcels.pop(index, None)
            self._ahead.pop(index, None)
            at = bisect.bisect_left(self._live, index)
            if at < len(self._live) and self._live[at] == index:
                del self._live[at]
            known = self._same.get(key)
            if known is not None and known[1]() is None:
                del self._same[key]
        self.pool.give(buffer, pinned, read[0])


def _rebuilt(data: torch.Tensor, parcel: Parcel) -> torch.Tensor:
    return torch.empty((0,), dtype=parcel.dtype, device=parcel.device).set_(
        data.untyped_storage(), parcel.offset, parcel.size, parcel.stride
    )
