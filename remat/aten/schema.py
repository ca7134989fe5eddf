"""The facts of an ATen overload that every dispatch mode reads, computed once per overload.

NOTE [hidden writes] ``native_batch_norm`` and its cuDNN / MIOpen twins update ``running_mean``
(argument 3) and ``running_var`` (argument 4) in place when ``training`` (argument 5) is true, but
their schemas do not say so. Running such an op again would update the statistics twice (a
long-standing problem of recomputation in PyTorch): whoever reruns one must hand it scratch copies,
and no mode may treat it as pure.

NOTE [wrapped numbers] A Python number given where an op's schema takes a tensor (``0.5 * x`` is
``aten.mul.Tensor(x, 0.5)``) becomes a 0-dim CPU tensor, made by torch's argument parser before
autograd and allocated by the CPU allocator (8 bytes for a float). Autograd may save it
(``MulBackward0`` keeps ``other`` while ``x`` wants a gradient), and it then lives until that node's
backward; but dispatch modes see the number, never the tensor, so a trace that counts only what ops
make misses those bytes (GPT-2's GELU saves three a layer). Nor do saved-tensor hooks see it
(autograd packs no wrapped number), so every form of remat keeps it as plain autograd does. The
trace capture notes the arguments of an op given a number (``wrapped_numbers``) and, before the next
op, looks them up on the op's autograd node (``_saved_other``): a 0-dim tensor found there is taken
as made by the op and freed when its storage dies, as any other. Running such an op again (to learn
its scratch) makes the 0-dim tensor anew, so its bytes leave the op's scratch where they are already
counted: for a saved number, and in a backward formula, where the op is handed the saved tensor (as
a number again; a custom ``Function``'s backward makes its numbers anew). Not found: a number given
to an in-place op on a view (``lin(h).mul_(0.1)`` with a 3-D ``h``), whose node autograd keeps
inside the base's ``CopySlices``: its 8 bytes are missing from the trace. Nor counted: a dispatch
mode that runs such an op (the plan's executor, in forward) makes one more 0-dim tensor for its
call, which lives while the op runs.

NOTE [no dropout draws nothing] torch tags an overload random (``nondeterministic_seeded``) by its
schema; attention's fused kernels are random for their ``dropout_p``, and at 0 (every attention of
a model without attention dropout, and all in eval mode) they draw nothing and compute the same
numbers each time. ``draws`` says so of one call: the tape then keeps no generator state for it, and
the trace counts none (``Op.random``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

SKIPPED_NAMESPACES = frozenset({"profiler", "prim"})
"""Not ops of the program: ``record_function`` markers (``Optimizer.step`` has them) and the
metadata queries fake tensors answer through dispatch (``prim.device``)."""

METADATA_PACKETS = frozenset(
    f"aten.{name}"
    for name in (
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "size",
        "stride",
        "numel",
        "dim",
        "storage_offset",
        "is_contiguous",
        "is_non_overlapping_and_dense",
        "is_strides_like_format",
    )
)
"""Queries of a tensor's metadata that reach dispatch on some tensors only (subclasses with
``sizes_strides_policy``, fake tensors): they read no data, and a mode that counts ops must not
count them, or its counts differ between runs of the same code on different tensors."""

UNSAID_VIEWS = frozenset(
    {"aten._unsafe_view", "aten.unsafe_split", "aten.unsafe_split_with_sizes", "aten.unsafe_chunk"}
)
"""Packets whose schema promises a new tensor but whose result may share an argument's storage
(NOTE [aliasing] in ``remat.manual.tape``)."""

READ_OUTSIDE_OPS = {"aten._pack_padded_sequence": 1}
"""Packets one of whose results (at this position) C++ code later reads through its data pointer,
outside any op a dispatch mode sees: a packed sequence's ``batch_sizes``, which the packed LSTM,
GRU and RNN (composites) read for the whole of their loop over time steps. Memory that evicts and
restores tensors between ops must never evict it (``remat.dynamic``: garbage lengths, or torch's
"data is not allocated yet")."""

VALUE_PACKETS = frozenset({"aten._local_scalar_dense", "aten.equal", "aten.is_nonzero"})
"""Packets that hand Python a value read from a tensor's data (``item``, ``bool``, ``equal``): what
the code does next may depend on the data."""

GRAD_MODE_PACKETS = frozenset({"aten.mkldnn_rnn_layer", "aten._cudnn_rnn", "aten.miopen_rnn"})
"""Packets whose results depend on whether grad mode is on: the recurrent kernels return the
workspace their backward reads only then. A replay runs them with grad mode on (over detached
arguments, so that no graph is built)."""

# NOTE [hidden writes]: packet -> (written positions, the bool argument that gates the writes)
_HIDDEN_WRITES: dict[str, tuple[tuple[int, ...], int]] = {
    "aten.native_batch_norm": ((3, 4), 5),
    "aten.cudnn_batch_norm": ((3, 4), 5),
    "aten.miopen_batch_norm": ((3, 4), 5),
}


@dataclass(frozen=True)
class OpFacts:
    """What an overload's schema (and NOTE [hidden writes]) say about it.

    ``writes``: the arguments its schema marks as written, as (position, name).
    ``hidden_writes``: arguments written without the schema saying so; ``write_gate`` is the
    position of the bool argument that must be true for them to be written, or -1.
    ``aliases``: per return, the argument (position, name) it is a view of, or None.
    ``fresh_returns``: per return, whether it is a new tensor (not an alias of an argument).
    ``written_returns``: per return, whether it is a written argument handed back (``add_``).
    ``pointwise``: torch tags it pointwise: its results' sizes do not depend on its numbers.
    ``tensor_places``: the arguments its schema types as one tensor, as (position, name).
    ``dropout_at``: the ``dropout_p`` argument of a random op: (position, name, default).
    """

    name: str
    packet: str
    namespace: str
    random: bool
    tensor_lists: frozenset[int]
    writes: tuple[tuple[int, str], ...]
    hidden_writes: tuple[tuple[int, str], ...]
    write_gate: int
    aliases: tuple[tuple[int, str] | None, ...]
    fresh_returns: tuple[bool, ...]
    written_returns: tuple[bool, ...]
    pointwise: bool = False
    tensor_places: tuple[tuple[int, str], ...] = ()
    dropout_at: tuple[int, str, float] | None = None

    @property
    def skipped(self) -> bool:
        """Not an op of the program (``SKIPPED_NAMESPACES``)."""
        return self.namespace in SKIPPED_NAMESPACES

    @property
    def metadata(self) -> bool:
        """A query of metadata (``METADATA_PACKETS``) or not an op of the program at all."""
        return self.skipped or self.packet in METADATA_PACKETS

    @property
    def view_only(self) -> bool:
        """Every result views an input and nothing is written: the op reads no data."""
        return bool(self.fresh_returns) and not any(self.fresh_returns) and not self.writes

    @property
    def pure(self) -> bool:
        """Safe to run again on the same inputs: an ATen op that writes nothing (hidden writes
        included) and draws no random numbers."""
        return self.namespace == "aten" and not (self.writes or self.hidden_writes or self.random)

    def all_writes(self, args: Sequence[Any]) -> tuple[tuple[int, str], ...]:
        """The declared writes, and the hidden ones where the gate in ``args`` lets them happen."""
        if not self.hidden_writes or (self.write_gate >= 0 and not _gate(args, self.write_gate)):
            return self.writes
        return self.writes + self.hidden_writes


def _gate(args: Sequence[Any], position: int) -> bool:
    return position < len(args) and bool(args[position])


# id of an overload -> (the overload, its facts): an ``OpOverload``'s ``__hash__`` is Python code, and
# every op a dispatch mode sees asks for its facts (the overload is held, so its id stays its own)
_FACTS: dict[int, tuple[torch._ops.OpOverload, OpFacts]] = {}


def facts(func: torch._ops.OpOverload) -> OpFacts:
    """The facts of ``func`` (cached per overload)."""
    entry = _FACTS.get(id(func))
    if entry is None or entry[0] is not func:
        entry = _FACTS[id(func)] = (func, _facts(func))
    return entry[1]


def _facts(func: torch._ops.OpOverload) -> OpFacts:
    schema = func._schema
    arguments = schema.arguments
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
    hidden, gate = _HIDDEN_WRITES.get(packet, ((), -1))
    # A list return (``Tensor(a)[]``) comes without its alias set in Python: it views the one
    # argument that is a view source.
    sources = [i for i, a in enumerate(arguments) if a.alias_info is not None and not a.alias_info.is_write]
    returns = schema.returns
    aliases = tuple(
        None
        if r.alias_info is None
        else alias_sets.get(next(iter(r.alias_info.before_set), ""))
        or ((sources[0], arguments[sources[0]].name) if len(sources) == 1 else None)
        for r in returns
    )
    return OpFacts(
        name=str(func),
        packet=packet,
        namespace=func.namespace,
        random=torch.Tag.nondeterministic_seeded in func.tags,
        tensor_lists=frozenset(tensor_lists),
        writes=tuple(writes),
        hidden_writes=tuple((i, arguments[i].name) for i in hidden if i < len(arguments)),
        write_gate=gate,
        aliases=aliases,
        fresh_returns=tuple(r.alias_info is None for r in returns),
        written_returns=tuple(r.alias_info is not None and r.alias_info.is_write for r in returns),
        pointwise=torch.Tag.pointwise in func.tags,
        tensor_places=tuple(
            (i, a.name) for i, a in enumerate(arguments) if isinstance(a.type, torch._C.TensorType)
        ),
        dropout_at=next(
            (
                (i, a.name, float(a.default_value or 0.0))
                for i, a in enumerate(arguments)
                if a.name == "dropout_p"
            ),
            None,
        ),
    )


def draws(info: OpFacts, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether this call of a random op draws from a generator: NOTE [no dropout draws nothing]."""
    if not info.random:
        return False
    if info.dropout_at is None:
        return True
    pos, name, default = info.dropout_at
    p = args[pos] if pos < len(args) else kwargs.get(name, default)
    return not (isinstance(p, (int, float)) and p == 0)


def writes_hidden(name: str) -> bool:
    """Whether the op named ``name`` (``aten.native_batch_norm.default``, as a trace names it)
    writes arguments its schema does not declare (NOTE [hidden writes])."""
    return name.rsplit(".", 1)[0] in _HIDDEN_WRITES


def written_tensors(
    written: Sequence[tuple[int, str]], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> list[torch.Tensor]:
    """The tensors at the argument places ``written`` (lists of tensors flattened)."""
    found: list[torch.Tensor] = []
    for i, name in written:
        value = args[i] if i < len(args) else kwargs.get(name)
        found.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return found


_NUMBER_BYTES = {bool: 1, int: 8, float: 8, complex: 16}  # the 0-dim tensor's: bool, int64, double, cdouble


def wrapped_numbers(
    op: OpFacts, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[tuple[str, int], ...]:
    """The arguments given a Python number in a tensor's place, each with the bytes of the 0-dim
    tensor torch made of it before the op reached dispatch (NOTE [wrapped numbers])."""
    found = []
    for i, name in op.tensor_places:
        value = args[i] if i < len(args) else kwargs.get(name)
        if type(value) in _NUMBER_BYTES:
            found.append((name, _NUMBER_BYTES[type(value)]))
    return tuple(found)
