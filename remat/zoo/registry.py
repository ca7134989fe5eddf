"""The zoo's registry: named workloads (a model, one batch, a loss) built at a chosen size.

Planners, the simulator, benchmarks and the CLI all need the same real models at paper size (often
on fake tensors, which take no memory) and at a tiny size (for tests). Each model file registers
one ``ZooModel`` with its input kind and size rules, so that a bad name or size is refused here
with the valid choices, before anything is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from remat._arguments import device_of
from remat._errors import RematTypeError, RematValueError, message
from remat._units import whole

__all__ = ["Workload", "ZooModel", "build", "get", "names", "register"]


class Workload(NamedTuple):
    """What ``build`` returns: ``loss_fn(model(*inputs))`` is the loss of one training step."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class ZooModel:
    """One registered model. ``input`` says which size it takes (``seq``: tokens per sample, at
    most ``max_size``; ``image``: side of a square image, a multiple of ``multiple``); ``batch`` and
    ``size`` are the paper-size defaults. ``make(batch, size, tiny)`` builds the workload on the
    current default device (and fake mode, if one is active)."""

    name: str
    summary: str
    input: Literal["seq", "image"]
    batch: int
    size: int
    make: Callable[[int, int, bool], Workload]
    max_size: int | None = None
    multiple: int = 1
    tiny_size: int = 16

    def __str__(self) -> str:
        return f"{self.name}: {self.summary} (default batch {self.batch}, {self.input} {self.size})"


_REGISTRY: dict[str, ZooModel] = {}


def register(model: ZooModel) -> ZooModel:
    """Add ``model`` to the zoo under its name."""
    _REGISTRY[model.name] = model
    return model


def names() -> tuple[str, ...]:
    """The registered model names, sorted."""
    return tuple(sorted(_REGISTRY))


def get(name: str) -> ZooModel:
    """The registered model ``name``, or a ``remat.zoo.build:`` error listing the valid names."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise (RematValueError if isinstance(name, str) else RematTypeError)(
            message(
                "zoo.build", "unknown model name", f"got {name!r}"[:200], f"pass one of {', '.join(names())}"
            )
        )
    return _REGISTRY[name]


def build(
    name: str,
    *,
    batch: int | None = None,
    seq: int | None = None,
    image: int | None = None,
    device: torch.device | str = "cpu",
    fake: bool = False,
    tiny: bool = False,
    seed: int = 0,
) -> Workload:
    """Build the workload ``name`` with random weights and one random batch.

    ``batch`` and ``seq`` (text and sequence models) or ``image`` (vision models) default to the
    paper sizes (``remat.zoo.get(name)``), or to a tiny batch when ``tiny``. ``tiny=True`` shrinks
    the model itself (depth and width) for tests; the architecture stays the same. ``fake=True``
    builds everything on fake tensors (``FakeTensorMode``): any size, no memory, for tracing
    with ``remat.trace.capture``. The weights are drawn from ``seed`` without touching the global
    random state.
    """
    spec = get(name)
    for what, flag in (("fake", fake), ("tiny", tiny)):
        if not isinstance(flag, bool):
            raise RematTypeError(
                message("zoo.build", f"{what} is True or False", f"got {flag!r}", f"pass {what}=True")
            )
    seed = whole(seed)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise RematTypeError(
            message("zoo.build", "seed is a whole number", f"got {seed!r}", "pass e.g. seed=0")
        )
    if not -(2**63) <= seed < 2**64:
        raise RematValueError(
            message(
                "zoo.build", "seed is a whole number of 64 bits at most", f"got {seed!r}", "pass e.g. seed=0"
            )
        )
    size = _check_sizes(spec, seq, image, tiny)
    n = _positive("batch", batch) if batch is not None else (2 if tiny else spec.batch)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise RematValueError(
            message("zoo.build", "device is a torch device", f"got {device!r}", "pass 'cpu' or 'cuda'")
        ) from None
    if not fake:  # fake tensors may be on a device this torch cannot run
        device_of(dev, "zoo.build")
    mode: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    rng_devices = [dev] if dev.type == "cuda" and torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=rng_devices), mode, dev:
        torch.manual_seed(seed)
        workload = spec.make(n, size, tiny)
    workload.model.train()
    return workload


def _positive(what: str, value: object) -> int:
    value = whole(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RematTypeError(
            message(
                "zoo.build", f"{what} must be an int", f"got {value!r}", f"pass a positive integer {what}"
            )
        )
    if value < 1:
        raise RematValueError(
            message("zoo.build", f"{what} must be positive", f"got {what}={value}", f"pass {what} >= 1")
        )
    return value


def _check_sizes(spec: ZooModel, seq: int | None, image: int | None, tiny: bool) -> int:
    wrong, given = ("image", image) if spec.input == "seq" else ("seq", seq)
    if given is not None:
        raise RematValueError(
            message(
                "zoo.build",
                f"{spec.name!r} takes {spec.input}, not {wrong}",
                f"got {wrong}={given}",
                f"pass {spec.input}= instead",
            )
        )
    value = seq if spec.input == "seq" else image
    size = _positive(spec.input, value) if value is not None else (spec.tiny_size if tiny else spec.size)
    if spec.max_size is not None and size > spec.max_size:
        raise RematValueError(
            message(
                "zoo.build",
                f"{spec.name!r} takes at most {spec.max_size} tokens per sample",
                f"got {spec.input}={size}",
                f"pass {spec.input} <= {spec.max_size}",
            )
        )
    if size % spec.multiple:
        raise RematValueError(
            message(
                "zoo.build",
                f"{spec.name!r} needs {spec.input} to be a multiple of {spec.multiple}",
                f"got {spec.input}={size}",
                f"pass e.g. {spec.input}={max(spec.multiple, size - size % spec.multiple)}",
            )
        )
    return size
