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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from remat import aten
from remat.aten import RngState


def result_leaves(returns: tuple[bool, ...], out: Any) -> list[tuple[int, Any]]:
    """(return index, value) of every result of an op, lists of tensors flattened, None kept."""
    if type(out) is torch.Tensor:  # one tensor: most ops
        return [(0, out)]
    results = out if isinstance(out, (tuple, list)) and len(returns) > 1 else (out,)
    leaves: list[tuple[int, Any]] = []
    for r, result in enumerate(results):
        for value in result if isinstance(result, (tuple, list)) else (result,):
            leaves.append((r, value))
    return leaves


Spec = tuple[tuple[tuple[type, int] | None, ...], tuple[str, ...]]
"""How :func:`flatten` laid an op's arguments out: per argument, positional then keyword, None
(one leaf) or the container it was (``list`` or ``tuple``) and its length, its items inline; and
the keyword names."""


def flatten(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[list[Any], Spec]:
    """The leaves of an ATen op's arguments, in the order ``torch.utils._pytree.tree_leaves((args,
    kwargs))`` gives them, and how to put them back (:func:`unflatten`). ATen arguments nest one
    deep at most (``Tensor[]``, ``int[]``), so this skips pytree's general walk, which costs more
    than the rest of the runtime's work on a small op."""
    flat: list[Any] = []
    kinds: list[tuple[type, int] | None] = []
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind is list or kind is tuple:
            flat.extend(value)
            kinds.append((kind, len(value)))
        else:
            flat.append(value)
            kinds.append(None)
    return flat, (tuple(kinds), tuple(kwargs))


def unflatten(flat: Sequence[Any], spec: Spec) -> tuple[list[Any], dict[str, Any]]:
    """The arguments :func:`flatten` made ``flat`` of, as ``(args, kwargs)``."""
    kinds, names = spec
    values: list[Any] = []
    at = 0
    for kind in kinds:
        if kind is None:
            values.append(flat[at])
            at += 1
        else:
            values.append(kind[0](flat[at : at + kind[1]]))
            at += kind[1]
    split = len(values) - len(names)
    return values[:split], dict(zip(names, values[split:], strict=True))


class Scan(NamedTuple):
    """What an op's flat arguments hold, found in one pass (:func:`scan`)."""

    positions: list[int]  # of the tensors of the region
    explicit: list[tuple[int, torch.Generator]]  # (position, generator) of each generator
    named: list[torch.device]  # device arguments
    leaves: list[Any]  # the flat arguments with tensors and generators set to None
    tensors: bool  # any tensor at all, the region's or not


def scan(flat: Sequence[Any], managed: Callable[[torch.Tensor], bool]) -> Scan:
    """:class:`Scan` of ``flat``; ``managed``: whether a tensor is the region's."""
    positions: list[int] = []
    explicit: list[tuple[int, torch.Generator]] = []
    named: list[torch.device] = []
    leaves = list(flat)
    tensors = False
    for i, x in enumerate(flat):
        if type(x) in _PLAIN:  # most leaves; ``isinstance(x, torch.Generator)`` runs Python code
            continue
        if isinstance(x, torch.Tensor):
            tensors = True
            if managed(x):
                leaves[i] = None
                positions.append(i)
            # else (sparse, another device's): not the region's memory; the recipe holds it as is
        elif isinstance(x, torch.Generator):
            leaves[i] = None
            explicit.append((i, x))
        elif isinstance(x, torch.device):
            named.append(x)
    return Scan(positions, explicit, named, leaves, tensors)


_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format})
"""Types of argument leaves that are neither tensors, generators nor devices."""


class Slot(NamedTuple):
    """A tensor argument: flat position, the core storage (version) it read, its geometry, and its
    lazy bits (1: conjugate, 2: negative; a ``conj()`` view reaches an op as its storage's values
    with the bit set, which the tensor made again for the op must carry too)."""

    position: int
    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    bits: int = 0


class Recipe(NamedTuple):
    """One op call, ready to run again. ``leaves`` are the flat arguments with the region's tensors
    set to None (others, sparse or on another device, held as they are);
    ``outputs[i]`` is the index of the op's ``i``-th fresh output among its results
    (``engine.result_leaves``);
    ``generators`` holds the flat position, device and state before the run of each explicit
    generator.

    NOTE [ops as they ran] The runtime meets an op below autocast, which has already cast its
    arguments: it runs (and sizes) the op again with autocast off, else an op run again inside the
    program's autocast (while another op is being dispatched) would be cast once more, to another
    dtype and size than the first run's."""

    func: Any
    returns: tuple[bool, ...]  # per return of the schema: a new tensor
    leaves: tuple[Any, ...]
    spec: Spec
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
        return unflatten(flat, self.spec)

    def meta(self) -> Any:
        """The op's results on meta tensors: their sizes, without running it."""
        args, kwargs = self.arguments(
            lambda s: torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device="meta")
        )
        with torch._C._DisableAutocast():  # NOTE [ops as they ran]
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
            lambda s: _lazy(
                torch.empty(0, dtype=s.dtype, device=device).set_(
                    source(s.storage), s.offset, s.shape, s.stride
                ),
                s.bits,
            )
        )
        hidden = aten.facts(self.func).hidden_writes
        if hidden:
            for i, _ in hidden:
                if i < len(args) and isinstance(args[i], torch.Tensor):
                    args[i] = args[i].clone()
        func = self.func if overload is None else overload
        rng = aten.replayed(self.rng) if self.rng is not None else contextlib.nullcontext()
        with rng, torch.set_grad_enabled(self.grad), torch._C._DisableAutocast():
            start = time.perf_counter()
            out = func(*args, **kwargs, **(outs or {}))
            return out, time.perf_counter() - start


def _lazy(t: torch.Tensor, bits: int) -> torch.Tensor:
    """``t`` with the lazy conjugate and negative bits of ``bits`` (``Slot.bits``) set."""
    if bits & 1:
        torch._C._set_conj(t, True)
    if bits & 2:
        torch._C._set_neg(t, True)
    return t
