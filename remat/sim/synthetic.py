"""Synthetic traces: random programs for property tests, training steps of any size for benchmarks.

:class:`Builder` writes a trace by hand. :func:`random_program` draws a small program that uses
every feature of the Trace format (constants, multi-output ops, views, extra handles, in-place
mutations, releases in any order) so that tests can check the rematerialization core on shapes
nobody thought of. :func:`training_step` builds the
forward and backward pass of a deep chain (a matrix product and an activation per layer, with a
residual every few layers) at any depth, to measure how victim searches scale with the number of
tensors.
"""

from __future__ import annotations

import random

from remat.trace.builder import TraceBuilder
from remat.trace.types import Phase, Trace


class Builder(TraceBuilder):
    """Writes a trace by hand (tests and examples use it too); see :class:`TraceBuilder`."""


def random_program(rng: random.Random, ops: int = 12, constants: int = 2) -> Trace:
    """A random program of ``ops`` ops over ``constants`` constants (sizes 1..100 bytes), whose
    handles the program keeps (it always has something to read). Only non-constants are mutated
    (a mutated constant is copied and both versions kept, see :mod:`remat.core.runtime`), so that
    most budgets under the peak are feasible."""
    program = Builder()
    fixed = [program.tensor(rng.randint(1, 100), constant=True) for _ in range(max(constants, 1))]
    live = list(fixed)
    for _ in range(ops):
        inputs = tuple(rng.sample(live, rng.randint(1, min(3, len(live)))))
        kind = rng.random()
        cost = rng.uniform(0.1, 1.0)
        if kind < 0.15:  # a view, or a second handle, of its input
            out = program.tensor(0, alias_of=inputs[0])
            program.op("view", inputs[:1], (out,), cost * 0.01)
            live.append(out)
        elif kind < 0.25 and not program.tensors[inputs[0]].constant:  # an in-place update
            program.op("add_", inputs, (), cost, mutates=inputs[:1])
        else:
            outs = tuple(program.tensor(rng.randint(1, 100)) for _ in range(rng.choice((1, 1, 1, 2))))
            program.op(rng.choice(("mm", "relu", "add", "conv")), inputs, outs, cost)
            live.extend(outs)
        for tensor in list(live):
            if tensor not in fixed and rng.random() < 0.3:
                program.release(tensor)
                live.remove(tensor)
    for tensor in live:
        if tensor not in fixed and rng.random() < 0.5:
            program.release(tensor)
    return program.trace("random")


def training_step(layers: int, seed: int = 0, residual: int = 4) -> Trace:
    """One training step of a ``layers``-deep chain, about six tensors per layer.

    Forward, layer l: ``a = mm(x, w)``, ``x' = relu(a)``, and every ``residual`` layers
    ``x' = add(x', skip)``. Backward mirrors it and keeps the weight gradients to the end. Sizes
    vary per layer (bytes, log-uniform 1..16 MiB); times are 1 ns per byte for cheap ops and 8 for
    matrix products."""
    rng = random.Random(seed)
    program = Builder()
    weights = [program.tensor(rng.randint(1, 64) * 2**14, constant=True) for _ in range(layers)]
    x = program.tensor(2**20, constant=True)
    saved: list[tuple[int, int, int]] = []  # (input, pre-activation, output) per layer
    skip = x
    for layer, weight in enumerate(weights):
        nbytes = int(2 ** rng.uniform(20, 24))
        a = program.tensor(nbytes)
        program.op("mm", (x, weight), (a,), nbytes * 8e-9)
        out = program.tensor(nbytes)
        program.op("relu", (a,), (out,), nbytes * 1e-9)
        if residual and layer % residual == residual - 1 and program.tensors[skip].nbytes == nbytes:
            summed = program.tensor(nbytes)
            program.op("add", (out, skip), (summed,), nbytes * 1e-9)
            program.release(out)
            out = summed
        saved.append((x, a, out))
        if layer % residual == 0:
            skip = out
        x = out
    grad = program.tensor(program.tensors[x].nbytes)
    program.op("ones_like", (x,), (grad,), 1e-6, phase=Phase.BACKWARD)
    released: set[int] = set()
    for layer in reversed(range(layers)):
        inp, a, out = saved[layer]
        g_a = program.tensor(program.tensors[a].nbytes)
        program.op("relu_backward", (grad, a), (g_a,), program.tensors[a].nbytes * 1e-9, phase=Phase.BACKWARD)
        g_w = program.tensor(program.tensors[weights[layer]].nbytes)
        program.op("mm_backward", (inp, g_a), (g_w,), program.tensors[a].nbytes * 8e-9, phase=Phase.BACKWARD)
        g_x = program.tensor(program.tensors[inp].nbytes)
        program.op(
            "mm", (g_a, weights[layer]), (g_x,), program.tensors[a].nbytes * 8e-9, phase=Phase.BACKWARD
        )
        for tensor in (grad, g_a, a, out):
            if tensor not in released and not program.tensors[tensor].constant:
                program.release(tensor)
                released.add(tensor)
        grad = g_x
    return program.trace(f"chain-{layers}")
