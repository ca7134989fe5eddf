"""Where the content of each resident storage of the core lives, and how it leaves and comes back.

The core (:mod:`remat.core.runtime`) thinks in storages: versions of a piece of memory. The program
thinks in PyTorch storages (``UntypedStorage``): every tensor, view and tensor autograd saved for
backward points at one, and none of them may change identity when the content is evicted. So the
content is moved *under* the storage: evicting swaps its data pointer with a null one of the same
size (NOTE [ghosts]; the memory goes back to the allocator while every tensor object stays valid),
restoring swaps freshly computed memory in (:func:`swap`: no copy).

A core storage is held either by the *program storage* of a handle (the current version of a
storage the program can read) or, when it is an older version or the program has dropped every
tensor on it, by a *private* storage that only recomputations read.

NOTE [real bytes] ``real_bytes`` adds up ``nbytes()`` of the real storages as they are handed over,
emptied and dropped: a count of the memory the runtime holds that does not come from the pool's
own bookkeeping, so that tests can hold the two against each other.

NOTE [alignment] The core counts each storage rounded up to 64 bytes, as PyTorch's CPU allocator
aligns its blocks, and a region's pool holds a multiple of 64 bytes: in the arena every block then
starts on a 64-byte boundary, placed from the low end or from the high end (Coop), which vectorized
kernels need to sum in the order they do on memory from the allocator (a block 16 bytes off put a
Coop step's gradients 1e-9 off the plain step's; tests/dynamic/test_dynamic_aligned.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from remat._errors import RematRuntimeError, message

ALIGNMENT = 64


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the allocator's alignment (NOTE [alignment])."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def swappable() -> bool:
    """Whether this torch can exchange two storages' memory (``UntypedStorage._swap_data_ptr_``:
    torch 2.13 has it, 2.11 does not), which eviction and restoring are made of."""
    return hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def require_swap(api: str) -> None:
    """Raise a clear error where this torch cannot swap storages (``swappable``)."""
    if not swappable():
        raise RematRuntimeError(
            message(
                api,
                "evicting a tensor needs torch.UntypedStorage._swap_data_ptr_, which this torch lacks",
                f"torch {torch.__version__}",
                "install torch 2.13 or later (TORCH_SPEC), or use remat.checkpoint or remat.plan",
            )
        )


def swap(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory (data pointer and size) of two storages; every tensor on either keeps
    its storage object."""
    a._swap_data_ptr_(b)  # type: ignore[attr-defined]


def at(pointer: int, device: torch.device, nbytes: int) -> torch.UntypedStorage:
    """A storage over ``nbytes`` of memory at ``pointer`` that it does not own."""
    return torch._C._construct_storage_from_data_pointer(pointer, device, nbytes)  # type: ignore[return-value]


def ghost(like: torch.UntypedStorage) -> torch.UntypedStorage:
    """A storage of ``like``'s size with no memory behind it (a null data pointer).

    NOTE [ghosts] An evicted program storage keeps its size: making a view checks the storage's
    bounds (``t()``, ``view`` ... run on evicted tensors without restoring them), while every op
    that reads data goes through the region first and finds the storage restored. Code that reads
    memory behind PyTorch's back (``tolist()``, ``numpy()``, ``data_ptr()``) must not touch a tensor
    made in the region before the region ends."""
    return at(0, like.device, like.nbytes())


class Homes:
    """The real storage of every resident core storage."""

    def __init__(self) -> None:
        self.program: dict[int, weakref.ref[torch.UntypedStorage]] = {}  # handle -> program storage
        self.pinned: dict[int, torch.UntypedStorage] = {}  # handle -> storage kept alive (constants)
        self.held_by: dict[int, int] = {}  # core storage -> handle whose program storage holds it
        self.private: dict[int, torch.UntypedStorage] = {}  # core storage -> private storage
        self.sizes: dict[int, int] = {}  # core storage -> real bytes it holds now
        self.real_bytes = 0
        self.peak_real_bytes = 0

    def add_handle(
        self,
        handle: int,
        storage: torch.UntypedStorage,
        pin: bool,
        died: Callable[[weakref.ref[torch.UntypedStorage]], None] | None = None,
    ) -> None:
        """Follow ``storage``, the program storage of ``handle``; ``died`` is called when it dies,
        unless the handle was dropped first (:meth:`clear`, or ``del program[handle]``)."""
        self.program[handle] = weakref.ref(storage, died)
        if pin:
            self.pinned[handle] = storage

    def holds(self, storage: int) -> bool:
        return storage in self.private or storage in self.held_by

    def storage_of_handle(self, handle: int) -> torch.UntypedStorage | None:
        ref = self.program.get(handle)
        return None if ref is None else ref()

    def get(self, storage: int) -> torch.UntypedStorage:
        """The real storage holding core ``storage`` (which must be resident)."""
        found = self.private.get(storage)
        if found is not None:
            return found
        held = self.storage_of_handle(self.held_by[storage])
        assert held is not None, f"storage {storage} has no real storage"
        return held

    def hold(self, storage: int, handle: int) -> None:
        """The program storage of ``handle`` holds core ``storage`` now (its content is in place)."""
        ref = self.program.get(handle)  # ``storage_of_handle``, inlined: every new storage comes here
        real = None if ref is None else ref()
        if real is not None and real.nbytes() == 0:  # an empty one stays resident once the program
            # drops it (``Residency._dead``), for recomputations that read it: one of our own
            self.private[storage] = torch.UntypedStorage(0, device=real.device)
            return
        self.held_by[storage] = handle
        self._count(storage, real.nbytes() if real is not None else 0)

    def keep_private(self, storage: int, real: torch.UntypedStorage) -> None:
        self.private[storage] = real
        self._count(storage, real.nbytes())

    def install(self, storage: int, content: torch.UntypedStorage, handle: int | None) -> None:
        """Core ``storage`` was recomputed into ``content``; put it where the program reads it when
        it is the current version of a live program storage (``handle`` given), else keep it private.
        """
        target = self.storage_of_handle(handle) if handle is not None else None
        if target is None:
            self.keep_private(storage, content)
            return
        swap(target, content)  # the ghost it held goes to ``content``, which dies
        self.hold(storage, handle)  # type: ignore[arg-type]

    def forget(self, storage: int) -> torch.UntypedStorage | None:
        """Stop tracking core ``storage`` without touching its content (it moved to a new version);
        returns the private storage that held it, if any."""
        self._count(storage, 0)
        self.held_by.pop(storage, None)
        return self.private.pop(storage, None)

    def evict(self, storage: int) -> None:
        """Core ``storage``'s content is gone: give its memory back to the allocator."""
        self._count(storage, 0)
        if self.private.pop(storage, None) is not None:
            return
        handle = self.held_by.pop(storage, None)
        if handle is None:
            return
        ref = self.program.get(handle)  # ``storage_of_handle``, inlined: every dead storage comes here
        real = None if ref is None else ref()
        if real is not None:
            swap(real, ghost(real))

    def clear(self) -> None:
        self.program.clear()
        self.pinned.clear()
        self.held_by.clear()
        self.private.clear()
        self.sizes.clear()

    def _count(self, storage: int, nbytes: int) -> None:
        real = self.real_bytes = self.real_bytes + nbytes - self.sizes.pop(storage, 0)
        if nbytes:
            self.sizes[storage] = nbytes
            if real > self.peak_real_bytes:  # only a count that grew can pass the peak
                self.peak_real_bytes = real
