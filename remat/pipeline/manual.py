"""A pipeline stage that recomputes with remat's manual forms, in torchgpipe's three modes.

Why beside the planned stages (``remat.pipeline.execute``): a user whose stage already checkpoints
its blocks (``remat.checkpoint``, ``checkpoint_sequential``, ``remat.scope``, the Hugging Face
switch) wants one switch per stage, as torchgpipe gives (``checkpoint="always" | "except_last" |
"never"``), not a plan. ``except_last``: the last micro-batch of a step keeps its activations,
since its backward is the next the stage runs (under GPipe) or comes soon (under 1F1B), so
recomputing it saves little memory for its time; every other micro-batch runs as the stage's forms
say. The stage knows which micro-batch a forward is for by counting its forwards with grad enabled
(every torch schedule runs a stage's forwards in micro-batch order, once per step); the plain
micro-batches run under ``remat.plainly()``, which switches every manual form inside off.

``form`` adds the forms for a stage that has none: ``"checkpoint"`` runs each block (each child of
an ``nn.Sequential``, else the whole module) under ``remat.checkpoint``, ``"scope"`` under
``remat.scope``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._units import whole
from remat.manual.checkpoint import run
from remat.manual.plainly import plainly
from remat.manual.scope import scope
from remat.pipeline.execute import sendable

__all__ = ["MODES", "ManualStage"]

MODES = ("always", "except_last", "never")
_FORMS = (None, "checkpoint", "scope")
_API = "pipeline.ManualStage"


class ManualStage(nn.Module):
    """``module`` as a pipeline stage of ``n_microbatches`` per step, its manual forms on in every
    micro-batch (``"always"``), in all but each step's last (``"except_last"``) or in none
    (``"never"``); ``form`` adds them (see the module doc). ``forwards`` counts the forwards run with
    grad enabled since construction. Wrap it in torch's ``PipelineStage`` as the module itself,
    with the stage's ``input_args`` and ``output_args``: left to infer the shapes, torch runs a
    forward of empty tensors with grad enabled, which the count would take for a micro-batch."""

    def __init__(
        self,
        module: nn.Module,
        n_microbatches: int,
        checkpoint: Literal["always", "except_last", "never"] = "except_last",
        form: Literal["checkpoint", "scope"] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            rule, given = "the stage is an nn.Module", f"got {type(module).__name__}"
            raise RematTypeError(message(_API, rule, given, "pass the stage's module"))
        n_microbatches = whole(n_microbatches)
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            rule, given = "n_microbatches is a whole number of at least 1", f"got {n_microbatches!r}"
            raise RematValueError(message(_API, rule, given, "pass the schedule's number of micro-batches"))
        if checkpoint not in MODES:
            rule, given = "checkpoint is one of torchgpipe's modes", f"got {checkpoint!r}"
            raise RematValueError(message(_API, rule, given, f"pass one of {', '.join(MODES)}"))
        if form not in _FORMS:
            rule, given = "form names a manual form, or None", f"got {form!r}"
            raise RematValueError(message(_API, rule, given, "pass 'checkpoint', 'scope' or None"))
        self.module = module
        self.n_microbatches = n_microbatches
        self.checkpoint = checkpoint
        self.form = form
        self.forwards = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        counted = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        last = counted and self.forwards % self.n_microbatches == self.n_microbatches - 1
        self.forwards += counted
        if self.checkpoint == "never" or (self.checkpoint == "except_last" and last):
            with plainly():
                return sendable(self._run(args, kwargs))
        return sendable(self._run(args, kwargs))

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        blocks = list(self.module) if isinstance(self.module, nn.Sequential) else [self.module]
        if self.form is None:
            return self.module(*args, **kwargs)
        out: Any = None
        for i, block in enumerate(blocks):
            given, named = (args, kwargs) if i == 0 else ((out,), {})
            if self.form == "checkpoint":
                out = run(block, given, named, None, "shapes")
            else:
                with scope():
                    out = block(*given, **named)
        return out
