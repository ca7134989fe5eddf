"""One training step measured plain and under ``remat.dynamic`` at budgets, for the memory picture.

Each run is one forward and backward inside ``remat.memory.track(allocator=True)``, with the
gradients cleared and the random seed set before it, so that every run computes the same step.
A budget ratio is a fraction of the plain step's allocator peak, in the tracker's convention:
bytes beyond what was held before the step. ``remat.dynamic`` counts within its budget the tensors
it keeps (the model's parameters and buffers, the inputs), so the region's budget is that fraction
plus their bytes, and the picture's line, at the fraction, is the one the curve should stay under.
A run the region stops (its budget too small, or thrashing) is kept with the reason and what the
allocator saw until then; a run that finishes is checked against the plain step's gradients.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from remat._errors import RematError
from remat.memory import MemoryTracker, plot, track

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["StepRun", "draw", "measure"]


@dataclass(frozen=True)
class StepRun:
    """One measured step. ``budget``: in the tracker's convention (None for the plain step);
    ``region_budget``: what ``remat.dynamic`` was given, the same plus the bytes it keeps.
    ``moments``: the region's evictions and recomputations (None where none were recorded: the
    plain step, a stopped region). ``failure``: the error that stopped the region ("" if none).
    ``grad_diff``: the largest absolute difference of a parameter's gradient from the plain step's
    (None for the plain step and a stopped region)."""

    label: str
    tracker: MemoryTracker
    budget: int | None = None
    region_budget: int | None = None
    moments: tuple[tuple[int, str], ...] | None = None
    failure: str = ""
    grad_diff: float | None = None

    @property
    def rule(self) -> str:
        """The rule ``failure`` states, without the API, the values and what to do: a short line."""
        text = self.failure
        end = text.rfind("); ")  # remat.<api>: <rule> (<what was given>); <what to do>
        depth = 0
        for i in range(end, -1, -1):
            depth += {")": 1, "(": -1}.get(text[i], 0)
            if depth == 0:
                text = text[:i].rstrip()
                break
        return text.split(": ", 1)[1] if text.startswith("remat.") and ": " in text else text


def measure(
    model: nn.Module,
    inputs: Sequence[torch.Tensor],
    loss: Callable[[], torch.Tensor],
    ratios: Sequence[float] = (),
    policies: Sequence[str] = ("dtr",),
    *,
    thrash_limit: float = 10.0,
    cost: str = "measured",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[StepRun]:
    """Run ``loss().backward()`` once plain, then once per policy and ratio inside ``remat.dynamic``
    (keeping ``model`` and ``inputs``), each measured by the CPU allocator. ``cost``: what an op
    costs for the policy (``remat.dynamic``'s ``cost``; ``"model"`` makes the same decisions every
    time). ``progress(label)`` is called as each run starts. The caller's random stream is left
    where it was."""
    from remat.dynamic import dynamic

    kept = _bytes_of([*model.parameters(), *model.buffers(), *inputs])
    with torch.random.fork_rng(devices=[]):
        _warm(model, loss, seed, None)  # warm-ups: a process's first step allocates once-only state,
        if ratios and policies:  # and the first region imports, builds what later ones reuse and
            # learns its kernels' scratch (outside a profiler's track, which would hide it)
            _warm(model, loss, seed, dynamic(None, policies[0], keep=(model, tuple(inputs))))
        if progress is not None:
            progress("plain")
        plain, _ = _run(model, loss, seed, None)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        runs = [StepRun("plain", plain)]
        for policy in policies:
            for ratio in ratios:
                label = f"{policy} {ratio:.0%}"
                if progress is not None:
                    progress(label)
                budget = int(ratio * plain.peak_bytes)
                region = dynamic(
                    kept + budget, policy, keep=(model, tuple(inputs)), thrash_limit=thrash_limit, cost=cost
                )
                tracker, failure = _run(model, loss, seed, region)
                if failure:  # a stopped region has no stats, hence no marks, and undid the step
                    runs.append(StepRun(label, tracker, budget, kept + budget, None, failure))
                    continue
                now = [p.grad for p in model.parameters() if p.grad is not None]
                diff = max((float((a - b).abs().max()) for a, b in zip(grads, now, strict=True)), default=0.0)
                runs.append(StepRun(label, tracker, budget, kept + budget, region.stats.moments, "", diff))
        model.zero_grad(set_to_none=True)
    return runs


def draw(runs: Sequence[StepRun], path: str | os.PathLike[str] | None, title: str | None = None) -> Figure:
    """``remat.memory.plot`` of ``runs``, with their budgets, marks and failures."""
    return plot(
        {r.label: r.tracker for r in runs},
        path,
        budget={r.label: r.budget for r in runs if r.budget is not None},
        marks={r.label: r.moments for r in runs if r.moments is not None},
        notes={r.label: f"stopped: {r.rule}" for r in runs if r.failure},
        title=title,
    )


def _warm(
    model: nn.Module,
    loss: Callable[[], torch.Tensor],
    seed: int,
    region: contextlib.AbstractContextManager[object] | None,
) -> None:
    """One step, untracked."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with region if region is not None else contextlib.nullcontext():
        loss().backward()


def _run(
    model: nn.Module,
    loss: Callable[[], torch.Tensor],
    seed: int,
    region: contextlib.AbstractContextManager[object] | None,
) -> tuple[MemoryTracker, str]:
    """The tracker of one step, and why ``region`` stopped it ("" if it did not)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with track(allocator=True) as tracker:
        try:
            with region if region is not None else contextlib.nullcontext():
                loss().backward()
        except RematError as error:  # the region stopped: keep what the allocator saw until then
            return tracker, str(error)
    return tracker, ""


def _bytes_of(tensors: Sequence[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
