"""What a function can reach without running it: the values its closure and its default arguments
hold (``lambda h, layer=layer: layer(h)``) and its code names as globals, and those of the
functions it reaches that way, to ``FOLLOW_DEPTH`` calls deep (``step`` calling ``body`` which
runs a model written at a script's top level), and the attributes
of the object a method is bound to, where that is not a module (``remat.checkpoint(runner.block,
x)``: the modules ``runner`` holds).

Read by the buffer shield (``remat.manual.buffers``: the modules a region runs) and by the search
for the program's own generators (``remat.manual.own_generators``). A superset at worst: a global
that only shares its name with an attribute the code reads is taken too. Not reached: attributes
of the other values found (a generator an object in a global holds) and functions called through
an object.
"""

from __future__ import annotations

import collections
import types
from typing import Any

from torch import nn

__all__ = ["CONTAINER_LIMIT", "FOLLOW_DEPTH", "held"]

FOLLOW_DEPTH = 3  # calls followed from a region's function to the functions it names
CONTAINER_LIMIT = 256  # items: a larger list, tuple or dict found (a loss history) is not searched


def held(fn: Any) -> list[Any]:
    """The values ``fn`` (a function, a bound method, or an object's ``__call__``) holds in its
    closure or default arguments or names as globals, and those of the functions among them, to
    ``FOLLOW_DEPTH`` calls deep; for a method of an object that is not a module, also the object's
    attributes."""
    owners = type(fn).__mro__ if not isinstance(fn, (nn.Module, type)) else ()
    call = next((k.__dict__["__call__"] for k in owners if "__call__" in k.__dict__), None)
    if isinstance(call, types.FunctionType):  # a callable object of a class of the program's own
        fn = types.MethodType(call, fn)  # its ``__call__``, bound: the object's attributes are reached
    found: list[Any] = []
    seen: set[int] = set()
    todo: collections.deque[tuple[Any, int]] = collections.deque([(fn, 0)])
    while todo:  # breadth first: a function is met first where it is shallowest
        f, depth = todo.popleft()
        if id(f) in seen or isinstance(f, nn.Module):  # a module holds no closure, defaults or code
            continue
        seen.add(id(f))
        values = [_content(cell) for cell in getattr(f, "__closure__", None) or ()]
        values += [
            *(getattr(f, "__defaults__", None) or ()),
            *(getattr(f, "__kwdefaults__", None) or {}).values(),
        ]
        owner = getattr(f, "__self__", None)  # a method of an object of the program's own
        if depth == 0 and not isinstance(owner, (nn.Module, types.ModuleType)):
            values += list(getattr(owner, "__dict__", {}).values())
        code, names = getattr(f, "__code__", None), getattr(f, "__globals__", None)
        if isinstance(code, types.CodeType) and isinstance(names, dict):
            values += [names[n] for n in _names(code) if n in names]
        found += values
        todo += [(v, depth + 1) for v in values if isinstance(v, types.FunctionType) and depth < FOLLOW_DEPTH]
    return found


def _names(code: types.CodeType) -> list[str]:
    """The names ``code`` and the code objects inside it (comprehensions, lambdas) read."""
    inner = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return [*code.co_names, *(n for c in inner for n in _names(c))]


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a free variable not bound yet
        return None
