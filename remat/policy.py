"""Per-op save-or-recompute policies shared by ``remat.checkpoint`` and ``remat.scope``.

A policy answers one question for each ATen op run inside a recomputed region: keep its output for
backward (SAVE), drop it and compute it again (RECOMPUTE), or move it to host memory and bring it
back before backward needs it (OFFLOAD). Policies are small frozen dataclasses,
so they are hashable, comparable and print as what they are.
"""

from __future__ import annotations

import enum
import fnmatch
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import torch

from remat._errors import RematTypeError, RematValueError, message
from remat._units import parse_size


class Decision(enum.Enum):
    """What to do with the output of one op inside a recomputed region."""

    SAVE = "save"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclass(frozen=True)
class OpContext:
    """What a policy may look at: the ATen op (``aten.mm.default``), its packet (``aten.mm``),
    the bytes of its outputs and whether it draws random numbers. ``module`` is the path of the
    module whose call issued it, below the region's root (NOTE [module paths] in
    ``remat._module_path``): ``"attn.c_proj"``; the root's own ops, the root's class name; ops
    outside any module call of the region, "".
    Where the form has them, ``overload``, ``args`` and ``kwargs`` are the op and the arguments it
    was called with (what a ``torch.utils.checkpoint`` policy function reads); they take no part in
    equality or hashing."""

    op: str
    packet: str
    module: str = ""
    out_bytes: int = 0
    random: bool = False
    overload: Any = field(default=None, compare=False, repr=False)
    args: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    kwargs: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@runtime_checkable
class Policy(Protocol):
    """Anything with ``decide(ctx) -> Decision`` is a policy."""

    def decide(self, ctx: OpContext) -> Decision: ...


def checked(api: str, policy: object) -> Policy | None:
    """``policy`` if it is None or a policy object, else a clear error (a policy class where an
    instance was meant, an object with no ``decide``)."""
    if policy is None or (isinstance(policy, Policy) and not isinstance(policy, type)):
        if policy is not None and type(policy) not in _TAKES_CTX:
            _takes_ctx(api, policy)
        return policy
    if isinstance(policy, type):
        given, hint = (
            f"the class {policy.__name__}",
            "pass an instance, such as SaveComputeIntensive() (with the parentheses)",
        )
    elif callable(policy):
        given = f"the function {getattr(policy, '__name__', type(policy).__name__)}"
        hint = "put the function in the decide(ctx) method of a class, or pass SaveOps({...})"
    else:
        given, hint = type(policy).__name__, "pass a policy object such as SaveComputeIntensive()"
    rule = "policy must be an object with a decide(ctx) -> Decision method"
    rule += ", not its class" if isinstance(policy, type) else ""
    raise RematTypeError(message(api, rule, given, f"{hint}, or None"))


_TAKES_CTX: set[type] = set()  # policy classes whose ``decide`` takes one context


def _takes_ctx(api: str, policy: object) -> None:
    """Refuse a ``decide`` that is no method of one argument (``decide = 5``, ``def decide(self)``),
    which failed at the first op with Python's own error."""
    decide = policy.decide  # type: ignore[attr-defined]
    try:
        inspect.signature(decide).bind(None)
    except TypeError:  # not callable, or not with one argument
        raise RematTypeError(
            message(
                api,
                "policy.decide must be a method taking one OpContext",
                f"{type(policy).__name__}.decide is {_shown(decide)}",
                "define def decide(self, ctx): return Decision.SAVE (or RECOMPUTE, OFFLOAD)",
            )
        ) from None
    except ValueError:  # a builtin with no signature to read: taken as it is
        pass
    _TAKES_CTX.add(type(policy))


def _shown(decide: object) -> str:
    if not callable(decide):
        return f"{decide!r}, not callable"
    try:
        return f"a function of {inspect.signature(decide)}"
    except (TypeError, ValueError):
        return "a callable"


def decided(policy: Policy, ctx: OpContext) -> Decision:
    """``policy.decide(ctx)``, refused where it is not a ``Decision`` (a string, None, torch's
    ``CheckpointPolicy``), which every form would otherwise have taken as some decision silently."""
    made = policy.decide(ctx)
    if not isinstance(made, Decision):  # not a TypeError: an operator (``a @ b``) turns one raised
        # inside a dispatch mode into NotImplemented, and Python's message names no policy
        raise RematValueError(
            message(
                "policy",
                "decide(ctx) must return a remat.Decision",
                f"{type(policy).__name__}.decide gave {made!r} for {ctx.op}",
                "return Decision.SAVE, Decision.RECOMPUTE or Decision.OFFLOAD",
            )
        )
    return made


def _op_names(policy: str, ops: object) -> frozenset[str]:
    """``ops`` as a set of op names ("aten.mm", "aten.mm.default"): one string is no set of them."""
    if (
        isinstance(ops, str)
        or not isinstance(ops, Iterable)
        or not all(isinstance(o, str) and "." in o for o in ops)
    ):
        raise RematTypeError(
            message(
                policy,
                "ops must be a collection of op names such as 'aten.mm' or 'aten.mm.default'",
                repr(ops)[:200],
                f"write {policy}({{'aten.mm', 'aten.addmm'}})",
            )
        )
    unknown = sorted(o for o in ops if not _is_op(o))
    if unknown:  # a typo would silently match no op
        raise RematValueError(
            message(
                policy,
                "each op name must name a torch op (namespace.op or namespace.op.overload)",
                f"no such op: {', '.join(unknown)}"[:200],
                "check the spelling against torch.ops (e.g. 'aten.addmm'), and load a custom op's "
                "library before making the policy",
            )
        )
    return frozenset(ops)


