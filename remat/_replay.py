"""Record the ATen ops of a code region as a tape of value ids, and replay any slice of it.

``remat.scope`` wraps a block of code, not a callable, so in backward there is nothing to call
again. Instead a TorchDispatchMode sees every ATen op the block runs (below autograd and autocast,
so decompositions and dtype casts are already explicit) and writes it down with its tensors
replaced by *value ids*. Backward replays exactly the ops that lead to the tensors it asks for.

Value ids
    Every tensor the tape sees gets one, and an in-place op gives the tensor it writes a new one.
    A tensor no recorded op produced is *external* (a parameter, an input of the region): the tape
    keeps it, with its version counter, and that is the region's memory cost. An internal tensor is
    known only through a weak reference: the tape keeps it alive only when the policy says SAVE.

NOTE [aliasing]
    Values that share storage form a *group*: a view joins the group of the tensor it views (read
    from the op schema), anything else starts its own. An in-place op writes the whole group, so
    every later op that reads a member of the group replays after it (``Node.after``). A write to
    an external is replayed into a clone of a snapshot taken just before the write, so replay never
    touches parameters or batch-norm running statistics, and earlier reads replay against the value
    they saw. Writes into an internal view of an external cannot be replayed that way and are
    refused, as are reads of such a view after its external was written.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat._errors import RecomputationError, message
from remat.policy import Decision, OpContext, Policy

EXTERNAL = -1
"""The producer of a value that no recorded op produced."""

# native_batch_norm and its cuDNN / MIOpen twins update running_mean (argument 3) and running_var
# (argument 4) in place when training (argument 5) is true, but their schemas do not say so.
_UNANNOTATED_WRITES = frozenset({"aten.native_batch_norm", "aten.cudnn_batch_norm", "aten.miopen_batch_norm"})


class OpInfo(NamedTuple):
    """What the tape needs from an overload's schema, computed once per overload."""

    name: str
    packet: str
    random: bool
    tensor_lists: frozenset[int]
    writes: tuple[tuple[int, str], ...]
    write_gate: int
    aliases: tuple[tuple[int, str] | None, ...]


@functools.cache
def op_info(func: torch._ops.OpOverload) -> OpInfo:
    """Written arguments (position, name), the argument each return is a view of, and whether the
    op draws random numbers. ``write_gate`` names a bool argument that must be true for the writes
    to happen, or is -1."""
    arguments = func._schema.arguments
    alias_sets: dict[str, tuple[int, str]] = {}
    writes: list[tuple[int, str]] = []
    tensor_lists = set()
    for i, arg in enumerate(arguments):
        if isinstance(arg.type, torch._C.ListType) and "Tensor" in str(arg.type):
            tensor_lists.add(i)
        if arg.alias_info is not None:
            alias_sets.update(dict.fromkeys(arg.alias_info.before_set, (i, arg.name)))
            if arg.alias_info.is_write:
                writes.append((i, arg.name))
    packet = str(func._overloadpacket)
    gate = -1
    if packet in _UNANNOTATED_WRITES:
        writes, gate = [(3, arguments[3].name), (4, arguments[4].name)], 5
    # A list return (``Tensor(a)[]``) comes without its alias set in Python: it views the one
    # argument that is a view source.
    sources = [i for i, a in enumerate(arguments) if a.alias_info is not None and not a.alias_info.is_write]
    aliases = tuple(
        None
        if r.alias_info is None
        else alias_sets.get(next(iter(r.alias_info.before_set), ""))
        or ((sources[0], arguments[sources[0]].name) if len(sources) == 1 else None)
        for r in func._schema.returns
    )
    return OpInfo(
        name=str(func),
        packet=packet,
        random=torch.Tag.nondeterministic_seeded in func.tags,
        tensor_lists=frozenset(tensor_lists),
        writes=tuple(writes),
        write_gate=gate,
        aliases=aliases,
    )


class Ref(NamedTuple):
    """A tensor argument of a recorded op, by value id."""

    vid: int


class Seq(tuple[Any, ...]):
    """A list argument of a recorded op that holds tensors (as ``Ref``)."""


class Write(NamedTuple):
    """A tensor an op writes: where it sits in the arguments (``item`` >= 0 inside a tensor list)
    and the value id the write makes.
    ``clone``: the tensor is an external's snapshot, so replay writes into a clone of it."""

    key: int | str
    item: int
    vid: int
    clone: bool


