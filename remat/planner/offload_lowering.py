"""The offload problem of a captured step: its sub-blocks as a chain, its saved tensors as Items.

Why apart from ``remat.planner.offload_model``: the model costs a schedule on any chain and items
(the solvers' tests build them by hand); this module reads them off a trace, as
``remat.planner.lowering`` reads the recompute-only chain: which sub-block each forward and
backward op belongs to, which storages autograd saved and which steps make, read and free them, and
which trace ops each step spans (``OffloadProblem.bounds``, for mapping a schedule back onto the
step).
"""

from __future__ import annotations

from collections.abc import Callable

from remat.host.link import Link
from remat.planner.lowering import chain_from_trace, stage_key
from remat.planner.offload_model import Item, OffloadProblem, backward_step
from remat.trace.types import Phase, Trace

__all__ = ["offload_problem", "sub_block"]


def sub_block(key: Callable[[str], str]) -> Callable[[str], str]:
    """The key one module level below ``key``'s blocks (``transformer.h.3.attn.c_attn`` ->
    ``transformer.h.3.attn``): offload's steps. A reload must be done before the step that needs
    it starts and counts from the step it starts in, so steps of whole blocks would hold the next
    block's tensors through the current one's backward."""

    def finer(module: str) -> str:
        block = key(module)
        depth = len(block.split(".")) + 1 if block else 1
        return ".".join(module.split(".")[:depth])

    return finer


def offload_problem(
    trace: Trace,
    link: Link,
    *,
    host_budget: int | None = None,
    key: Callable[[str], str] | None = None,
) -> OffloadProblem:
    """The offload problem of a captured step: a chain of the sub-blocks of ``key``'s blocks
    (``sub_block``, ``chain_from_trace``) and one Item per storage autograd saved that a stage's
    op made and a backward op reads. A backward op belongs to the stage of its module's
    sub-block (ops of an ambiguous one go with the previous backward op's stage, as
    ``chain_from_trace`` does)."""
    block = sub_block(key or stage_key)
    chain = chain_from_trace(trace, key=block)
    n = len(chain)
    stage_of_op = {i: k for k, st in enumerate(chain.stages) for i in st.ops}
    stages_by_name: dict[str, list[int]] = {}
    for k, st in enumerate(chain.stages):
        stages_by_name.setdefault(st.name, []).append(k)
    top = "(top level)"
    back_stage: dict[int, int] = {}
    current = n - 1
    for op in trace.ops:
        if op.phase is Phase.BACKWARD:
            owners = stages_by_name.get(block(op.module) or top, [])
            current = owners[0] if len(owners) == 1 else current
            back_stage[op.index] = current
    saved = trace.saved_roots
    maker: dict[int, int] = {}
    readers: dict[int, set[int]] = {}
    backward: dict[int, list[int]] = {}
    for op in trace.ops:
        if op.phase is Phase.FORWARD and op.index in stage_of_op:
            for t in op.inputs:
                readers.setdefault(trace.root(t), set()).add(stage_of_op[op.index])
            for t in op.outputs:
                info = trace.tensors[t]
                if info.alias_of is None and not info.constant and t in saved:
                    maker.setdefault(t, op.index)
        elif op.phase is Phase.BACKWARD:
            for r in {trace.root(t) for t in op.inputs} & saved:
                backward.setdefault(r, []).append(backward_step(n, back_stage[op.index]))
    items = []
    for r, i in sorted(maker.items(), key=lambda kv: (kv[1], kv[0])):
        if r not in backward:
            continue
        a = stage_of_op[i]
        others = frozenset(readers.get(r, set()) - {a})
        until = max([a, *others])
        need, freed = min(backward[r]), max(backward[r])
        op = trace.ops[i]
        items.append(
            Item(
                f"{op.packet}@{op.module or top}",
                r,
                trace.tensors[r].nbytes,
                a,
                until,
                need,
                max(freed, until),
                others,
                until == a and need == backward_step(n, a) and a < n - 1,
                (i,),
            )
        )
    # steps as runs of ops: a forward step is its stage's ops; a backward step starts at the first
    # backward op of its stage (or where the next step starts, for a stage without one) and runs
    # to the next step's start
    starts: list[int | None] = [min(st.ops) for st in chain.stages] + [None] * n
    for i, k in sorted(back_stage.items(), reverse=True):
        starts[backward_step(n, k)] = i
    end = len(trace.ops)
    for s in reversed(range(n, 2 * n)):
        starts[s] = starts[s] if starts[s] is not None else (starts[s + 1] if s + 1 < 2 * n else end - 1)
    first = [int(x) for x in starts if x is not None]
    for s in range(n + 1, 2 * n):
        first[s] = max(first[s], first[s - 1])
    bounds = [(first[s], max(chain.stages[s].ops)) for s in range(n)]
    bounds += [(first[s], (first[s + 1] - 1 if s + 1 < 2 * n else end - 1)) for s in range(n, 2 * n)]
    return OffloadProblem(chain, tuple(items), link, host_budget, tuple(bounds))
