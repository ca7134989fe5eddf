"""Replay a tape slice with its runs of deterministic ops compiled into fused kernels.

Eager replay (``remat.manual.replay``) runs every recorded op as its own kernel: recomputing
GPT-2's tanh GELU is eight passes over a [batch, seq, 3072] tensor, a batch norm and its ReLU are
two, each reading and writing memory. ``torch.compile`` fuses such runs into one loop, which is how
its own activation-memory budget recomputes almost for free. ``compiled_steps`` gives replay that
half of it while the forward stays eager::

    replay slice:  [mul pow mul add mul tanh add mul] [dropout] [add_ relu]
                    \\________ one FX graph ________/   eager     \\_ graph _/
                              compiled once per structure, called in every later backward

A run becomes an FX graph of the recorded ATen overloads: the tensors it reads from earlier steps
or from the tape's kept tensors are its inputs, the values later steps or the targets need are its
outputs. It is compiled (Inductor, static shapes) once per *structure*: the ops, their constant
arguments, and the dtype, shape, strides and device of its inputs, so the regions of every later
step, and identical blocks within a step, reuse the compiled code.

What stays eager, op by op:

- random ops: each must draw from the generator state it drew from in forward, and a compiled graph
  cannot set a generator between its ops;
- in-place ops on a tensor the run did not make itself (the graph would write into its input);
- runs of one op (nothing to fuse);
- any run whose compilation failed or whose compiled results disagree with eager ones: the first
  call of each structure also runs it eagerly and compares every output (dtype, shape, values
  within a tolerance for the dtype). Inductor's decompositions need not keep eager's dtypes: a
  bfloat16 batch norm with float32 weights returns float32 statistics in eager and bfloat16 ones
  once decomposed. A ``RuntimeWarning`` says so once per structure, which replays eagerly from
  then on.

Layouts are eager's: compiled code lays tensors out as the meta kernels say, which is not always
what eager kernels do (NOTE [view as reshape]), so recorded views compile as reshapes where that
is safe and outputs come back in the strides the eager run had (NOTE [eager layouts]): later
eager steps and the backward formulas see what they saw in forward. The first call of a
structure holds both its eager and its compiled results for a moment.

Values are Inductor's: equal to eager up to floating-point reassociation, not bit for bit.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from remat._errors import RematValueError, message
from remat.aten import describe
from remat.manual.fused_graph import arg_refs, build_graph, fusable_runs, reads, storages_written, structure
from remat.manual.replay import Executor, eager_steps, run_step
from remat.manual.tape import Slice, Step

__all__ = ["ReplayMode", "compiled_steps", "executor"]

ReplayMode = Literal["eager", "compiled"]
"""How a region's ops replay in backward: op by op, or with fusable runs compiled."""

_Key = tuple[Any, ...]

_compiled: dict[_Key, Callable[..., Any] | None] = {}  # None: replay eagerly (NOTE in the doc)
# structures whose compiled results matched eager ones -> per output, eager's strides where the
# compiled output's differ (NOTE [eager layouts]), else None
_checked: dict[_Key, tuple[tuple[int, ...] | None, ...]] = {}
_lock = threading.Lock()
# rtol, atol of the first-call comparison with eager, by dtype (fused kernels round differently)
_TOLERANCE = {torch.float16: (1e-2, 1e-3), torch.bfloat16: (5e-2, 1e-2)}
_DEFAULT_TOLERANCE = (1e-3, 1e-5)
_EMPTY = frozenset(
    {
        torch.ops.aten.empty,
        torch.ops.aten.empty_like,
        torch.ops.aten.empty_strided,
        torch.ops.aten.empty_permuted,
        torch.ops.aten.new_empty,
        torch.ops.aten.new_empty_strided,
    }
)


def _compile(run: Sequence[Step], inputs: Sequence[int], outputs: Sequence[int], key: _Key) -> Any:
    with _lock:
        if key in _compiled:
            return _compiled[key]
    fn = torch.compile(build_graph(run, inputs, outputs), backend="inductor", fullgraph=True, dynamic=False)
    with _lock:
        _compiled[key] = fn
    return fn


def _give_up(key: _Key, why: str) -> None:
    with _lock:
        _compiled[key] = None
    warnings.warn(
        f"remat: a run of {len(key[0][0])} recorded ops replays op by op, not compiled ({why})",
        RuntimeWarning,
        stacklevel=3,
    )


def _eager_run(
    run: Sequence[Step], env: dict[int, torch.Tensor], inputs: Sequence[int]
) -> dict[int, torch.Tensor]:
    """The run op by op over its inputs (it writes only into tensors it makes or clones)."""
    values = {v: env[v] for v in inputs}
    for step in run:
        run_step(step.node, values)
    return values


def _uninitialized(run: Sequence[Step]) -> set[int]:
    """Value ids the run makes with an ``empty`` op: memory whose values mean nothing yet."""
    return {
        step.node.outs
        for step in run
        if isinstance(step.node.outs, int) and step.node.func.overloadpacket in _EMPTY
    }