def _is_op(name: str) -> bool:
    """Whether ``name`` is ``namespace.op`` or ``namespace.op.overload`` of a registered torch op."""
    parts = name.split(".")
    if len(parts) not in (2, 3):
        return False
    try:
        found = getattr(getattr(torch.ops, parts[0]), parts[1])
        if not isinstance(found, torch._ops.OpOverloadPacket):  # ``aten.name``: the namespace's own
            return False
        return len(parts) == 2 or parts[2] in found.overloads()
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class RecomputeAll:
    """Keep nothing of the region but its inputs (Chen et al.; the default)."""

    def decide(self, ctx: OpContext) -> Decision:
        return Decision.RECOMPUTE


@dataclass(frozen=True)
class SaveOps:
    """Save the outputs of the named ops (packets such as ``"aten.mm"`` or full overload names),
    recompute the rest."""

    ops: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", _op_names("SaveOps", self.ops))

    def decide(self, ctx: OpContext) -> Decision:
        return Decision.SAVE if ctx.op in self.ops or ctx.packet in self.ops else Decision.RECOMPUTE


COMPUTE_INTENSIVE_OPS: frozenset[str] = frozenset(
    {
        "aten.mm",
        "aten.bmm",
        "aten.addmm",
        "aten.baddbmm",
        "aten.matmul",
        "aten.linear",
        "aten.convolution",
        "aten._convolution",
        "aten.cudnn_convolution",
        "aten.mkldnn_convolution",
        "aten._scaled_dot_product_attention_math",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
    }
)


@dataclass(frozen=True)
class SaveComputeIntensive:
    """Save matmul, convolution and attention outputs; recompute cheap pointwise and normalization
    ops. The selective policy most transformer users want: little extra compute, most of the memory
    of the pointwise intermediates back."""

    def decide(self, ctx: OpContext) -> Decision:
        return Decision.SAVE if ctx.packet in COMPUTE_INTENSIVE_OPS else Decision.RECOMPUTE


@dataclass(frozen=True)
class OffloadOps:
    """Move the outputs of the named ops (packets or full overload names) to host memory, recompute
    the rest."""

    ops: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", _op_names("OffloadOps", self.ops))

    def decide(self, ctx: OpContext) -> Decision:
        return Decision.OFFLOAD if ctx.op in self.ops or ctx.packet in self.ops else Decision.RECOMPUTE


@dataclass(frozen=True)
class OffloadLarger:
    """Move the outputs of ops that make at least ``min_bytes`` (a count or a size such as
    ``"1MiB"``) to host memory, recompute the smaller ones."""

    min_bytes: int | str = 0

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "min_bytes",
            parse_size(self.min_bytes, "policy"),
        )

    def decide(self, ctx: OpContext) -> Decision:
        return Decision.OFFLOAD if ctx.out_bytes >= int(self.min_bytes) else Decision.RECOMPUTE


@dataclass(frozen=True)
class OffloadComputeIntensive:
    """Move matmul, convolution and attention outputs to host memory, recompute the rest: JAX's
    "offload dot products" policy. What is expensive to recompute is fetched, what is cheap is
    recomputed, and neither stays on the device."""

    def decide(self, ctx: OpContext) -> Decision:
        return Decision.OFFLOAD if ctx.packet in COMPUTE_INTENSIVE_OPS else Decision.RECOMPUTE


@dataclass(frozen=True)
class ByModule:
    """Decide by the module that issued the op (``OpContext.module``, NOTE [module paths] in
    ``remat._module_path``): ``decisions`` maps module paths to a ``Decision``. A path covers the
    modules below it and may hold ``fnmatch`` wildcards (``"layers.*.mlp"``); where several match,
    the one of most dotted parts wins (the first given, among those), and ``default`` where none
    does. Megatron's selective recomputation of a GPT-2 block, for one: recompute the attention's
    core and keep the rest, ``ByModule({"attn": RECOMPUTE, "attn.c_attn": SAVE, "attn.c_proj":
    SAVE}, default=SAVE)``."""

    decisions: Mapping[str, Decision] | tuple[tuple[str, Decision], ...] = ()
    default: Decision = Decision.RECOMPUTE

    def __post_init__(self) -> None:
        given = self.decisions
        pairs = list(given.items()) if isinstance(given, Mapping) else given
        if not isinstance(pairs, (list, tuple)) or not all(map(_path_decision, pairs)):
            raise RematTypeError(
                message(
                    "ByModule",
                    "decisions must map module paths (non-empty strings) to remat.Decision values",
                    repr(given)[:200],
                    'write ByModule({"attn": Decision.RECOMPUTE, "mlp": Decision.SAVE})',
                )
            )
        if not isinstance(self.default, Decision):
            raise RematTypeError(
                message(
                    "ByModule",
                    "default must be a remat.Decision",
                    repr(self.default)[:200],
                    "pass default=Decision.SAVE, Decision.RECOMPUTE or Decision.OFFLOAD",
                )
            )
        ranked = sorted(pairs, key=lambda p: -p[0].count("."))  # stable: the first given among equals
        object.__setattr__(self, "decisions", tuple(ranked))

    def decide(self, ctx: OpContext) -> Decision:
        for path, decision in cast(tuple[tuple[str, Decision], ...], self.decisions):
            if fnmatch.fnmatchcase(ctx.module, path) or fnmatch.fnmatchcase(ctx.module, path + ".*"):
                return decision
        return self.default


def _path_decision(pair: object) -> bool:
    return (
        isinstance(pair, tuple)
        and len(pair) == 2
        and isinstance(pair[0], str)
        and bool(pair[0])
        and isinstance(pair[1], Decision)
    )


def describe(policy: Policy) -> str:
    """A short human-readable name for tables and errors."""
    return type(policy).__name__
