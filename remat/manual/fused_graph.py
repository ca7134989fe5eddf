"""Cut a tape slice into runs of ops that can fuse, and build each run's FX graph.

The graph half of compiled replay (``remat.manual.fused``, whose docstring says which ops stay
eager and why): a run is a maximal sequence of deterministic steps that write only into tensors
the run made itself; its graph reads the values earlier steps made and returns the ones later
steps or the slice's targets need, and its *structure* (ops, constant arguments, input layouts)
is the key its compiled code is cached under.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from remat import aten
from remat.manual.tape import Node, Ref, Seq, Step, Write, written_from

_VIEW = torch.ops.aten.view.default
_EMPTY = torch.ops.aten.empty_strided.default


def _arg(node: Node, position: int, name: str) -> Any:
    """An argument of a recorded op, by schema position (or by name where passed as keyword)."""
    return node.args[position] if position < len(node.args) else node.kwargs.get(name)


def _written_arg(node: Node, w: Write) -> Any:
    """The recorded argument (a ``Ref``) a write goes into."""
    arg = node.args[w.key] if isinstance(w.key, int) else node.kwargs.get(w.key)
    return arg if w.item < 0 or arg is None else arg[w.item]


def _fusable(step: Step, owned: set[int]) -> bool:
    """Whether the step can join a run whose own (non-input) storages are ``owned``."""
    node = step.node
    if node.rng is not None or aten.facts(node.func).packet in aten.GRAD_MODE_PACKETS:
        return False
    for w in node.writes:
        if w.clone or w.blank is not None:
            continue
        target = _written_arg(node, w)
        if type(target) is not Ref or target.vid not in owned:
            return False
    return True


def _made(node: Node) -> list[tuple[int, Any]]:
    """The tensors the op returns (value ids), each with the argument it is a view of (a ``Ref``),
    or None for a fresh tensor."""
    info = aten.facts(node.func)
    outs = (node.outs,) if isinstance(node.outs, int) else node.outs
    aliases = info.aliases if len(info.aliases) == len(outs) else info.aliases[:1] * len(outs)
    return [
        (vid, None if alias is None else _arg(node, *alias))
        for vid, alias in zip(outs, aliases, strict=True)
        if vid >= 0
    ]


def _own(step: Step, owned: set[int]) -> None:
    """Add the storages the step's outputs own: fresh tensors, and views of owned ones."""
    for vid, base in _made(step.node):
        if base is None or (type(base) is Ref and base.vid in owned):
            owned.add(vid)
    for w in step.node.writes:
        owned.add(w.vid)


def fusable_runs(steps: Sequence[Step]) -> list[tuple[bool, list[Step]]]:
    """The steps cut into maximal fusable runs (True) and the eager steps between them (False)."""
    runs: list[tuple[bool, list[Step]]] = []
    current: list[Step] = []
    owned: set[int] = set()
    for step in steps:
        if _fusable(step, owned):
            current.append(step)
            _own(step, owned)
            continue
        if current:
            runs.append((True, current))
        current, owned = [], set()
        runs.append((False, [step]))
    if current:
        runs.append((True, current))
    return [(fused and len(run) > 1, run) for fused, run in runs]


def arg_refs(a: Any) -> list[int]:
    if type(a) is Ref:
        return [a.vid]
    if type(a) is Seq:
        return [b.vid for b in a if type(b) is Ref]
    return []


def reads(run: Sequence[Step]) -> tuple[list[int], list[int]]:
    """The value ids the run reads from before it and those it makes, in program order (so that
    equal programs on other value ids give equal structures)."""
    made: dict[int, None] = {}
    inputs: dict[int, None] = {}
    for step in run:
        node = step.node
        made.update(dict.fromkeys(written_from(node, w) for w in node.writes if w.blank is not None))
        for a in (*node.args, *node.kwargs.values()):
            for vid in arg_refs(a):
                if vid not in made:
                    inputs[vid] = None
        outs = (node.outs,) if isinstance(node.outs, int) else node.outs
        made.update(dict.fromkeys(v for v in outs if v >= 0))
        made.update(dict.fromkeys(w.vid for w in node.writes))
    return list(inputs), list(made)


