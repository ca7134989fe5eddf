"""When the storages a three-way plan moves leave the device and come back, as the executor
(``remat.planner.offload_execute``, ``remat.host.offloader``) moves them: what ``predict`` is given
as ``moved``.

NOTE [moves on the step] The solver's model moves items by steps of the chain; the executor does it
by ops, and three things differ, each of which made offload plans measure other than predicted:
- What moves: every new output of a planned op that autograd saves goes to the host (the executor
  notes the op's outputs, not which of them the solver chose), so layer norm's statistics go with
  its output.
- When a storage leaves: on CPU the copy out is made when autograd first saves it, and the device
  storage goes when the program lets go of it (``Trace.let_go``), not at the end of the step the
  link model finishes the copy in; on CUDA the caching allocator keeps it until the copy is done,
  so the later of the two. (Where the capture has no ``let_go``, the solver's step is taken.)
- When it comes back: not at the step the solver planned, but at its first unpack in backward, or
  earlier where the prefetch brings it (NOTE [plan prefetch]): each first unpack brings back the
  ``PREFETCH`` storages moved out before it that backward has not unpacked yet (those already on
  their way count). The offloader orders them as autograd packed them, which the trace does not
  keep within one op's saves (``bmm`` packs its second argument first), so the storages first
  saved at one position come back together, when the first of them would: never later than the
  executor brings them. Autograd unpacks a node's saves when the node starts, a few ops before the
  op that reads them; the trace does not mark where nodes start, so the walk takes the first op of
  the run of backward ops of the reading op's module (a node's ops carry its module): no later
  than the node's start.
"""

from __future__ import annotations

from collections.abc import Iterable

from remat.planner.offload_execute import PREFETCH
from remat.planner.search import Step
from remat.trace.types import Phase, Trace

__all__ = ["moves_on_step"]


def moves_on_step(step: Step, planned: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(root, gone after op, back before op)`` for each storage the executor moves, from the
    solver's moved storages ``planned`` as ``(root, op after which the solver's step has it gone)``
    (NOTE [moves on the step])."""
    trace = step.trace
    root = trace.roots
    solver_gone = dict(planned)
    saved = {root[t] for t in trace.saved}
    made: dict[int, list[int]] = {}  # storage -> the new storages its op made
    for op in step.forward:
        fresh = [root[t] for t in op.outputs if trace.tensors[t].alias_of is None]
        for r in fresh:
            made.setdefault(r, fresh)
    for r in list(solver_gone):  # the planned op's other saved outputs move with it
        for other in made.get(r, ()):
            if other in saved and not trace.tensors[other].constant:
                solver_gone.setdefault(other, solver_gone[r])
    let_go = dict(trace.let_go)
    last_save: dict[int, int] = {}
    saved_first: dict[int, int] = {}  # when autograd first saved it: the copy out
    for t, position in trace.saved_at:
        r = root[t]
        if r in solver_gone:
            last_save[r] = max(last_save.get(r, 0), position - 1)
            saved_first[r] = min(saved_first.get(r, position), position)
    for op in step.forward:  # a trace that does not place its saves: the op that made it
        for t in op.outputs:
            if root[t] in solver_gone:
                saved_first.setdefault(root[t], op.index + 1)
    first_read: dict[int, int] = {}
    for t, ops in trace.saved_reads().items():
        if ops and root[t] in solver_gone:
            first_read[root[t]] = min(first_read.get(root[t], ops[0]), *ops)
    begins = _run_starts(trace)
    first_read = {r: begins[op] for r, op in first_read.items()}
    back = _returns(solver_gone, saved_first, first_read)
    end = len(trace.ops)
    out = []
    for r, planned_gone in solver_gone.items():
        program = max(let_go.get(r, planned_gone), last_save.get(r, 0))
        gone = program if trace.device == "cpu" else max(program, planned_gone)
        out.append((r, gone, back.get(r, end)))
    return out


def _returns(moved: Iterable[int], saved_first: dict[int, int], first_read: dict[int, int]) -> dict[int, int]:
    """The op before which each moved storage is back: the offloader's prefetch walked over
    backward's first reads, the storages in the order they moved out; those moved out at one
    position, whose order the trace does not keep, come back together, when the first of them
    would (NOTE [moves on the step])."""
    groups: dict[int, list[int]] = {}
    for r in moved:
        groups.setdefault(saved_first.get(r, 0), []).append(r)
    order = [groups[k] for k in sorted(groups)]
    at = {r: k for k, group in enumerate(order) for r in group}
    back: dict[int, int] = {}
    unpacked: set[int] = set()
    for op, r in sorted((op, r) for r, op in first_read.items()):
        unpacked.add(r)
        ahead = 0
        for k in range(at[r], -1, -1):
            if ahead >= PREFETCH and k < at[r]:
                break
            for s in order[k]:
                back.setdefault(s, op)
                ahead += k < at[r] and s not in unpacked
    return back


def _run_starts(trace: Trace) -> list[int]:
    """For each op, the first op of the run of backward ops of its module it belongs to: autograd
    unpacks a node's saves when the node starts, before its first op reads them, and the trace
    does not mark where nodes start; a node's ops carry its module, so it starts no earlier."""
    begins = list(range(len(trace.ops)))
    for op in trace.ops[1:]:
        before = trace.ops[op.index - 1]
        if op.phase is Phase.BACKWARD and before.phase is Phase.BACKWARD and before.module == op.module:
            begins[op.index] = begins[op.index - 1]
    return begins
