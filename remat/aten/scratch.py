"""What an op allocates, by op signature, learned once per process and read by every dispatch mode
that accounts memory (trace capture, the dynamic runtime): its kernel's scratch bytes, what it
allocates for itself and frees before it returns (a convolution's unfolded input, a reordered
weight); and the sizes of its results where its meta kernel cannot tell them (``results``).

No dispatch mode sees these buffers, only the allocator does: on CPU through PyTorch's profiler
(:mod:`remat._allocator`), which cannot run inside another profiler session. A signature is the
op, the intra-op thread count and every argument's geometry (tensors) or value (the rest): the
same call allocates the same scratch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from remat._allocator import account, available, later, ours

__all__ = ["known", "learn", "learn_results", "results", "signature", "signature_of", "timed"]

_KNOWN: dict[tuple[Any, ...], int] = {}
_RESULTS: dict[tuple[Any, ...], tuple[int, ...]] = {}


def signature(func: Any, args: Any, kwargs: Any) -> tuple[Any, ...]:
    """The key under which ``func(*args, **kwargs)``'s scratch is kept."""
    return signature_of(str(func), tree_leaves((args, kwargs)), torch.Tag.pointwise in func.tags)


def signature_of(name: str, leaves: Iterable[Any], pointwise: bool = False) -> tuple[Any, ...]:
    """:func:`signature` of the op named ``name`` (``str(func)``) from the leaves of its arguments,
    for a dispatch mode that has them flat already (the key is built on every op: no copies).

    NOTE [signature numbers] A number is part of the key (``arange``'s end, ``interpolate``'s scale
    sizes its result) but for a ``pointwise`` op, whose results are sized by its tensors alone: an
    optimizer passes a new step size to ``addcdiv_`` every step, and one key per step would grow
    the tables without bound and leave each step's scratch unknown. A storage (``set_``) is keyed by
    its device and size, a generator by its device: their reprs are their contents or addresses."""
    return (
        name,
        torch.get_num_threads(),
        *[
            (t.device, t.dtype, t.shape, t.stride())
            if isinstance(t, torch.Tensor)
            else _number(t)
            if pointwise and isinstance(t, (int, float, complex))
            else ("generator", t.device)
            if type(t) is torch.Generator
            else ("storage", t.device, t.nbytes())
            if isinstance(t, torch.UntypedStorage)
            else repr(t)
            for t in leaves
        ],
    )


def _number(x: int | float | complex) -> str:
    return type(x).__name__  # NOTE [signature numbers]


def known(key: tuple[Any, ...]) -> int | None:
    """The scratch bytes learned for ``key``, None if never measured."""
    return _KNOWN.get(key)


def learn(key: tuple[Any, ...], nbytes: int) -> int:
    """Keep ``nbytes`` as ``key``'s scratch; returns it."""
    _KNOWN[key] = nbytes
    return nbytes


def results(key: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The storage bytes of the new results a run of ``key`` made, None if never seen."""
    return _RESULTS.get(key)


def learn_results(key: tuple[Any, ...], sizes: tuple[int, ...]) -> None:
    """Keep the storage bytes of the new results a run of ``key`` made."""
    _RESULTS[key] = sizes


def timed(call: Callable[[], Any], key: tuple[Any, ...] | None) -> tuple[Any, float]:
    """Run ``call()`` and time it; with ``key`` (a CPU op whose scratch is not known) learn ``key``'s
    scratch from this very run: the bytes it held at its peak beyond what it returned. Now where the
    allocator's account is free to run; where one of ours runs (``remat.memory.track(allocator=True)``)
    when it ends (NOTE [held back] in ``remat._allocator``); else not."""
    if key is not None and available():
        with account() as held:
            start = time.perf_counter()
            out = call()
            seconds = time.perf_counter() - start
        learn(key, max(0, held.peak_bytes - held.current_bytes))
        return out, seconds
    waits = key is not None and ours()
    begin = time.time_ns() if waits else 0
    start = time.perf_counter()
    out = call()
    seconds = time.perf_counter() - start
    if waits:
        assert key is not None
        later(begin, time.time_ns(), partial(learn, key))
    return out, seconds
