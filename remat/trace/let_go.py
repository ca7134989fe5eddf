"""When the program itself lets go of what autograd saved: a forward run again with nothing saved.

NOTE [let go] In a captured step autograd holds every tensor it saved until backward, so the
trace cannot say when the program's own references went: a local that outlives its last reader
(``q, k`` after ``scores = q @ k.T``), a value a module returns and its caller keeps (an attention
layer's probabilities, kept in a tuple until the model returns). A plan that does not keep such a
tensor frees it only then, not after its last reader. So the step's forward is run once more under
the capture's recorder with a saved-tensor hook that keeps nothing (``Recorder.hold_saved`` off;
no backward runs): each storage is released when the program lets go of it. The two runs are paired
op by op (the same forward, from the same generator states and buffers); where their ops differ
(the forward took another path), or where the forward cannot run so (it runs a backward of its
own, which needs what it saved), nothing is recorded and the planner keeps its rule of the last
reader. A storage the program still held when the forward returned is let go after the forward's
last op: the loss function's caller keeps only the loss.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

from remat.trace.recorder import Recorder
from remat.trace.types import Phase, Trace

__all__ = ["with_let_go"]


def with_let_go(trace: Trace, forward: Callable[[], object]) -> Trace:
    """``trace`` with ``let_go`` found by running ``forward()`` (the step's forward and loss, what
    ``trace`` recorded before its backward) once more under the recorder; ``trace`` unchanged where
    the two forwards differ."""
    probe = Recorder(1, None, scratch=False)
    probe.hold_saved = False
    try:
        with probe.hooks():
            forward()  # its result, the loss, is dropped at once: it is released while recording
    except Exception as error:  # a forward that runs a backward of its own cannot run saving nothing
        warnings.warn(
            f"remat: the forward could not run again saving nothing ({type(error).__name__}: {error}); "
            "plans of this step take a tensor autograd saved to go after its last reader",
            RuntimeWarning,
            stacklevel=2,
        )
        return trace
    again = probe.trace("let go")
    # the step's ops before its backward are the forward's, then what ``backward()`` makes first
    # (the loss's gradient, outside any module)
    ops = trace.ops[: len(again.ops)]
    rest = trace.ops[len(again.ops) : next((op.index for op in trace.ops if op.phase is Phase.BACKWARD), 0)]
    if len(ops) != len(again.ops) or any(a.name != b.name for a, b in zip(again.ops, ops, strict=True)):
        return trace
    if any(op.module for op in rest):
        return trace
    released = again.forward_deaths  # no backward: every storage, by the last op at the latest
    roots, saved = trace.roots, trace.saved_roots
    let_go: dict[int, int] = {}
    for op, twin in zip(ops, again.ops, strict=True):
        # beyond its results, an op may have a saved number (NOTE [wrapped numbers] in
        # ``remat.aten.schema``) in one run only: the loss's, whose node the forward run again drops
        n = min(len(op.outputs), len(twin.outputs))
        beyond = [trace.tensors[t] for t in op.outputs[n:]] + [again.tensors[u] for u in twin.outputs[n:]]
        if any(info.shape != () for info in beyond):
            return trace
        for t, u in zip(op.outputs[:n], twin.outputs[:n], strict=True):
            r, ru = roots[t], again.roots[u]
            if r == t and r in saved and ru == u and trace.tensors[t].alias_of is None:
                let_go[r] = released.get(ru, len(ops) - 1)
    return dataclasses.replace(trace, let_go=tuple(let_go.items()))