class RngState(NamedTuple):
    """The generator a random op drew from (a device's default one, or an explicit one) and its
    state just before the op ran."""

    source: torch.Generator | torch.device
    state: torch.Tensor


class Node(NamedTuple):
    """One recorded op. ``outs`` is the value id of the output, or one per output (-1 where it is
    not a tensor); ``after`` lists the in-place writers it must follow (NOTE [aliasing])."""

    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outs: int | tuple[int, ...]
    reads: tuple[int, ...]
    writes: tuple[Write, ...]
    after: tuple[int, ...]
    rng: RngState | None


class Step(NamedTuple):
    """A node to replay and the value ids no later step reads (dropped after it runs)."""

    node: Node
    free: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """The slice of a tape that recomputes ``targets``, the kept tensors it reads (with the version
    each had when the tape took it) and the generators whose state it sets."""

    steps: tuple[Step, ...]
    kept: dict[int, tuple[torch.Tensor, int]]
    rng_sources: tuple[torch.Generator | torch.device, ...]
    targets: frozenset[int]


def _get_rng(source: torch.Generator | torch.device) -> torch.Tensor:
    if isinstance(source, torch.Generator):
        return source.get_state()
    if source.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(source.type).get_rng_state(source)


def _set_rng(source: torch.Generator | torch.device, state: torch.Tensor) -> None:
    if isinstance(source, torch.Generator):
        source.set_state(state)
    elif source.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(source.type).set_rng_state(state, source)