def _disagreement(
    compiled: Sequence[torch.Tensor], eager: Sequence[torch.Tensor], blank: Sequence[bool]
) -> str:
    """How the compiled outputs differ from eager ones, or "" where they agree (``blank``: the
    output's values are uninitialized memory, only its dtype and shape count)."""
    for c, e, skip in zip(compiled, eager, blank, strict=True):
        if c.dtype != e.dtype or c.shape != e.shape or c.device != e.device:
            return f"compiled {describe(c.dtype, c.shape)} where eager gives {describe(e.dtype, e.shape)}"
        if skip:
            continue
        rtol, atol = _TOLERANCE.get(e.dtype, _DEFAULT_TOLERANCE)
        if e.is_floating_point() and not torch.allclose(c, e, rtol=rtol, atol=atol, equal_nan=True):
            return f"compiled values of {describe(e.dtype, e.shape)} differ from eager beyond rtol={rtol}"
        if not e.is_floating_point() and not torch.equal(c, e):
            return f"compiled values of {describe(e.dtype, e.shape)} differ from eager"
    return ""


def _checked_once(
    key: _Key,
    run: Sequence[Step],
    env: dict[int, torch.Tensor],
    inputs: Sequence[int],
    outputs: Sequence[int],
    results: Sequence[torch.Tensor],
) -> Sequence[torch.Tensor]:
    """The first call of a structure: its compiled results if they agree with an eager run of it,
    else the eager results (and the structure replays eagerly from then on)."""
    values = _eager_run(run, env, inputs)
    eager = [values[v] for v in outputs]
    blank = _uninitialized(run)
    why = _disagreement(results, eager, [v in blank for v in outputs]) or _unmovable(
        run, inputs, outputs, results, eager
    )
    if why:
        _give_up(key, why)
        return eager
    layouts = tuple(
        None if c.stride() == e.stride() else e.stride() for c, e in zip(results, eager, strict=True)
    )
    with _lock:
        _checked[key] = layouts
    return _in_eager_layout(results, layouts)


def _unmovable(
    run: Sequence[Step],
    inputs: Sequence[int],
    outputs: Sequence[int],
    compiled: Sequence[torch.Tensor],
    eager: Sequence[torch.Tensor],
) -> str:
    """Why a compiled output laid out otherwise than eager's cannot be copied into eager's layout
    (it shares storage with another value, or eager's overlaps itself), or ""."""
    root, written = storages_written(run)
    for vid, c, e in zip(outputs, compiled, eager, strict=True):
        if c.stride() == e.stride():
            continue
        # a view of something only the run sees can be copied; one of an input or of another
        # output, or of a storage written in place, cannot without losing the aliasing
        others = {root.get(v, v) for v in inputs} | {root.get(o, o) for o in outputs if o != vid}
        shared = root.get(vid, vid) in others or root.get(vid, vid) in written
        overlapping = any(st == 0 and n > 1 for st, n in zip(e.stride(), e.shape, strict=True))
        if shared or overlapping:
            return f"compiled {describe(c.dtype, c.shape)} laid out as {c.stride()}, eager as {e.stride()}"
    return ""


def _in_eager_layout(
    results: Sequence[torch.Tensor], layouts: Sequence[tuple[int, ...] | None]
) -> list[torch.Tensor]:
    """NOTE [eager layouts] Compiled outputs take the strides of the meta kernels, which need not be
    eager's (NOTE [view as reshape]); later eager steps and autograd's backward formulas were
    written against eager's, so an output laid out otherwise is copied into eager's strides."""
    return [
        r if s is None else torch.empty_strided(r.shape, s, dtype=r.dtype, device=r.device).copy_(r)
        for r, s in zip(results, layouts, strict=True)
    ]


def compiled_steps(cut: Slice, env: dict[int, torch.Tensor]) -> None:
    """Run the slice's steps over ``env`` (value id -> tensor), fusable runs through compiled
    graphs. Called by ``remat.manual.replay.replay`` (grad and autocast off, generators restored)."""
    steps = cut.steps
    runs = fusable_runs(steps)
    # value id -> index of the last run that reads it
    last_read: dict[int, int] = {}
    for r, (_, run) in enumerate(runs):
        for step in run:
            for a in (*step.node.args, *step.node.kwargs.values()):
                for vid in arg_refs(a):
                    last_read[vid] = r
    for r, (fused, run) in enumerate(runs):
        fn = None
        if fused:
            inputs, made = reads(run)
            outputs = [v for v in made if v in cut.targets or last_read.get(v, -1) > r]
            values = [env[v] for v in inputs]
            layout = tuple((t.dtype, t.shape, t.stride(), t.device, t.storage_offset()) for t in values)
            key = (structure(run, inputs, outputs), layout)
            fn = _compile(run, inputs, outputs, key)
            if fn is not None:
                try:
                    results = fn(*values)
                except Exception as error:  # noqa: BLE001 - any failure of the compiler means eager replay
                    _give_up(key, f"compilation failed: {type(error).__name__}: {error}")
                    fn = None
                else:
                    layouts = _checked.get(key)
                    if layouts is None:
                        results = _checked_once(key, run, env, inputs, outputs, results)
                    elif any(layouts):
                        results = _in_eager_layout(results, layouts)
                    env.update(zip(outputs, results, strict=True))
        if fn is None:
            for step in run:
                run_step(step.node, env)
                for vid in step.free:
                    env.pop(vid, None)
        else:
            for step in run:
                for vid in step.free:
                    env.pop(vid, None)


def executor(api: str, replay: ReplayMode) -> Executor:
    """The executor for a ``replay=`` argument of the public API ``api``."""
    if replay == "eager":
        return eager_steps
    if replay == "compiled":
        return compiled_steps
    raise RematValueError(
        message(api, 'replay must be "eager" or "compiled"', f"got {replay!r}", "pass one of those two")
    )
