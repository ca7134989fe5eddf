"""What a tensor moved to host memory is while it waits: the bytes of its storage there
(``Cargo``, shared by every view of the storage) and how to rebuild the tensor from them
(``Parcel``); which tensors can move at all (``unmovable``). The ``Offloader``
(``remat.host.offloader``) makes and reads them."""

from __future__ import annotations

import weakref

import torch

from remat._units import format_bytes
from remat.aten import describe, version_witness

__all__ = ["Cargo", "Parcel", "rebuilt", "unmovable"]


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
    if t._is_zerotensor():  # forward-mode AD's implicit zeros: no memory at all
        return "an implicit zero tensor"
    return None


class Cargo:
    """The bytes of one storage in host memory, shared by the parcels of every view of it."""

    __slots__ = (
        "__weakref__",
        "buffer",
        "device",
        "follows",
        "held",
        "index",
        "left",
        "lived",
        "read",
        "ready",
        "served",
        "storage",
        "uses",
    )

    def __init__(
        self, index: int, buffer: torch.Tensor, storage: torch.UntypedStorage, follows: bool
    ) -> None:
        self.index = index
        self.buffer = buffer
        self.device = storage.device
        # NOTE [read where it lives]: the device storage moved out, while something else holds it,
        # and whether every parcel of the cargo reads it from there
        self.storage = weakref.ref(storage)
        self.follows = follows
        self.ready: torch.cuda.Event | None = None  # on CUDA: the copy out has finished
        self.read: list[torch.cuda.Event | None] = [None]  # on CUDA: the last copy has finished
        # NOTE [moved once, read twice]: autograd often saves one tensor for two nodes (a linear's
        # input is the activation's output), or views of one storage (attention's query, key and
        # value). ``out`` then reuses the cargo and counts a use; the first ``back`` of a backward
        # keeps its copy for the other uses, so the bytes cross the link once each way, and the
        # device holds them as long as without offload.
        self.uses = 1
        self.held: torch.Tensor | None = None
        self.left = 0
        self.served = -2  # the autograd graph task of the last ``back`` (-1: outside backward)
        self.lived = 0  # reads of that backward from the device storage (NOTE [read where it lives])

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def on_device(self) -> torch.UntypedStorage | None:
        """The device storage moved out, where every parcel reads it from there and the program
        still holds it whole; else None."""
        if not self.follows:
            return None
        storage = self.storage()
        return storage if storage is not None and storage.nbytes() == self.nbytes else None


class Parcel:
    """A tensor moved to host memory: its storage's bytes there (``cargo``) and how to rebuild it;
    ``follows``: read from the device storage while it lives (NOTE [read where it lives])."""

    __slots__ = ("cargo", "dtype", "follows", "offset", "size", "source", "stride", "version", "witness")

    def __init__(
        self, t: torch.Tensor, cargo: Cargo, witness: torch.Tensor | None = None, follows: bool = False
    ) -> None:
        self.cargo = cargo
        self.follows = follows
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.source = weakref.ref(t)
        self.version = t._version
        # a witness of its version counter, which tells of a write also once the tensor is gone:
        # made where autograd runs (a pack hook) it shares the counter; inside a dispatch mode
        # ``detach`` makes a counter of its own that never moves, and only ``source`` tells
        self.witness = version_witness(t) if witness is None else witness

    @property
    def nbytes(self) -> int:
        return self.cargo.nbytes

    def written(self) -> bool:
        """Whether the tensor moved out was written in place since: while it is alive, or through
        its witness once it is gone."""
        source = self.source()
        if source is not None and source._version != self.version:
            return True
        return self.witness._version != self.version

    def __repr__(self) -> str:
        where = self.cargo.device
        return f"Parcel({describe(self.dtype, self.size)} on {where}, {format_bytes(self.nbytes)})"


def rebuilt(storage: torch.UntypedStorage, parcel: Parcel) -> torch.Tensor:
    return torch.empty((0,), dtype=parcel.dtype, device=storage.device).set_(
        storage, parcel.offset, parcel.size, parcel.stride
    )
