"""Cutting a chain of modules into pipeline stages, balanced by time or by memory; what a chain
must be to be cut (each child passes one tensor to the next, no parameter shared by two stages).

Why a partition of our own rather than torchgpipe's ``balance_by_time``: under 1F1B a stage does
not hold one micro-batch but as many as the schedule keeps in flight there (P - s on stage s), so
balancing memory weighs each stage's saved bytes by that count (its gradients count once);
balancing time weighs every stage alike. Both are the same exact minimax over contiguous cuts (a
small dynamic program over the children), with costs measured once per child on the example
micro-batch::

    children:   c0 c1 c2 | c3 c4 | c5 c6 c7        cut so that the largest of
    stage:          0         1        2           weight(s) * sum(cost of its children) is least
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._state import untouched

__all__ = ["BALANCES", "ChildCost", "balance", "chained", "children_of", "leaf_safe", "profile", "untied"]

# step: searched with the stages' plans (remat.pipeline.cut_search); auto: step where each rank runs
# one stage, else memory
BALANCES: tuple[str, ...] = ("auto", "step", "time", "memory")


@dataclass(frozen=True)
class ChildCost:
    """One child's forward+backward CPU seconds, the bytes autograd saves for its backward
    (parameters left out) on the example micro-batch, and its parameters' gradient bytes."""

    seconds: float
    saved_bytes: int
    grad_bytes: int