def structure(run: Sequence[Step], inputs: Sequence[int], outputs: Sequence[int]) -> tuple[Any, ...]:
    """The run's ops over value ids renumbered from 0 (inputs first): equal for equal programs."""
    local: dict[int, int] = {vid: i for i, vid in enumerate(inputs)}

    def norm(a: Any) -> Any:
        if type(a) is Ref:
            return ("ref", local.setdefault(a.vid, len(local)))
        if type(a) is Seq or isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(b) for b in a))
        if isinstance(a, float):  # -0.0 == 0.0 and nan != nan; 1 == 1.0 == True with other dtypes
            return ("float", a.hex())
        return (type(a).__name__, a)

    ops = []
    for step in run:
        node = step.node
        args = tuple(norm(a) for a in node.args)
        kwargs = tuple(sorted((k, norm(v)) for k, v in node.kwargs.items()))
        outs = (node.outs,) if isinstance(node.outs, int) else node.outs
        outs_local = tuple(local.setdefault(v, len(local)) if v >= 0 else -1 for v in outs)
        writes = tuple(
            (w.key, w.item, w.clone, w.blank, local.setdefault(w.vid, len(local))) for w in node.writes
        )
        ops.append((node.func, args, kwargs, outs_local, isinstance(node.outs, int), writes))
    return (tuple(ops), tuple(local[v] for v in outputs))


def storages_written(run: Sequence[Step]) -> tuple[dict[int, int], set[int]]:
    """Each value id the run reads or makes -> the value owning its storage (a view's base's), and
    the storages written in place (not counting writes into clones)."""
    root: dict[int, int] = {}
    written: set[int] = set()
    for step in run:
        node = step.node
        for vid, base in _made(node):
            root[vid] = root.get(base.vid, base.vid) if type(base) is Ref else vid
        for w in node.writes:
            if w.clone or w.blank is not None:
                root[w.vid] = w.vid
                continue
            target = _written_arg(node, w)
            if type(target) is Ref:
                written.add(root.get(target.vid, target.vid))
                root[w.vid] = root.get(target.vid, target.vid)
    return root, written


def build_graph(run: Sequence[Step], inputs: Sequence[int], outputs: Sequence[int]) -> fx.GraphModule:
    """The run as an FX graph over the recorded overloads: ``f(*inputs) -> tuple(outputs)``.

    NOTE [view as reshape] Compilation traces the graph with fake tensors, whose strides follow
    the meta kernels, and those need not be eager's: eager ``cat`` on CPU returns a contiguous
    tensor where the meta kernel keeps its inputs' permuted layout, and a ``view`` that eager
    could take (GPT-2's attention: cat, transpose, mul, expand, view) then fails. A ``view``
    of a storage the run makes and does not write is emitted as ``reshape``: the same values, a
    copy only where the layout needs one, and no one outside the run to share the storage with."""
    graph = fx.Graph()
    root, written_storages = storages_written(run)
    fixed = written_storages | set(inputs)  # views of these keep their aliasing, so stay views
    env: dict[int, fx.Node] = {vid: graph.placeholder(f"v{vid}") for vid in inputs}

    def load(a: Any) -> Any:
        if type(a) is Ref:
            return env[a.vid]
        if type(a) is Seq:
            return [env[b.vid] if type(b) is Ref else b for b in a]
        return a

    for step in run:
        node = step.node
        for w in node.writes:
            if w.blank is not None:  # NOTE [blank writes] in ``remat.manual.blank``
                shape, stride, dtype, device = w.blank
                where: dict[str, Any] = {"dtype": dtype, "device": device}
                env[written_from(node, w)] = graph.call_function(_EMPTY, (shape, stride), where)
        args = [load(a) for a in node.args]
        kwargs = {k: load(v) for k, v in node.kwargs.items()}
        written: list[fx.Node] = []
        for w in node.writes:
            box: Any = args if isinstance(w.key, int) else kwargs
            holder, slot = (box, w.key) if w.item < 0 else (box[w.key], w.item)
            if w.clone:
                holder[slot] = graph.call_function(torch.ops.aten.clone.default, (holder[slot],))
            written.append(holder[slot])
        func = node.func
        if func is _VIEW and isinstance(node.outs, int) and root.get(node.outs) not in fixed:
            func = torch.ops.aten.reshape.default
        out = graph.call_function(func, tuple(args), kwargs)
        if isinstance(node.outs, int):
            if node.outs >= 0:
                env[node.outs] = out
        else:
            for i, vid in enumerate(node.outs):
                if vid >= 0:
                    env[vid] = graph.call_function(operator.getitem, (out, i))
        for w, target in zip(node.writes, written, strict=True):
            env[w.vid] = target
    graph.output(tuple(env[vid] for vid in outputs))
    return fx.GraphModule(torch.nn.Module(), graph)
