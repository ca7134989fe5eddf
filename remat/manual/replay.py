"""Replay a slice of a tape: run its recorded ops again over value ids, eagerly, op by op.

The tape (``remat.manual.tape``) records; this module re-runs. ``replay`` sets the scene every
executor shares (kept tensors checked against the versions they had when the tape took them, no
autograd, no autocast since the tape already holds the casts, the caller's generators given back
after); an executor runs the steps: ``eager_steps`` here, or ``remat.manual.fused.compiled_steps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from remat import aten
from remat._errors import RecomputationError, message
from remat.aten import describe
from remat.host.offloader import Offloader
from remat.manual.tape import Node, Ref, Seq, Slice, written_from
from remat.manual.traced import outside_transforms


def _load(a: Any, env: dict[int, torch.Tensor]) -> Any:
    if type(a) is Ref:
        return env[a.vid]
    if type(a) is Seq:
        return [env[b.vid] if type(b) is Ref else b for b in a]
    return a


def run_step(node: Node, env: dict[int, torch.Tensor]) -> None:
    """Run one recorded op over ``env`` (value id -> tensor) and bind what it makes."""
    for w in node.writes:
        if w.blank is not None:  # NOTE [blank writes]: somewhere to write, of any content
            shape, stride, dtype, device = w.blank
            env[written_from(node, w)] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    # the common argument, a tensor (``Ref``), is loaded inline: this runs once per replayed op
    args = [env[a.vid] if type(a) is Ref else _load(a, env) for a in node.args]
    kwargs = {k: _load(v, env) for k, v in node.kwargs.items()} if node.kwargs else {}
    written: list[torch.Tensor] = []
    for w in node.writes:
        box: Any = args if isinstance(w.key, int) else kwargs
        holder, slot = (box, w.key) if w.item < 0 else (box[w.key], w.item)
        if w.clone:
            holder[slot] = holder[slot].clone()
        written.append(holder[slot])
    if node.rng is not None:
        aten.restore(node.rng)
    if aten.facts(node.func).packet in aten.GRAD_MODE_PACKETS:
        out = _with_grad_mode(node.func, args, kwargs)
    else:
        out = node.func(*args, **kwargs)
    outs = node.outs
    if isinstance(outs, int):
        if outs >= 0:
            env[outs] = out
    else:
        for vid, o in zip(outs, out, strict=True):
            if vid >= 0:
                env[vid] = o
    for w, t in zip(node.writes, written, strict=True):
        env[w.vid] = t


def _with_grad_mode(func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``func`` run as the forward ran it, with grad mode on (``aten.GRAD_MODE_PACKETS``), over
    detached arguments: it builds no graph."""

    def bare(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.detach()
        return [bare(b) for b in a] if isinstance(a, list) else a

    with torch.enable_grad():
        return func(*[bare(a) for a in args], **{k: bare(v) for k, v in kwargs.items()})


def eager_steps(cut: Slice, env: dict[int, torch.Tensor]) -> None:
    """Run the slice's steps op by op over ``env``, dropping each value after its last read."""
    for node, free in cut.steps:
        run_step(node, env)
        for vid in free:
            env.pop(vid, None)


Executor = Callable[[Slice, dict[int, torch.Tensor]], None]
"""How a replay runs a slice's steps: ``eager_steps``, or ``remat.manual.fused.compiled_steps``."""


def replay(
    cut: Slice, execute: Executor = eager_steps, offloader: Offloader | None = None, api: str = "scope"
) -> dict[int, torch.Tensor]:
    """Run the slice's steps without autograd or autocast (the tape already holds the casts) and
    return its targets. Random ops draw from the state they drew from in forward; the caller's
    generator states are restored afterwards. Offloaded values it reads come back through
    ``offloader`` (the host copy holds the forward's value, whatever happened to the tensor since).
    ``api`` names the caller in errors."""
    env: dict[int, torch.Tensor] = {}
    for vid, (t, version) in cut.kept.items():
        if version >= 0 and t._version != version:  # an inference tensor has no version (-1)
            raise RecomputationError(
                message(
                    api,
                    "a tensor the region read was modified in place before backward recomputed from it",
                    f"{describe(t.dtype, t.shape)} at version {t._version}, read at version {version}",
                    "clone it before modifying it, or modify it after backward",
                )
            )
        storage = aten.storage_of(t)  # None: a sparse or nested tensor, whose memory is not one storage
        if t.numel() and storage is not None and storage.nbytes() == 0:
            raise RecomputationError(
                message(
                    api,
                    "a tensor the region read was freed before backward recomputed from it (its "
                    "storage was resized to 0, as FSDP2 does with the parameters of a unit that "
                    "reshards after forward)",
                    describe(t.dtype, t.shape),
                    "recompute each FSDP2 unit in its own region (remat.checkpoint or remat.scope "
                    "per block) or call remat.integrations.distributed.hide_fsdp_hooks(model)",
                )
            )
        env[vid] = t
    if cut.moved:
        assert offloader is not None, "moved values come from the tape's offloader"
        for vid, parcel in cut.moved.items():
            env[vid] = offloader.back(parcel)
    outer = aten.capture(cut.rng_sources)
    try:
        with torch.no_grad(), torch._C._DisableAutocast(), outside_transforms():
            execute(cut, env)
    finally:
        aten.restore(outer)
    return {vid: env[vid] for vid in cut.targets}
