"""A ``.backward()`` inside a function that is run again: refused while it runs again.

NOTE [backward run again] A checkpointed function that calls ``loss.backward()`` (an inner step
that accumulates into ``.grad``) accumulates once in forward; when backward runs the function
again to remake what it saved, the call would accumulate a second time: ``.grad`` doubled, with
no error (``torch.utils.checkpoint`` does this). And code after the call that reads ``.grad`` would
read other values than the forward read, so what the run remakes would differ too. So while a
function runs again, ``torch.autograd.backward`` (``Tensor.backward`` calls it) raises a clear
error in that thread. ``torch.autograd.grad`` accumulates nothing and stays allowed (a gradient
penalty, MAML's inner step), and a ``.backward()`` the run stops before (NOTE [early stop]: after
the last saved tensor) is never reached again, so it is never refused.

The replacement is installed only while some thread runs a function again, and calls in other
threads pass through to torch's own function.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from remat._errors import RecomputationError, message

_local = threading.local()
_lock = threading.Lock()
_running = [0]  # runs again in progress, over all threads
_original: list[Callable[..., Any]] = []


def _backward(*args: Any, **kwargs: Any) -> Any:
    api = getattr(_local, "api", None)
    if api is not None:
        raise RecomputationError(
            message(
                api,
                "a function run again in backward may not call .backward(), which would add to "
                ".grad a second time",
                "got a .backward() (torch.autograd.backward) in the function",
                "compute the inner gradient with torch.autograd.grad(...) instead, or leave this "
                "function out of the checkpoint",
            )
        )
    return _original[0](*args, **kwargs)


@contextlib.contextmanager
def refused(api: str) -> Iterator[None]:
    """Within the block, a ``torch.autograd.backward`` call in this thread raises a ``remat.<api>``
    error (NOTE [backward run again])."""
    with _lock:
        if _running[0] == 0:
            _original[:] = [torch.autograd.backward]
            torch.autograd.backward = _backward  # type: ignore[assignment]
        _running[0] += 1
    outer = getattr(_local, "api", None)
    _local.api = api
    try:
        yield
    finally:
        _local.api = outer
        with _lock:
            _running[0] -= 1
            if _running[0] == 0:
                torch.autograd.backward = _original.pop()  # type: ignore[assignment]
