"""Capture one training step as a Trace: the entry point, for a step function or a model.

``capture`` runs the step once under a ``Recorder`` (``remat.trace.recorder``: the dispatch mode
that records ops and storages, NOTE [trace identity]), with ``remat.trace.attribution`` following
phases and modules (NOTE [phases]), then prices the ops with ``remat.trace.cost``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from remat._errors import RematTypeError, RematValueError, message
from remat._state import untouched
from remat._units import whole
from remat.trace import cost
from remat.trace.let_go import with_let_go
from remat.trace.recorder import Recorder
from remat.trace.types import Trace

__all__ = ["capture"]


@overload
def capture(
    step: Callable[[], object],
    *,
    name: str = ...,
    repeats: int = ...,
    device: cost.DeviceProfile | str | None = ...,
    progress: Callable[[int], None] | None = ...,
    scratch: bool = ...,
) -> Trace: ...


@overload
def capture(
    step: nn.Module,
    inputs: torch.Tensor | Sequence[Any] | Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = ...,
    name: str = ...,
    repeats: int = ...,
    device: cost.DeviceProfile | str | None = ...,
    progress: Callable[[int], None] | None = ...,
    scratch: bool = ...,
) -> Trace: ...


def capture(
    step: Callable[[], object] | nn.Module,
    inputs: torch.Tensor | Sequence[Any] | Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    name: str = "",
    repeats: int = 3,
    device: cost.DeviceProfile | str | None = None,
    progress: Callable[[int], None] | None = None,
    scratch: bool = True,
) -> Trace:
    """Run one training step and return its Trace.

    ``capture(step)`` runs ``step()`` (forward, backward and, if it does one, the optimizer step).
    ``capture(model, inputs, loss_fn, optimizer=None)`` runs ``loss_fn(model(*inputs)).backward()``
    (``model(**inputs)`` for a mapping) after setting the model's gradients to None, then
    ``optimizer.step()`` if one is given. A model whose parameters are fake tensors runs under
    their FakeTensorMode; a ``step`` on fake tensors must enter its mode itself.

    Each op's ``cost`` is the median of ``repeats`` timed runs (ops that mutate, draw random
    numbers or are not ATen ops run once; 0.0 on fake tensors); ``est_cost`` comes from
    ``remat.trace.cost`` for ``device`` (a profile or preset name; default by the trace's
    device). ``progress(n)`` is called every 256 ops. With ``scratch`` (the default), each pure
    op's ``scratch`` (the buffers its kernel allocates and frees while it runs) is measured on one
    more run of the op, once per op signature and process; on CPU through the profiler, so not
    while another profiler runs (it is then 0).
    """
    _check(repeats, loss_fn, optimizer, name, progress, scratch)
    if isinstance(step, nn.Module):
        if inputs is None or loss_fn is None:
            raise RematTypeError(
                message(
                    "trace.capture",
                    "a model needs inputs and a loss function",
                    f"got inputs={type(inputs).__name__}, loss_fn={type(loss_fn).__name__}",
                    "call capture(model, inputs, loss_fn) or capture(step) with a callable",
                )
            )
        if not isinstance(inputs, (torch.Tensor, Sequence, Mapping)) or isinstance(inputs, str):
            raise _wrong(
                "inputs is a tensor, a sequence of the model's arguments or a mapping of them",
                inputs,
                "pass capture(model, (x,), loss_fn)",
            )
        run, forward, fake_mode = _model_step(step, inputs, loss_fn, optimizer)
        name, models = name or type(step).__name__, [step]
    elif isinstance(step, type) and issubclass(step, nn.Module):  # made, not run
        raise _wrong("step is a model or a function, not a model's class", step, "pass the model itself")
    elif callable(step):
        run, forward, fake_mode, models = step, None, None, []
    else:
        raise RematTypeError(
            message(
                "trace.capture",
                "the step must be a callable or an nn.Module",
                f"got {type(step).__name__}",
                "pass a function that runs one training step",
            )
        )
    recorder = Recorder(repeats, progress, scratch)
    if isinstance(step, nn.Module):
        recorder.attribution.name_modules(step)
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), recorder.hooks():
        run()
    trace = cost.estimate(recorder.trace(name), device)
    if forward is not None:  # the forward once more, leaving no trace on the model (NOTE [let go])
        with fake_mode if fake_mode is not None else contextlib.nullcontext(), untouched(models):
            trace = with_let_go(trace, forward)
    return trace


def _check(
    repeats: object, loss_fn: object, optimizer: object, name: object, progress: object, scratch: object
) -> None:
    """The keywords' types and ranges, before anything runs."""
    repeats = whole(repeats)
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise _wrong("repeats is a whole number of at least 1", repeats, "pass 1 or more")
    if repeats < 1:
        raise _wrong("repeats is a whole number of at least 1", repeats, "pass 1 or more", RematValueError)
    if loss_fn is not None and not callable(loss_fn):
        raise _wrong("loss_fn is callable", loss_fn, "pass loss_fn(output) returning the loss")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise _wrong("optimizer is a torch.optim.Optimizer", optimizer, "pass the model's optimizer, or None")
    if not isinstance(name, str):
        raise _wrong("name is a string", name, "pass e.g. name='gpt2'")
    if progress is not None and not callable(progress):
        raise _wrong("progress is callable", progress, "pass progress(n_ops), or None")
    if not isinstance(scratch, bool):
        raise _wrong("scratch is True or False", scratch, "pass scratch=False to skip measuring it")


def _wrong(rule: str, value: object, todo: str, kind: type[Exception] = RematTypeError) -> Exception:
    return kind(message("trace.capture", rule, f"got {value!r}"[:120], todo))


def _model_step(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[Any] | Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
) -> tuple[Callable[[], object], Callable[[], object], Any]:
    from torch._guards import detect_fake_mode

    leaves = [*model.parameters(), *model.buffers(), *tree_leaves(inputs)]
    fake_mode = detect_fake_mode([t for t in leaves if isinstance(t, torch.Tensor)])

    def forward() -> torch.Tensor:
        if isinstance(inputs, torch.Tensor):
            loss = loss_fn(model(inputs))
        else:
            loss = loss_fn(model(**inputs) if isinstance(inputs, Mapping) else model(*inputs))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            given = type(loss).__name__
            if isinstance(loss, torch.Tensor):
                given = f"tensor of shape {list(loss.shape)}" + (
                    "" if loss.requires_grad else ", not requiring grad"
                )
            raise RematValueError(
                message(
                    "trace.capture",
                    "loss_fn(output) returns the step's loss: a scalar tensor that requires grad",
                    f"got {given}",
                    "return the loss (a mean or a sum of the output)",
                )
            )
        return loss

    def run() -> None:
        forward().backward()
        if optimizer is not None:
            optimizer.step()

    model.zero_grad(set_to_none=True)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    return run, forward, fake_mode