def _rng_source(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator | torch.device:
    generator = kwargs.get("generator")
    if generator is not None:
        return generator
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device(kwargs.get("device") or "cpu")


def describe(dtype: torch.dtype, shape: Sequence[int]) -> str:
    """``float32[4, 8]``: how errors name a tensor."""
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def stale_view_error(view: torch.Tensor) -> RecomputationError:
    """A view of an external is used after an in-place op inside the region wrote the external
    (NOTE [aliasing]): replay would see the snapshot, not what the forward saw."""
    return RecomputationError(
        message(
            "scope",
            "a view of a tensor from outside the region was used after that tensor was modified in "
            "place inside the region",
            f"view {describe(view.dtype, view.shape)}",
            "take the view after the in-place op, or clone the tensor inside the region first",
        )
    )


class Tape:
    """The ops of one region, in the order they ran, over value ids."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.nodes: list[Node] = []
        self.producer: list[int] = []  # value id -> index of the node that made it, or EXTERNAL
        self.group: list[int] = []  # value id -> its storage group (NOTE [aliasing])
        self.kept: dict[int, tuple[torch.Tensor, int]] = {}  # value id -> (tensor, version)
        self.writers: dict[int, int] = {}  # group -> last node that wrote it (-1: refused)
        self._saved_in_group: dict[int, list[int]] = {}
        self._ids: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

    def lookup(self, t: torch.Tensor) -> int:
        """The value id the tensor holds now, or -1 if the tape has not seen it."""
        entry = self._ids.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else -1

    def _bind(self, t: torch.Tensor, producer: int, group: int) -> int:
        vid = len(self.producer)
        self.producer.append(producer)
        self.group.append(vid if group < 0 else group)
        self._ids[id(t)] = (weakref.ref(t), vid)
        return vid

    def _read(self, t: torch.Tensor, reads: list[int], after: list[int]) -> Ref:
        entry = self._ids.get(id(t))
        if entry is not None and entry[0]() is t:
            vid = entry[1]
        else:
            vid = self._bind(t, EXTERNAL, -1)
            self.kept[vid] = (t, t._version)
        reads.append(vid)
        if self.writers:
            writer = self.writers.get(self.group[vid])
            if writer is not None:
                if writer < 0:
                    raise stale_view_error(t)
                after.append(writer)
        return Ref(vid)

    def _seq(self, a: Iterable[Any], reads: list[int], after: list[int]) -> Seq:
        return Seq(self._read(b, reads, after) if isinstance(b, torch.Tensor) else b for b in a)

    def _written(
        self, info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[torch.Tensor, int | str, int, torch.Tensor | None]]:
        """The tensors the op is about to write, each with its place in the arguments and, for an
        external, a snapshot of its value before the write."""
        found: list[tuple[torch.Tensor, int | str, int, torch.Tensor | None]] = []
        if info.write_gate >= 0 and not args[info.write_gate]:
            return found
        for pos, name in info.writes:
            key: int | str = pos if pos < len(args) else name
            value = args[pos] if isinstance(key, int) else kwargs.get(name)
            items = [(-1, value)] if isinstance(value, torch.Tensor) else enumerate(value or ())
            for index, t in items:
                if not isinstance(t, torch.Tensor):
                    continue
                vid = self.lookup(t)
                if self.producer[vid] == EXTERNAL:
                    found.append((t, key, index, t.clone()))
                elif self.producer[self.group[vid]] == EXTERNAL:
                    raise RecomputationError(
                        message(
                            "scope",
                            "an in-place op inside the region writes into a view of a tensor from "
                            "outside it, which replay could not do without modifying that tensor",
                            f"{info.name} on view {describe(t.dtype, t.shape)}",
                            "clone the tensor inside the region before modifying it, or modify it "
                            "outside the scope",
                        )
                    )
                else:
                    found.append((t, key, index, None))
        return found

    def _commit_write(
        self, t: torch.Tensor, key: int | str, index: int, snapshot: torch.Tensor | None
    ) -> Write:
        node = len(self.nodes)
        old = self.lookup(t)
        group = self.group[old]
        if snapshot is not None:
            self.kept[old] = (snapshot, snapshot._version)
            self.writers[group] = -1
            return Write(key, index, self._bind(t, node, -1), True)
        # Kept (SAVE) members of the group no longer hold the value later reads expect.
        for vid in self._saved_in_group.pop(group, ()):
            self.kept.pop(vid, None)
        self.writers[group] = node
        return Write(key, index, self._bind(t, node, group), False)

    def _output(
        self,
        o: Any,
        alias: tuple[int, str] | None,
        targs: tuple[Any, ...],
        fresh: list[tuple[int, torch.Tensor]],
    ) -> int:
        if not isinstance(o, torch.Tensor):
            return -1
        vid = self.lookup(o)
        if vid >= 0:  # an argument returned as is: in-place ops return what they wrote
            return vid
        group = -1
        if alias is not None and alias[0] < len(targs) and type(targs[alias[0]]) is Ref:
            group = self.group[targs[alias[0]].vid]
        vid = self._bind(o, len(self.nodes), group)
        fresh.append((vid, o))
        return vid

    def record(self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one op and append it to the tape."""
        info = op_info(func)
        reads: list[int] = []
        after: list[int] = []
        targs = tuple(
            [
                self._read(a, reads, after)
                if isinstance(a, torch.Tensor)
                else self._seq(a, reads, after)
                if i in info.tensor_lists and a is not None
                else a
                for i, a in enumerate(args)
            ]
        )
        tkwargs = {
            k: self._read(v, reads, after)
            if isinstance(v, torch.Tensor)
            else self._seq(v, reads, after)
            if isinstance(v, (list, tuple))
            else v
            for k, v in kwargs.items()
        }
        written = self._written(info, args, kwargs) if info.writes else []
        rng = None
        if info.random:
            source = _rng_source(args, kwargs)
            rng = RngState(source, _get_rng(source))

        out = func(*args, **kwargs)

        writes = tuple([self._commit_write(*w) for w in written]) if written else ()
        fresh: list[tuple[int, torch.Tensor]] = []
        outs: int | tuple[int, ...]
        if isinstance(out, (tuple, list)):
            aliases = info.aliases if len(info.aliases) == len(out) else info.aliases[:1] * len(out)
            outs = tuple(self._output(o, a, targs, fresh) for o, a in zip(out, aliases, strict=True))
        else:
            outs = self._output(out, info.aliases[0] if info.aliases else None, targs, fresh)
        owned = [(vid, t) for vid, t in fresh if self.group[vid] == vid]
        if owned:
            self._decide(info, owned)
        self.nodes.append(Node(func, targs, tkwargs, outs, tuple(reads), writes, tuple(after), rng))
        return out

    def _decide(self, info: OpInfo, owned: list[tuple[int, torch.Tensor]]) -> None:
        """Ask the policy about the op's new, non-view outputs. Views are always recomputed: they
        own no memory, and replaying them is free."""
        ctx = OpContext(
            op=info.name, packet=info.packet, out_bytes=sum(t.nbytes for _, t in owned), random=info.random
        )
        if self.policy.decide(ctx) is Decision.SAVE:
            for vid, t in owned:
                self.kept[vid] = (t, t._version)
                self._saved_in_group.setdefault(vid, []).append(vid)

    def plan(self, targets: Iterable[int], also: Iterable[int]) -> Plan:
        """The steps that recompute ``targets`` (value ids) after running the nodes ``also``."""
        wanted = frozenset(targets)
        producer, kept = self.producer, self.kept
        need = bytearray(len(self.nodes))
        for vid in wanted:
            if producer[vid] >= 0 and vid not in kept:
                need[producer[vid]] = 1
        for index in also:
            need[index] = 1
        for index in range(len(self.nodes) - 1, -1, -1):
            if need[index]:
                node = self.nodes[index]
                for vid in node.reads:
                    if producer[vid] >= 0 and vid not in kept:
                        need[producer[vid]] = 1
                for writer in node.after:
                    need[writer] = 1
        chosen = [node for node, n in zip(self.nodes, need, strict=True) if n]

        last: dict[int, int] = {}
        for s, node in enumerate(chosen):
            outs = (node.outs,) if isinstance(node.outs, int) else node.outs
            for vid in (*node.reads, *outs, *(w.vid for w in node.writes)):
                last[vid] = s
        frees: list[list[int]] = [[] for _ in chosen]
        for vid, s in last.items():
            if vid >= 0 and vid not in wanted and vid not in kept:
                frees[s].append(vid)
        sources = {node.rng.source: None for node in chosen if node.rng is not None}
        return Plan(
            steps=tuple(Step(node, tuple(free)) for node, free in zip(chosen, frees, strict=True)),
            kept={vid: kept[vid] for node in chosen for vid in node.reads if vid in kept},
            rng_sources=tuple(sources),
            targets=wanted,
        )


class Recorder(TorchDispatchMode):
    """The dispatch mode that appends every op run under it to a tape."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.tape.record(func, args, kwargs or {})


def _load(a: Any, env: dict[int, torch.Tensor]) -> Any:
    if type(a) is Ref:
        return env[a.vid]
    if type(a) is Seq:
        return [env[b.vid] if type(b) is Ref else b for b in a]
    return a


def run_step(node: Node, env: dict[int, torch.Tensor]) -> None:
    """Run one recorded op over ``env`` (value id -> tensor) and bind what it makes."""
    args = [_load(a, env) for a in node.args]
    kwargs = {k: _load(v, env) for k, v in node.kwargs.items()}
    written: list[torch.Tensor] = []
    for w in node.writes:
        box: Any = args if isinstance(w.key, int) else kwargs
        holder, slot = (box, w.key) if w.item < 0 else (box[w.key], w.item)
        if w.clone:
            holder[slot] = holder[slot].clone()
        written.append(holder[slot])
    if node.rng is not None:
        _set_rng(*node.rng)
    out = node.func(*args, **kwargs)
    if isinstance(node.outs, int):
        if node.outs >= 0:
            env[node.outs] = out
    else:
        for vid, o in zip(node.outs, out, strict=True):
            if vid >= 0:
                env[vid] = o
    for w, t in zip(node.writes, written, strict=True):
        env[w.vid] = t


def eager_steps(plan: Plan, env: dict[int, torch.Tensor]) -> None:
    """Run the plan's steps op by op over ``env``, dropping each value after its last read."""
    for node, free in plan.steps:
        run_step(node, env)
        for vid in free:
            env.pop(vid, None)


Executor = Callable[[Plan, dict[int, torch.Tensor]], None]
"""How a replay runs a plan's steps: ``eager_steps``, or ``remat._fused.compiled_steps``."""


def replay(plan: Plan, execute: Executor = eager_steps) -> dict[int, torch.Tensor]:
    """Run the plan's steps without autograd or autocast (the tape already holds the casts) and
    return its targets. Random ops draw from the state they drew from in forward; the caller's
    generator states are restored afterwards."""
    env: dict[int, torch.Tensor] = {}
    for vid, (t, version) in plan.kept.items():
        if t._version != version:
            raise RecomputationError(
                message(
                    "scope",
                    "a tensor the region read was modified in place before backward recomputed from it",
                    f"{describe(t.dtype, t.shape)} at version {t._version}, read at version {version}",
                    "clone it before modifying it, or modify it after backward",
                )
            )
        env[vid] = t
    outer = [(source, _get_rng(source)) for source in plan.rng_sources]
    try:
        with torch.no_grad(), torch._C._DisableAutocast():
            execute(plan, env)
    finally:
        for source, state in outer:
            _set_rng(source, state)
    return {vid: env[vid] for vid in plan.targets}
