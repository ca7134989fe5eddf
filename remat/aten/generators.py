"""Which generator a random op draws from, and saving and setting generator states on any device.

A recomputation runs during backward, long after the forward pass, in whatever RNG state the
program is in by then. To compute the same values it must draw from the states the forward drew
from, and it must leave the program's own streams exactly where they were (recomputing a dropout
must not shift the next step's masks). A *source* is an explicit ``torch.Generator`` or a device,
meaning that device's default generator; states are host tensors whatever the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Source = torch.Generator | torch.device


def _get(source: Source) -> torch.Tensor:
    if isinstance(source, torch.Generator):
        return source.get_state()
    if source.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(source.type).get_rng_state(source)


def _set(source: Source, state: torch.Tensor) -> None:
    if isinstance(source, torch.Generator):
        source.set_state(state)
    elif source.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(source.type).set_rng_state(state, source)


@dataclass(frozen=True)
class RngState:
    """The states of some generators, each with its source."""

    states: tuple[tuple[Source, torch.Tensor], ...]

    @property
    def sources(self) -> tuple[Source, ...]:
        return tuple(source for source, _ in self.states)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The state tensors (host memory)."""
        return tuple(state for _, state in self.states)


# NOTE [one state per run of draws] The tape (``remat.manual.tape``) takes the generator's state
# before each op that draws, and a replay sets it before running the op: the op draws what it drew
# in the forward. Where the drawing node a replay runs follows another it runs, with no drawing node
# between them on the tape, draws from the same generators, and found them where the one before
# left them (``Node.draws_on``: the tape compares the state before it with the state after the one
# before, ``standing``; a seed set, a ``fork_rng`` block left or another thread's draw between them
# moves it), the generator already stands where the forward's did when the second drew, as
# ``torch.utils.checkpoint`` relies on when it keeps one state for a whole function. So a slice
# keeps the state of the first node of each run of drawing nodes it replays back to back, and the
# others (``CONTINUES``: no state, still a random op) draw on from there: a layer with three
# dropouts keeps one state where it kept three.
CONTINUES = RngState(())


def standing(state: RngState) -> tuple[tuple[Source, bytes], ...]:
    """Where the generators of ``state`` stood: their states as bytes, comparable (host memory
    only: the state tensor itself is let go)."""
    return tuple((source, saved.numpy().tobytes()) for source, saved in state.states)


def source_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Source:
    """The generator a random op draws from: its ``generator`` argument, else the default one of
    its ``device`` argument's device, or of its first tensor's, or the CPU's."""
    generator = kwargs.get("generator")
    if generator is not None:
        return generator
    for a in args:
        if isinstance(a, torch.Generator):
            return a
    if kwargs.get("device") is not None:  # ``rand_like(x, device=...)`` draws on that device
        return torch.device(kwargs["device"])
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


_NBYTES: dict[str, int] = {}  # device type -> bytes of a generator state there


def _device_type(source: Source) -> str:
    return source.device.type if isinstance(source, torch.Generator) else source.type


def capture(sources: Iterable[Source]) -> RngState:
    """The states of ``sources`` now (each once)."""
    states = tuple((source, _get(source)) for source in dict.fromkeys(sources))
    for source, state in states:
        _NBYTES.setdefault(_device_type(source), state.untyped_storage().nbytes())
    return RngState(states)


def state_nbytes(source: Source) -> int:
    """The bytes a state of ``source`` takes (host memory), known without taking one where a state
    of a generator of its device type was taken before: a dispatch mode that must make room for a
    state before it takes it asks here (the dynamic runtime, NOTE [room first])."""
    kind = _device_type(source)
    if kind not in _NBYTES:
        capture((source,))
    return _NBYTES[kind]


def _initialized_devices() -> list[torch.device]:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return []
    module = torch.get_device_module(accelerator.type)
    initialized = getattr(module, "is_initialized", lambda: True)
    if not initialized():
        return []
    return [torch.device(accelerator.type, i) for i in range(module.device_count())]


def capture_all(generators: Iterable[torch.Generator] = ()) -> RngState:
    """The states of the CPU's default generator, of every initialized accelerator device's, and
    of ``generators``."""
    return capture([torch.device("cpu"), *_initialized_devices(), *generators])


def restore(state: RngState) -> None:
    """Set every generator of ``state`` to its saved state."""
    for source, saved in state.states:
        _set(source, saved)


@contextlib.contextmanager
def replayed(state: RngState) -> Iterator[None]:
    """Run the block with the generators of ``state`` set to it; give the caller's streams of the
    same generators back after."""
    outer = capture(state.sources)
    restore(state)
    try:
        yield
    finally:
        restore(outer)
