"""Which regions of a plan run as their module called again, not replayed from a tape.

NOTE [module re-run] A tape (``remat.manual.tape``) records every op of a region through a dispatch
mode in forward and replays the ones backward needs from Python: some tens of microseconds per op
on the host, beside the kernels. A region that is exactly one call of one module can run as
``torch.utils.checkpoint`` runs it instead (``remat.planner.rerun``): the call runs bare under
saved-tensor hooks that keep a handle for each tensor autograd saves, and backward calls the
module again, with the same random numbers, up to the last save, with no Python per op. A region
qualifies when

- it keeps nothing (a kept output is handed back by its position among the ops, which only a
  dispatch mode sees);
- its forward ops are exactly the ops of one call of one module: every op of the region is the
  module's or a submodule's, no op elsewhere is, and the capture counted one call of it
  (``Trace.calls``; a module called twice in a row, as ALBERT calls its shared layer, or whose
  child is called again outside its call, does not qualify);
- the capture knows every tensor the call was given (``Trace.call_inputs``: tensors and plain
  values only, not an object that may hold tensors, such as a cache) and saw it draw no random
  number from a generator given to an op (a module's own ``torch.Generator``, which the call run
  again would draw from anew: the default generators' states are kept at every call);
- the step holds no memory that no op made (``Trace.unseen_bytes``: the random-number states of a
  ``torch.utils.checkpoint`` inside it, which a call run again would copy again, unseen);
- no op of it writes a storage made before it (batch norm's running statistics, an in-place op
  on its input), which the call run again would see written, or write twice;
- the op of its last save writes none of its arguments: the re-run stops at that save, before the
  op's kernel, which may fill what it saved (``rrelu_with_noise`` fills its noise: NOTE [early
  stop] in ``remat.manual.early_stop``); such a region stays on its tape.

What it then does, for the prediction (``remat.planner.predict``): its handles are the tape's
targets (what the region made and autograd saved while it ran) and what its last op saves of its
own outputs (a layer norm's statistics, an activation's result at the end of a block: saves right
after the last op that a backward op of the module reads; the tape leaves those to autograd); its
re-run runs every op of the region before the op where the call's last save came (``Rerun.stop``),
each value living as long as the forward kept it (Python holds values as the code does, until the
re-run stops) and the targets until backward lets them go; it holds the call's inputs, and the
generators' states, until the last backward op that reads what it packed, and saves the states
around its re-run. Its ops are checked one by one in forward only at its first call in each train
or eval mode, dropout rate, autocast state and set of attention kernels (NOTE [a call run bare is
checked once] in ``remat.planner.rerun``; the ops after it always are; a forward pre-hook that runs
ops is refused); running again, it checks that every tensor the call read (its arguments, the
module's parameters, buffers and tensor attributes) is at the version it read, and each tensor it
makes again against the forward's shape and dtype. Values it does not check: a module whose Python
state or data changes what it computes between its calls after the first breaks the contract, as
it does ``torch.utils.checkpoint``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.planner.region_model import Rerun, read_back, writes
from remat.trace.types import Phase, Trace

__all__ = ["module_of", "rerun_of"]


def module_of(trace: Trace, first: int, last: int) -> str | None:
    """The outermost module whose one call issued exactly the forward ops ``first`` .. ``last``
    (trace op indices, the region's own and the uncounted ones between them)."""
    calls = dict(trace.calls)
    module = trace.ops[first].module
    parts = module.split(".") if module else []
    for k in range(1, len(parts) + 1):
        name = ".".join(parts[:k])
        span = trace.module_spans.get(name)
        if span is None or calls.get(name) != 1 or span[:2] != (first, last):
            continue
        inside = sum(1 for op in trace.ops[first : last + 1] if op.phase is Phase.FORWARD and op.module)
        return name if span[2] == inside else None
    return None


def rerun_of(trace: Trace, ops: Sequence[int], save: frozenset[int]) -> Rerun | None:
    """How the region of trace ops ``ops`` that keeps the outputs of ``save`` runs again as its
    module (NOTE [module re-run]), or None where it cannot."""
    if save or not ops or not trace.calls or not trace.saved_at or trace.unseen_bytes:
        return None  # unseen bytes: a module run again may make them again, unseen (NOTE in types)
    first, last = ops[0], ops[-1]
    module = module_of(trace, first, last)
    given = dict(trace.call_inputs).get(module) if module is not None else None
    if module is None or given is None:
        return None
    root = trace.roots
    tensors = trace.tensors
    made = {
        t
        for i in ops
        for t in trace.ops[i].outputs
        if tensors[t].alias_of is None and not tensors[t].constant
    }
    if any(root[t] not in made for i in ops for t in writes(trace.ops[i])):
        return None
    # the last save its hooks see: inside the call, or its last op's of its own outputs
    stop = max(
        (
            p
            for t, p in trace.saved_at
            if first < p <= last
            or (p == last + 1 and root[t] in made and read_back(trace, root[t], module)[0])
        ),
        default=first,
    )
    if stop <= last and writes(trace.ops[stop]):  # NOTE [early stop]: its kernel may fill a save
        return None
    inputs = frozenset(root[t] for t in given if not tensors[root[t]].constant)
    return Rerun(module, stop, inputs)
