"""Context managers that may be entered again, as ``torch.no_grad()`` objects may.

A function made with ``contextlib.contextmanager`` returns an object that can be entered once:
``s = remat.scope()`` entered in a loop failed at the second ``with s:`` with contextlib's own
``AttributeError``. :func:`reusable` makes the object open a fresh context at each entry (nested
or in another thread as well), and keeps it usable as a decorator.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, NoReturn, ParamSpec, TypeVar

from remat._errors import RematTypeError, message

P = ParamSpec("P")
T = TypeVar("T")

__all__ = ["bare", "reusable"]


class Reusable(contextlib.ContextDecorator, Generic[T]):
    """A context that runs ``make(*args, **kwargs)``'s context at each entry."""

    def __init__(self, make: Callable[..., contextlib.AbstractContextManager[T]], args: Any, kwargs: Any):
        self._make, self._args, self._kwargs = make, args, kwargs
        self._open = threading.local()  # per thread, the contexts entered and not left, innermost last

    def __enter__(self) -> T:
        context = self._make(*self._args, **self._kwargs)
        value = context.__enter__()
        if not hasattr(self._open, "stack"):
            self._open.stack = []
        self._open.stack.append(context)
        return value

    def __exit__(self, *exc: Any) -> bool | None:
        return self._open.stack.pop().__exit__(*exc)

    def __copy__(self) -> Reusable[T]:
        """A copy enters the same context, with none open (a module holding the object is copied
        by ``copy.deepcopy`` and an EMA's ``AveragedModel``): its settings are shared, as a
        function's would be, and a copy of them could not be entered in its stead (an offloader
        holds a lock)."""
        return Reusable(self._make, self._args, self._kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Reusable[T]:
        return self.__copy__()


def reusable(function: Callable[P, Iterator[T]]) -> Callable[P, Reusable[T]]:
    """``contextlib.contextmanager(function)``, whose result may be entered again."""
    made = contextlib.contextmanager(function)

    @functools.wraps(function)
    def opened(*args: P.args, **kwargs: P.kwargs) -> Reusable[T]:
        if len(args) == 1 and not kwargs and (inspect.isfunction(args[0]) or inspect.ismethod(args[0])):
            bare(function.__qualname__, args[0], function.__module__)
        return Reusable(made, args, kwargs)

    return opened


def bare(name: str, decorated: Callable[..., Any], module: str = "remat") -> NoReturn:
    """The error for ``@remat.<name>`` written without its parentheses over ``decorated``: the
    function would be taken as the first argument, and calling it would return a function."""
    api = ("memory." if module == "remat.memory" else "") + name
    raise RematTypeError(
        message(
            api,
            "as a decorator it takes its parentheses",
            f"@remat.{api} over the function {getattr(decorated, '__name__', '?')}",
            f"write @remat.{api}() (or with its arguments)",
        )
    )
