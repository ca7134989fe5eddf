"""What it takes to run a recorded ATen op again: the op, its arguments with every tensor replaced
by the storage version and geometry it read, the random state it drew from and the grad mode.

A recipe keeps no tensor of the program alive (that would keep its memory alive and hide its
release); a recomputation rebuilds each argument as a new tensor over whatever real storage holds
that version then (:mod:`remat.dynamic.homes`).

A recomputation hands an op that writes without its schema saying so (batch norm's running
statistics, NOTE [hidden writes] in ``remat.aten.schema``) scratch copies of what it writes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten

from remat import aten
from remat.aten import RngState


def result_leaves(returns: tuple[bool, ...], out: Any) -> list[tuple[int, Any]]:
    """(return index, value) of every result of an op, lists of tensors flattened, None kept."""
    results = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
    leaves: list[tuple[int, Any]] = []
    for r, result in enumerate(results):
        for value in result if isinstance(result, (tuple, list)) else (result,):
            leaves.append((r, value))
    return leaves


@dataclass(frozen=True)
class Slot:
    """A tensor argument: flat position, the core storage (version) it read, and its geometry."""

    position: int
    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Recipe:
    """One op call, ready to run again. ``leaves`` are the flat arguments with tensors set to None;
    ``outputs[i]`` is the index of the op's ``i``-th fresh output among its results
    (``engine.result_leaves``);
    ``generators`` holds the flat position, device and state before the run of each explicit
    generator."""

    func: Any
    returns: tuple[bool, ...]  # per return of the schema: a new tensor
    leaves: tuple[Any, ...]
    spec: TreeSpec
    slots: tuple[Slot, ...]
    outputs: tuple[int, ...]
    rng: RngState | None
    grad: bool  # whether grad mode was on: some kernels make more outputs for training (oneDNN RNN)
    generators: tuple[tuple[int, torch.device, torch.Tensor], ...] = ()

    def arguments(self, make: Callable[[Slot], torch.Tensor]) -> tuple[list[Any], dict[str, Any]]:
        """The op's arguments with each tensor made by ``make(slot)``."""
        flat = list(self.leaves)
        for slot in self.slots:
            flat[slot.position] = make(slot)
        for position, where, state in self.generators:
            generator = torch.Generator(device=where)
            generator.set_state(state)
            flat[position] = generator
        args, kwargs = tree_unflatten(flat, self.spec)
        return list(args), dict(kwargs)

    def meta(self) -> Any:
        """The op's results on meta tensors: their sizes, without running it."""
        args, kwargs = self.arguments(
            lambda s: torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
        )
        return self.func(*args, **kwargs)

    def run(
        self,
        source: Callable[[int], torch.UntypedStorage],
        device: torch.device,
        overload: Any = None,
        outs: dict[str, torch.Tensor] | None = None,
    ) -> tuple[Any, float]:
        """Run the op again with each tensor argument over ``source(storage)`` (through ``overload``
        with the out= arguments ``outs`` when given); returns its results and the seconds the op
        itself took."""
        args, kwargs = self.arguments(
            lambda s: torch.empty(0, dtype=s.dtype, device=device).set_(
                source(s.storage), s.offset, s.shape, s.stride
            )
        )
        hidden = aten.facts(self.func).hidden_writes
        if hidden:
            for i, _ in hidden:
                if i < len(args) and isinstance(args[i], torch.Tensor):
                    args[i] = args[i].clone()
        func = self.func if overload is None else overload
        rng = aten.replayed(self.rng) if self.rng is not None else contextlib.nullcontext()
        with rng, torch.set_grad_enabled(self.grad):
            start = time.perf_counter()
            out = func(*args, **kwargs, **(outs or {}))
            return out, time.perf_counter() - start
