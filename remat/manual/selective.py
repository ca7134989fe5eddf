"""Selective recomputation for ``remat.checkpoint``: keep the outputs a policy says to save.

In forward, a dispatch mode asks the policy about each op and keeps the outputs it says to SAVE,
with the position of the op among all ops of the region. In the recomputation the same mode
hands those outputs back instead of running the op again, so expensive ops (matmul, attention) are
not recomputed while cheap pointwise ones are. The ops are matched by position and name; a
different op at a saved position means the recomputation took another path than the forward,
which is an error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat._errors import RecomputationError, message
from remat.policy import Decision, OpContext, Policy


def _out_bytes(out: Any) -> int:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(o.untyped_storage().nbytes() for o in outs if isinstance(o, torch.Tensor))


def _cacheable(func: Any) -> bool:
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


class SaveCache:
    """The outputs a policy chose to keep, in the order the forward produced them."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.entries: dict[int, tuple[str, Any]] = {}

    def wants(self, func: Any, out: Any) -> bool:
        if not _cacheable(func):
            return False
        ctx = OpContext(
            op=str(func),
            packet=str(func.overloadpacket),
            out_bytes=_out_bytes(out),
            random=torch.Tag.nondeterministic_seeded in func.tags,
        )
        return self.policy.decide(ctx) is Decision.SAVE


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out)
    return out


class Recording(TorchDispatchMode):
    """Forward side: run every op, keep the outputs the policy saves."""

    def __init__(self, cache: SaveCache) -> None:
        super().__init__()
        self.cache = cache
        self.position = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.cache.wants(func, out):
            self.cache.entries[self.position] = (str(func), _detached(out))
        self.position += 1
        return out


class Replaying(TorchDispatchMode):
    """Recomputation side: hand saved outputs back in order, run everything else."""

    def __init__(self, cache: SaveCache, api: str) -> None:
        super().__init__()
        self.cache = cache
        self.api = api
        self.position = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        entry = self.cache.entries.get(self.position)
        self.position += 1
        if entry is None:
            return func(*args, **(kwargs or {}))
        name, saved = entry
        if name != str(func):
            raise RecomputationError(
                message(
                    self.api,
                    "the recomputation ran another op where the forward saved one",
                    f"op #{self.position - 1}: expected {name}, got {func}",
                    "make the checkpointed code take the same path in forward and backward",
                )
            )
        return _detached(saved)
