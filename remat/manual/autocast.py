"""Capture and replay of the autocast settings a recomputation must see again.

A recomputation run again from Python (``remat.checkpoint``) runs during backward, in whatever
autocast state the program is in by then; to compute the same values it must run under the
settings of the forward pass. (Generator states are the other half of that ambient state:
``remat.aten.generators``. The tape of ``remat.scope`` needs neither: it records ops below
autocast, casts included.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_AUTOCAST_DEVICES: tuple[str, ...] = ("cpu", "cuda")


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
