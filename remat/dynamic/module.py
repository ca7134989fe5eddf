"""``remat.dynamic.DynamicModule``: a module whose every call runs in a dynamic region.

A ``with`` block must span forward, backward and the optimizer step, which a module's ``forward``
alone does not. So a call opens a region and leaves it open: the loss, ``backward()`` and
``optimizer.step()`` that follow run in it, and it closes when the module is called again (the
next step) or on :meth:`DynamicModule.close`. A failure of the region in the loss, the backward
pass or the optimizer step (no room, thrashing) undoes the step when it happens
(:mod:`remat.dynamic.undo`); what the step still runs after it, until the region closes, runs as
plain PyTorch. An error of the program's own after the forward (a kernel's error in the optimizer
step) passes the region by, which cannot tell whether the program catches it: where such an
error must undo the step, run the step in ``with remat.dynamic(...)``, whose exit sees it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from remat._errors import RematTypeError, message
from remat.dynamic.region import Dynamic, dynamic
from remat.dynamic.stats import DynamicStats

_API = "dynamic.DynamicModule"


class DynamicModule(nn.Module):
    """Runs ``module`` under ``remat.dynamic(budget, policy, **options)``, one region per call;
    the module's parameters and buffers, and the state of ``optimizer`` if given, are registered
    first."""

    def __init__(
        self,
        module: nn.Module,
        budget: int | str | None,
        policy: str = "dtr",
        optimizer: torch.optim.Optimizer | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise RematTypeError(
                message(
                    _API, "DynamicModule runs an nn.Module", f"got {type(module).__name__}", "pass the module"
                )
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            rule, given = "optimizer is a torch.optim.Optimizer, or None", f"got {type(optimizer).__name__}"
            raise RematTypeError(message(_API, rule, given, "pass the optimizer that steps the module"))
        known = set(inspect.signature(dynamic).parameters) - {"budget", "policy", "keep"}
        if unknown := sorted(set(options) - known):
            rule = "its options are remat.dynamic's (it keeps the module and optimizer itself)"
            given = f"got {', '.join(unknown)}"
            raise RematTypeError(message(_API, rule, given, f"use {', '.join(sorted(known))}"))
        self.module = module
        self._region: Dynamic = dynamic(budget, policy, keep=(module, optimizer), **options)
        self._region.left_open = True
        self._open = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.close()
        self._region.__enter__()
        self._open = True
        try:
            return self.module(*args, **kwargs)
        except BaseException as error:
            self._open = False
            self._region.__exit__(type(error), error, error.__traceback__)
            raise

    def close(self) -> None:
        """End the open region, if any: what the program holds is restored and handed back."""
        if self._open:
            self._open = False
            if self._region._engine is not None:  # not closed by a region opened after its failure
                self._region.__exit__(None, None, None)

    @property
    def stats(self) -> DynamicStats:
        """Figures of the last region that closed."""
        return self._region.stats
