"""Capture and replay of the ambient state a recomputation must see again: RNG and autocast.

A recomputation runs during backward, long after the forward pass, in whatever RNG and autocast
state the program is in by then. To compute the same values it must run with the generator states
and autocast settings of the forward pass, and it must leave the program's own RNG stream exactly
where it was (recomputing a dropout must not shift the next step's masks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_AUTOCAST_DEVICES: tuple[str, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class RngState:
    """Generator states of the CPU and of every initialized CUDA device."""

    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]


def capture_rng() -> RngState:
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
    return RngState(torch.get_rng_state(), cuda)


def restore_rng(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda:
        torch.cuda.set_rng_state_all(list(state.cuda))


@contextlib.contextmanager
def rng_replayed(state: RngState) -> Iterator[None]:
    """Run the block with the generators set to ``state``; give the caller's stream back after."""
    outer = capture_rng()
    restore_rng(state)
    try:
        yield
    finally:
        restore_rng(outer)


@dataclass(frozen=True)
class AutocastState:
    """Autocast settings per device type: (enabled, dtype); plus whether its cast cache is on."""

    devices: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool


def capture_autocast() -> AutocastState:
    devices = tuple(
        (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in _AUTOCAST_DEVICES
    )
    return AutocastState(devices, torch.is_autocast_cache_enabled())


@contextlib.contextmanager
def autocast_replayed(state: AutocastState) -> Iterator[None]:
    """Run the block under exactly the autocast settings of ``state`` (enabled or not)."""
    with contextlib.ExitStack() as stack:
        for dev, enabled, dtype in state.devices:
            if enabled or torch.is_autocast_enabled(dev):
                stack.enter_context(
                    torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=state.cache_enabled)
                )
        yield
