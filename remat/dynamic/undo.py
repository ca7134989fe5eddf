"""What a dynamic region puts back when it fails, so that a failed step leaves training as it found it.

A region can stop anywhere: a budget that cannot hold an op, a policy that thrashes, an error in the
program. Stopping inside ``optimizer.step()`` would leave some parameters updated and others not,
and some optimizer states advanced. So the region undoes the step instead:

- every storage from before the region that the step wrote (parameters, buffers such as batch
  norm's running statistics, optimizer state, gradients accumulated in place) gets its content at
  entry back: the core never lets a write to a constant take over its memory and keeps every
  version (NOTE [constants stay] in :mod:`remat.core.runtime`), so the entry content is at hand;
- batch norm writes its running statistics without its schema saying so (NOTE [hidden writes] in
  :mod:`remat.aten.schema`), so the core never sees those writes: the floating-point buffers of
  the modules in ``keep`` are copied at entry, and any other tensor from before the region that
  such an op writes is copied just before its first such write (``Engine._note_hidden``); the
  region counts the copies in its budget, and writes them back;
- each optimizer given in ``keep`` gets its state mapping back (entries the step created, such as
  momentum buffers made at the first step, go), and so does each other optimizer that steps inside
  the region, as it was before its first step there (``watch_steps``: a retried step would find
  the failed step's momentum otherwise); each parameter of the modules and optimizers in ``keep``
  gets its ``.grad`` object back;
- the global generators go back to their state at entry, so that running the step again draws the
  same random numbers.

Besides those buffers' copies, the snapshot holds references and generator states only.

Tensors the failed step made and the program still holds (its loss, its activations) keep their
objects but lose their content: each evicted one gets fresh memory so that reading it cannot
crash, and the allocator counts that memory, past the budget, until the program drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from remat import aten
from remat.aten import RngState
from remat.dynamic.engine import Engine
from remat.dynamic.homes import swap


@dataclass(frozen=True)
class Snapshot:
    """What the region puts back besides tensor contents."""

    rng: RngState
    optimizers: tuple[tuple[torch.optim.Optimizer, dict[Any, dict[str, Any]]], ...]
    grads: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]
    buffers: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (buffer, its content at entry)
    stepped: list[tuple[torch.optim.Optimizer, dict[Any, dict[str, Any]]]]  # ``watch_steps``'


def take(members: list[object]) -> Snapshot:
    """The snapshot of the modules and optimizers among ``members`` (see
    :func:`remat.dynamic.keep.members`)."""
    optimizers = [m for m in members if isinstance(m, torch.optim.Optimizer)]
    params: dict[int, torch.Tensor] = {}
    buffers: dict[int, torch.Tensor] = {}
    for m in members:
        if isinstance(m, nn.Module):
            params.update((id(p), p) for p in m.parameters())
            buffers.update((id(b), b) for b in m.buffers() if b.is_floating_point())
    for opt in optimizers:
        for group in opt.param_groups:
            params.update((id(p), p) for p in group["params"])
    return Snapshot(
        aten.capture_all(),
        tuple((opt, {p: dict(state) for p, state in opt.state.items()}) for opt in optimizers),
        tuple((p, p.grad) for p in params.values()),
        tuple((b, b.detach().clone()) for b in buffers.values()),
        [],
    )


def watch_steps(snapshot: Snapshot) -> RemovableHandle:
    """Note in ``snapshot`` each optimizer not in it that steps from now on, with its state mapping
    before its first step (see the module doc); remove the handle when the region closes."""

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        known = [opt for opt, _ in (*snapshot.optimizers, *snapshot.stepped)]
        if not any(opt is optimizer for opt in known):
            snapshot.stepped.append((optimizer, {p: dict(state) for p, state in optimizer.state.items()}))

    return register_optimizer_step_pre_hook(before_step)


def rewind(snapshot: Snapshot) -> None:
    """Put back what ``snapshot`` holds."""
    aten.restore(snapshot.rng)
    for opt, state in (*snapshot.optimizers, *snapshot.stepped):
        opt.state.clear()
        opt.state.update({p: dict(entries) for p, entries in state.items()})
    for p, grad in snapshot.grads:
        p.grad = grad
    with torch.no_grad():
        for buffer, content in snapshot.buffers:
            buffer.copy_(content)


def write_back(engine: Engine) -> tuple[int, list[str]]:
    """After an error: write back the content every storage from before ``engine``'s region had at
    entry (NOTE [constants stay] in ``remat.core.runtime``). Returns how many were written back, and
    a description of each that could not be."""
    runtime, homes, pending = engine.runtime, engine.backend.homes, engine.backend.pending
    restored, lost = 0, []
    saved = pending.saved if pending is not None and pending.run is None else {}
    for handle, first in engine.entry.items():
        real = homes.storage_of_handle(handle)
        if real is None:
            continue
        if handle in saved:  # the op that failed had already written it
            real.copy_(saved[handle])
            restored += 1
        elif runtime.storage_of(handle) != first:
            if not homes.holds(first):
                lost.append(str(engine.tensors[handle]))
                continue
            real.copy_(homes.get(first))
            restored += 1
    return restored, lost


def abandon(engine: Engine) -> None:
    """After an error: give every live program storage of ``engine``'s region that is evicted memory
    again (its content is lost) so that no tensor of the program is left without memory."""
    runtime, homes = engine.runtime, engine.backend.homes
    for handle in list(homes.program):
        real = homes.storage_of_handle(handle)
        try:
            if real is None or homes.holds(runtime.storage_of(handle)):
                continue
        except KeyError:  # made by the op that failed: never given to the core
            continue
        swap(real, torch.UntypedStorage(real.nbytes(), device=real.device))
