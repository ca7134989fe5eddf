"""The Trace data type: one training step as plain data (tensors, ops, releases).

The planner and the simulator reason about a step only through this type, whatever produced it
(a capture of a real PyTorch step, a capture on fake tensors, or an imported DTR log), so that what
the simulator predicts and what the runtime does are computed from the same facts.

Conventions:
- ``Trace.tensors[i].id == i``.
- A tensor either owns a storage (``nbytes`` > 0 or an empty one) or aliases another tensor's
  storage (``alias_of`` set, ``nbytes`` 0): views and extra handles share their base's memory.
- Constants (parameters, inputs, DTR ``CONSTANT``) exist before the first event and can never be
  recomputed.
- A storage is freed when every tensor sharing it has been released.
- Costs are in seconds.

The parts of a Trace (Phase, TensorInfo, Op, Release) are defined in ``remat.trace.events`` and
re-exported here; its live bytes with no budget come from ``remat.trace.liveness``.

NOTE [unseen bytes] A trace counts the storages ops make (and their kernels' scratch); memory that
no op makes is not in it: above all the copies of the random-number generator's state that
``torch.utils.checkpoint`` takes in forward for each call that draws (``torch.get_rng_state()``,
5,056 bytes on CPU, no ATen op) and keeps until its backward. ``unseen_bytes`` is what the CPU
allocator held at the plain step's peak beyond the trace's own count (``activation_peak_bytes``),
measured by ``remat.planner.trace_step`` on one more run of the step; every prediction of the
planner counts it as held throughout (on the safe side where it is held for part of the step), and
runs no region as its module called again (``remat.planner.rerun_regions``: the call run again in
backward would make such memory again, beside what the plain step held). A model whose calls make
more each time (a Python count it keeps) gets a figure from that too: on the safe side.
0 where it was not measured: another profiler session was running, a CUDA step (such states live
in host memory there), a trace made another way.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from remat._units import format_bytes
from remat.trace.events import Event, Op, Phase, Release, TensorInfo
from remat.trace.liveness import Liveness, liveness

__all__ = ["Event", "Op", "Phase", "Release", "TensorInfo", "Trace"]


@dataclass(frozen=True)
class Trace:
    """One step: its tensors, its events in program order, and which forward tensors autograd
    saved for backward. ``saved_at`` says when, where known: one ``(tensor, position)`` per save,
    ``position`` being the number of ops that had run (the save came after op ``position - 1`` and
    before op ``position``: autograd saves an op's inputs before it runs and its outputs after),
    sorted. ``calls`` counts the forward calls of each module path, where the capture counted them
    (empty: not known), and ``call_inputs`` names the tensors each one's first call was given.
    ``let_go``: per saved storage (root), the forward op after which the program itself held no
    tensor on it, autograd's saves aside (``remat.trace.let_go``), where the capture ran the forward
    again (of a model; a step function's capture has none). ``unseen_bytes``: NOTE [unseen bytes]."""

    tensors: tuple[TensorInfo, ...]
    events: tuple[Event, ...]
    saved: frozenset[int] = frozenset()
    name: str = ""
    device: str = "cpu"
    source: str = "capture"
    saved_at: tuple[tuple[int, int], ...] = ()
    calls: tuple[tuple[str, int], ...] = ()
    call_inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    let_go: tuple[tuple[int, int], ...] = ()
    unseen_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "saved_at", tuple(sorted(self.saved_at)))
        object.__setattr__(self, "calls", tuple(sorted(self.calls)))
        object.__setattr__(self, "call_inputs", tuple(sorted((k, tuple(v)) for k, v in self.call_inputs)))
        object.__setattr__(self, "let_go", tuple(sorted(self.let_go)))

    @functools.cached_property
    def ops(self) -> tuple[Op, ...]:
        """The op events alone, in program order (``ops[i].index == i``)."""
        return tuple(e for e in self.events if isinstance(e, Op))

    @functools.cached_property
    def saved_roots(self) -> frozenset[int]:
        """The storages autograd saved: the roots of ``saved``; cached."""
        return frozenset(self.root(t) for t in self.saved)

    @functools.cached_property
    def liveness(self) -> Liveness:
        """Live bytes with no budget (see ``remat.trace.liveness``); cached."""
        return liveness(self)

    @property
    def peak_bytes(self) -> int:
        """Peak live bytes with no budget, constants included (the DTR convention:
        budget ratios are relative to this)."""
        return self.liveness.peak_bytes

    @property
    def activation_peak_bytes(self) -> int:
        """Peak live bytes of the storages the step itself made and of its ops' scratch, constants
        excluded: what ``remat.memory.track(allocator=True)`` measures around the same step."""
        return self.liveness.activation_peak_bytes

    @property
    def constant_bytes(self) -> int:
        """Bytes of the constants' storages (parameters, inputs, pre-existing optimizer state)."""
        return self.liveness.constant_bytes

    @functools.cached_property
    def total_cost(self) -> float:
        """Sum of the measured op costs, seconds (0.0 for a trace taken on fake tensors); cached."""
        return math.fsum(op.cost for op in self.ops)

    @functools.cached_property
    def total_est_cost(self) -> float:
        """Sum of the cost model's estimates, seconds; cached."""
        return math.fsum(op.est_cost for op in self.ops)

    @functools.cached_property
    def module_spans(self) -> dict[str, tuple[int, int, int]]:
        """Per module path: the first and the last forward op that it or a module below it
        issued, and how many (trace op indices); cached."""
        spans: dict[str, tuple[int, int, int]] = {}
        for op in self.ops:
            if op.phase is not Phase.FORWARD or not op.module:
                continue
            parts = op.module.split(".")
            for k in range(1, len(parts) + 1):
                name = ".".join(parts[:k])
                first, _, n = spans.get(name, (op.index, op.index, 0))
                spans[name] = (first, op.index, n + 1)
        return spans

    @functools.cached_property
    def roots(self) -> tuple[int, ...]:
        """Each tensor's ``root``, by id; cached."""
        return tuple(self.root(t.id) for t in self.tensors)

    @functools.cached_property
    def backward_modules(self) -> dict[int, frozenset[str]]:
        """Per storage (root), the modules of the backward ops that read it (backward ops carry
        the module of the forward op whose node runs them); cached."""
        found: dict[int, set[str]] = {}
        roots = self.roots
        for op in self.ops:
            if op.phase is Phase.BACKWARD:
                for t in op.inputs:
                    found.setdefault(roots[t], set()).add(op.module)
        return {r: frozenset(m) for r, m in found.items()}

    @functools.cached_property
    def forward_deaths(self) -> dict[int, int]:
        """Per storage (root) the program let go of before backward began: the op after which its
        last handle went; cached."""
        roots, last = self.roots, -1
        handles: dict[int, int] = {}
        deaths: dict[int, int] = {}
        for e in self.events:
            if isinstance(e, Op):
                if e.phase is Phase.BACKWARD:
                    break
                last = e.index
                for t in e.outputs:
                    handles[roots[t]] = handles.get(roots[t], 0) + 1
            elif roots[e.tensor] in handles:
                r = roots[e.tensor]
                handles[r] -= 1
                if handles[r] == 0:
                    deaths[r] = last
        return deaths

    @functools.cached_property
    def backward_reads(self) -> dict[tuple[int, str], int]:
        """Per (storage, module of the reading backward op; NOTE in ``backward_modules``), the last
        backward op that reads it; cached."""
        roots, reads = self.roots, {}
        for op in self.ops:
            if op.phase is Phase.BACKWARD:
                reads.update(dict.fromkeys(((roots[t], op.module) for t in op.inputs), op.index))
        return reads

    @functools.cached_property
    def backward_runs(self) -> dict[int, int]:
        """Per backward op, the last op of its run of backward ops of one module: the autograd node
        that runs it ends there at the latest; cached."""
        runs: dict[int, int] = {}
        run: list[int] = []
        for op in self.ops:
            if op.phase is not Phase.BACKWARD:
                continue
            if run and self.ops[run[-1]].module != op.module:
                runs.update(dict.fromkeys(run, run[-1]))
                run = []
            run.append(op.index)
        runs.update(dict.fromkeys(run, run[-1] if run else -1))
        return runs

    @functools.cached_property
    def released_after(self) -> dict[int, int]:
        """Per storage (root) the step let go of, the op after which it went; cached."""
        roots, at, after = self.roots, -1, {}
        for e in self.events:
            if isinstance(e, Op):
                at = e.index
            else:
                after[roots[e.tensor]] = at
        return after

    @functools.cached_property
    def outliving(self) -> frozenset[int]:
        """The storages (roots) ops made that are still alive when the step ends; cached.

        NOTE [held past the step] Something of the program's holds them past the step (a module
        attribute: the weight ``torch.nn.utils.spectral_norm`` and ``weight_norm`` compute in a
        forward pre-hook), not autograd, which lets go of its saves in backward. A region that
        dropped one would free nothing and its replay would make a copy beside it (a tiny CNN's
        plan measured 13 KB over its budget), so every region keeps those it saves
        (``remat.planner.search.Step``)."""
        roots, tensors = self.roots, self.tensors
        made = {roots[t] for op in self.ops for t in op.outputs if not tensors[roots[t]].constant}
        return frozenset(made - self.released_after.keys())

    def root(self, tensor: int) -> int:
        """The tensor that owns ``tensor``'s storage (itself unless it is an alias)."""
        info = self.tensors[tensor]
        while info.alias_of is not None:
            info = self.tensors[info.alias_of]
        return info.id

    def saved_reads(self) -> dict[int, tuple[int, ...]]:
        """For each tensor autograd saved, the indices of the backward ops that read it (directly
        or through an alias of its storage)."""
        by_root: dict[int, list[int]] = {}
        for t in self.saved:
            by_root.setdefault(self.root(t), []).append(t)
        reads: dict[int, list[int]] = {t: [] for t in self.saved}
        for op in self.ops:
            if op.phase is not Phase.BACKWARD:
                continue
            for r in {self.root(t) for t in op.inputs} & by_root.keys():
                for t in by_root[r]:
                    reads[t].append(op.index)
        return {t: tuple(ops) for t, ops in reads.items()}

    def __str__(self) -> str:
        ops = self.ops
        phases = ", ".join(
            f"{sum(op.phase is p for op in ops)} {p.value}" for p in Phase if any(op.phase is p for op in ops)
        )
        return (
            f"Trace({self.name or 'unnamed'}, {self.source} on {self.device}: {len(ops)} ops ({phases}), "
            f"{len(self.tensors)} tensors, peak {format_bytes(self.peak_bytes)} of which constants "
            f"{format_bytes(self.constant_bytes)})"
        )