def _saved_bytes(child: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    params = {p.data_ptr() for p in child.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = child(x)
    return y, sum(seen.values())


def profile(children: Sequence[nn.Module], example: torch.Tensor, repeats: int = 3) -> list[ChildCost]:
    """Each child's cost, run one after another from ``example`` (the RNG and buffers restored)."""
    out: list[ChildCost] = []
    x = example.detach().clone()  # the first child may write its input: never the caller's example
    with untouched(children):
        for child in children:
            x = x.detach().requires_grad_(x.is_floating_point())
            times = []
            for _ in range(repeats):
                start = time.process_time()  # a child that writes its input needs one with history
                y, saved = _saved_bytes(child, x.clone() if x.requires_grad else x)
                if y.requires_grad:
                    y.backward(torch.ones_like(y))
                times.append(time.process_time() - start)
            grad_bytes = sum(p.numel() * p.element_size() for p in child.parameters() if p.requires_grad)
            out.append(ChildCost(statistics.median(times), saved, grad_bytes))
            x = y
    return out


def balance(
    costs: Sequence[float],
    weights: Sequence[int],
    fixed: Sequence[float] | None = None,
    barred: Sequence[bool] = (),
    first: int = 1,
) -> tuple[int, ...]:
    """The cut points (``len(weights) + 1`` of them, first 0, last ``len(costs)``) that minimize
    the largest ``weights[s] * sum(costs of stage s) + sum(fixed of stage s)``, every stage
    non-empty, no stage after the first starting at a child ``barred`` (NOTE [a stage's input is a
    leaf]), the first stage holding at least ``first`` children where some cut can
    (``trainable_from``)."""
    n, parts = len(costs), len(weights)
    first = first if first <= n - parts + 1 else 1  # else the stage's refusal names why
    if parts > n:
        raise RematValueError(
            message(
                "pipeline.plan",
                "more stages than children to cut",
                f"{parts} stages, {n} children",
                "pass fewer stages or a model with more children",
            )
        )
    prefix, once = [0.0], [0.0]
    for c, f in zip(costs, fixed or [0.0] * n, strict=True):
        prefix.append(prefix[-1] + c)
        once.append(once[-1] + f)
    inf = float("inf")
    # best[s][i]: least largest cost with stages 0..s-1 covering children 0..i-1
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for s in range(1, parts + 1):
        for i in range(max(s, first) if s == 1 else s, n - (parts - s) + 1):
            for j in range(s - 1, i):
                if s > 1 and j < len(barred) and barred[j]:
                    continue
                value = max(best[s - 1][j], weights[s - 1] * (prefix[i] - prefix[j]) + once[i] - once[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    if best[parts][n] == inf:
        raise _refused(
            "no stage but the first starts with a module that writes its input in place (NOTE [a "
            "stage's input is a leaf] in remat.pipeline.split)",
            f"{parts} stages of {n} children, children {[k for k, b in enumerate(barred) if b]} write theirs",
            "pass fewer stages, or make those modules out of place (inplace=False)",
        )
    bounds = [n]
    for s in range(parts, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return tuple(reversed(bounds))


def trainable_from(children: Sequence[nn.Module], example: torch.Tensor) -> int:
    """The fewest children the first stage holds so that it has something to differentiate (torch's
    schedules run a backward on every stage): up to the first child with a parameter that requires
    grad, unless the example requires grad. A cut balanced by time put an in-place ReLU alone in
    the first stage when it happened to measure as long as the rest, and the plan was refused."""
    if example.requires_grad:
        return 1
    for k, child in enumerate(children):
        if any(p.requires_grad for p in child.parameters()):
            return k + 1
    return 1


def _refused(rule: str, given: str, todo: str, kind: type[Exception] = RematValueError) -> Exception:
    return kind(message("pipeline.plan", rule, given, todo))


def cut_points(boundaries: object) -> list[int] | None:
    """``boundaries`` as a list of ints (any sequence of integers, numpy's too), or None; anything
    else is refused."""
    if boundaries is None:
        return None
    tolist = getattr(boundaries, "tolist", None)  # an array's
    given = tolist() if callable(tolist) else boundaries
    listed = list(given) if isinstance(given, Sequence) and not isinstance(given, str) else [None]
    if not all(isinstance(b, Integral) and not isinstance(b, bool) for b in listed):
        raise _refused(
            "boundaries are whole numbers: the first child of each stage after the first",
            f"boundaries={boundaries!r}",
            "pass a list such as boundaries=[2]",
            RematTypeError,
        )
    return [int(b) for b in listed]  # type: ignore[arg-type]


def check_modules(given: object, api: str, rule: str, todo: str) -> None:
    """Refuse ``given`` (by ``rule``) unless it is an ``nn.Module`` (to cut) or a list or tuple of
    them (the stages), naming a module class given for an instance."""
    stages = given if isinstance(given, (list, tuple)) else None
    if isinstance(given, nn.Module) or (stages is not None and all(isinstance(m, nn.Module) for m in stages)):
        return
    what = f"the class {given.__name__}" if isinstance(given, type) else type(given).__name__
    if stages is not None:
        kinds = {f"the class {m.__name__}" if isinstance(m, type) else type(m).__name__ for m in stages}
        what = f"a {what} of {', '.join(sorted(kinds))}"
    raise RematTypeError(message(api, rule, f"got {what}", todo))


def children_of(model: nn.Module) -> list[nn.Module]:
    """The model's children in order, one registered twice listed twice (``children()`` lists it once)."""
    return [m for m in model._modules.values() if m is not None]


def chained(
    children: Sequence[nn.Module], example: torch.Tensor, model: nn.Module | None = None
) -> tuple[list[bool], list[bool]]:
    """Refuse a model whose children do not pass one tensor each to the next, or whose forward
    computes something else than its children in order (run without gradients from the same
    generator state, the buffers and the RNG restored, on a copy of ``example``): the stages run
    the children. Returns, per child, whether the tensor it returns is contiguous (``loose``) and
    whether it writes the tensor it is given in place (``ReLU(inplace=True)``: no stage can start
    with it, NOTE [a stage's input is a leaf])."""
    x: object = example.clone()
    dense: list[bool] = []
    writes: list[bool] = []
    with torch.no_grad(), untouched(children):
        for k, child in enumerate(children):
            version = x._version if isinstance(x, torch.Tensor) else 0
            given = x
            try:
                x = child(x)
            except Exception as error:
                raise _refused(
                    "each child of the model takes the tensor the one before it returns",
                    f"child {k} ({type(child).__name__}) failed on it: {type(error).__name__}: {error}"[:300],
                    "pass a model whose children chain (nn.Sequential of blocks), or the stages",
                    RematTypeError,
                ) from error
            if not isinstance(x, torch.Tensor):
                raise _refused(
                    "each child of the model returns one tensor, the next child's input",
                    f"child {k} ({type(child).__name__}) returned a {type(x).__name__}",
                    "wrap the child so that it returns its tensor (as remat.pipeline.zoo_chain does)",
                    RematTypeError,
                )
            dense.append(x.is_contiguous())
            writes.append(isinstance(given, torch.Tensor) and given._version != version)
    if model is None:
        return dense, writes
    try:
        with torch.no_grad(), untouched(children):
            whole = model(example.clone())
    except Exception as error:  # a container without a forward (nn.ModuleList), or one that fails
        raise _refused(
            "the model's forward runs its children in order, each once, as the stages will",
            f"{type(model).__name__} failed on the example: {type(error).__name__}: {error}"[:300],
            "pass a model whose forward is its children in order (nn.Sequential), or the stage modules "
            "as a list",
            RematTypeError,
        ) from error
    same = isinstance(whole, torch.Tensor) and isinstance(x, torch.Tensor) and whole.shape == x.shape
    if not same or not torch.equal(whole, x):  # type: ignore[arg-type]
        raise _refused(
            "the model's forward runs its children in order, each once, as the stages will",
            f"{type(model).__name__}'s forward computes another result than its {len(children)} children",
            "pass a model whose forward is its children in order (nn.Sequential), or the stage modules",
        )
    return dense, writes


def leaf_safe(starts: Sequence[tuple[int, str]], writes: Sequence[bool]) -> None:
    """Refuse stages after the first that start with a module writing its input in place.

    NOTE [a stage's input is a leaf] torch's ``PipelineStage`` hands a stage the tensor it received
    as a leaf that requires grad, which autograd refuses to write in place (one process runs the
    same module on a tensor with history, which it may write). ``starts``: per such stage, the
    index of its first module among ``writes``, and the stage said in words."""
    for k, name in starts:
        if writes[k]:
            raise _refused(
                "no stage but the first starts with a module that writes its input in place (torch's "
                "stage receives its input as a leaf that requires grad, which autograd refuses to write)",
                name,
                "cut elsewhere (boundaries=), or make that module out of place (inplace=False)",
            )


def loose(stages: Sequence[int]) -> None:
    """Warn of stages whose output is not contiguous: torch sends a contiguous copy of it, so the
    stages after it (and the loss) see another memory layout than one process does, and a kernel
    may sum in another order there."""
    if stages:
        warnings.warn(
            f"remat.pipeline.plan: stage {', '.join(map(str, stages))} returns a tensor that is not "
            "contiguous (a transpose, a slice); torch sends a contiguous copy, so the gradients may "
            "differ from a single process's by float rounding; end the stage with .contiguous() in "
            "the model for bit-for-bit equality",
            stacklevel=3,
        )


def untied(stages: Sequence[nn.Module], model: nn.Module | None = None, cuts: Sequence[int] = ()) -> None:
    """Refuse stages that share a parameter: torch's pipelining gives each stage its own, and
    nothing would sum a shared weight's gradients across stages (tied embeddings split from their
    head trained on part of their gradient, with no error). Where the stages are ``model``'s
    children cut at ``cuts``, the error names the parameters as the model does."""
    names = [n for n, m in model._modules.items() if m is not None] if model is not None else []
    owner: dict[int, tuple[int, str]] = {}
    for s, stage in enumerate(stages):
        for name, param in stage.named_parameters(remove_duplicate=False):
            if names and cuts:  # ``0.weight`` of a stage is ``<its first child's name>.weight``
                k, _, rest = name.partition(".")
                name = f"{names[cuts[s] + int(k)]}.{rest}"
            first, where = owner.setdefault(id(param), (s, name))
            if first != s:
                raise _refused(
                    "stages must not share a parameter (nothing sums its gradients across stages)",
                    f"{where} of stage {first} is {name} of stage {s}",
                    "untie it (give one stage a copy), or keep the modules sharing it in one stage "
                    "with boundaries=",
                )
