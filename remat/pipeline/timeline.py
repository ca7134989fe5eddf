"""The pipeline model: a schedule walked with per-micro-batch costs to a makespan and per-rank
memory over time, before any process starts.

Why a walk rather than a formula: the makespan of a pipeline step depends on where each rank
waits for its neighbours, and the memory of a rank on how many micro-batches it holds at each
moment, both read off the order of the actions (``remat.pipeline.schedule``). Every rank runs its
actions in order; an action starts when its rank is free and its cross-rank dependency is done::

    F(s, m)  after F(s-1, m)        (the activation arrives)
    B(s, m)  after B(s+1, m)        (the gradient arrives), and the last stage's B(s, m) after F(s, m)
    I(s, m)  as B(s, m), after I(s+1, m)
    W(s, m)  after I(s, m)

Under zbv a stage's ``I`` runs its micro-batch's whole backward and its ``W`` nothing (NOTE
[whole backward at I] in ``remat.pipeline.execute``): ``I`` costs and frees what ``B`` does, and
``W`` takes no time and no memory beyond what the rank holds.

Memory (NOTE [held micro-batches]): a rank holds, for each micro-batch it has forwarded and not
yet backwarded, that micro-batch's saved bytes under its plan and the stage's output (torch's
stage keeps it for the backward); while it runs an action on micro-batch ``m`` it needs what it
holds of the others plus ``m``'s one-micro-batch step peak (the planner's prediction,
``Plan.predicted_peak_bytes``). Two things of torch's schedules add to that: from a stage's first
backward on, its parameters' gradients stay (later micro-batches add theirs into them, so the
gradient bytes are counted on top of the one-micro-batch peak that holds them once), and the last
stage keeps every micro-batch's output to the end of the step, where it also concatenates them.
Each rank also holds the tensors it sends; what it receives lands in buffers its stages made in
the first step. The single-stage schedules (``gpipe``, ``1f1b``) keep their last send operations
referenced a little past their wait: ``transfer_bytes``, one micro-batch's output (sent forward)
and input gradient (sent backward); with them the model meets the allocator's count on the first
rank of a 2-rank gloo run (tests/pipeline). The schedules torch runs with
``_PipelineScheduleRuntime`` (``interleaved-1f1b``, ``zbv``: ``Schedule.keeps_sends``) keep every
send's work, and the tensor it sent, until the step ends (NOTE [sends kept to the end]): from a
micro-batch's backward on, the stage's output and the gradient of its input stay; a V's hand-over
between two stages of one rank keeps them as well, in the receiving stage's buffers. The last
stage's output is counted beside its saved bytes, once: where the loss saves its input
(``mse_loss``) the stage's measured saved bytes leave it out (NOTE [the output counted once] in
``remat.pipeline.measure``). Communication is taken as free: on one host over gloo it is small next
to compute, and a rank waiting for a message holds what it held.
A schedule whose dependencies cannot be met (a deadlock) raises before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat._errors import RematValueError, message
from remat.pipeline.schedule import Action, Schedule

__all__ = ["Cost", "Span", "Timeline", "walk"]


@dataclass(frozen=True)
class Cost:
    """What one stage costs on one micro-batch: ``forward_s``, ``backward_s`` (the recomputation
    included, ``recompute_s`` of it), ``saved_bytes`` held from its forward to its backward,
    ``peak_bytes``, the one-micro-batch step peak, ``output_bytes`` of the stage's output,
    ``grad_bytes`` of its parameters' gradients and ``transfer_bytes`` held by the schedule's
    sends and receives."""

    forward_s: float
    backward_s: float
    recompute_s: float
    saved_bytes: int
    peak_bytes: int
    output_bytes: int
    grad_bytes: int
    transfer_bytes: int


@dataclass(frozen=True)
class Span:
    """One action as the model places it: on ``rank`` from ``start`` to ``end`` seconds, with
    ``recompute_s`` of it recomputation, and ``bytes`` the rank needs while it runs."""

    rank: int
    action: Action
    start: float
    end: float
    recompute_s: float
    bytes: int


@dataclass(frozen=True)
class Timeline:
    """A schedule walked with costs: every action's ``Span``, the step's ``makespan`` (seconds),
    each rank's ``peak_bytes`` and its memory over time (``memory[r]``: (seconds, bytes) points,
    the bytes holding until the next point)."""

    spans: tuple[Span, ...]
    makespan: float
    peak_bytes: tuple[int, ...]
    memory: tuple[tuple[tuple[float, int], ...], ...]

    def busy(self, rank: int) -> float:
        """Seconds ``rank`` computes during the step."""
        return sum(s.end - s.start for s in self.spans if s.rank == rank)


def _ready(action: Action, done: dict[tuple[int, str, int], float], last: int) -> float | None:
    """When ``action``'s dependency finished, or None if it has not yet."""
    if action.kind == "F":
        need = (action.stage - 1, "F", action.microbatch) if action.stage > 0 else None
    elif action.kind == "W":
        need = (action.stage, "I", action.microbatch)
    elif action.stage == last:
        need = (action.stage, "F", action.microbatch)
    else:
        need = (action.stage + 1, action.kind, action.microbatch)
    if need is None:
        return 0.0
    return done.get(need)


def _sent(schedule: Schedule, costs: tuple[tuple[Cost, ...], ...], action: Action) -> int:
    """What ``action``'s stage handed on for its micro-batch, which a schedule that keeps its sends
    holds to the step's end once the backward ran: its output (sent forward) and the gradient of
    its input (sent backward).

    NOTE [sends kept to the end] ``_PipelineScheduleRuntime._step_microbatches`` appends every
    send's work to a list it waits on only when the step ends, and a gloo work holds its tensor;
    measured after every action of a 4-rank interleaved 1F1B and ZBV step, the allocator's count
    equals the model's on every rank that does not run the last stage (``remat.memory.track``'s
    live bytes). The works go before the step returns, so the last stage's concatenation of its
    outputs no longer sees them."""
    stage, m = action.stage, action.microbatch
    out = costs[stage][m].output_bytes if stage < schedule.n_stages - 1 else 0
    return out + (costs[stage - 1][m].output_bytes if stage > 0 else 0)


def walk(schedule: Schedule, costs: tuple[tuple[Cost, ...], ...]) -> Timeline:
    """Walk ``schedule`` with ``costs[stage][microbatch]`` (see the module doc)."""
    last = schedule.n_stages - 1
    done: dict[tuple[int, str, int], float] = {}
    nxt = [0] * schedule.n_ranks
    free = [0.0] * schedule.n_ranks
    held: list[dict[tuple[int, int], int]] = [{} for _ in range(schedule.n_ranks)]
    # the transfers' tensors, the outputs the last stage keeps, the gradients, the sends kept
    kept = [
        0
        if schedule.keeps_sends or not costs[0]
        else sum(costs[s][0].transfer_bytes for s in schedule.stages_of(r))
        for r in range(schedule.n_ranks)
    ]
    sends = [0] * schedule.n_ranks
    memory: list[list[tuple[float, int]]] = [[(0.0, 0)] for _ in range(schedule.n_ranks)]
    spans: list[Span] = []
    total = sum(len(a) for a in schedule.actions)
    backwarded: set[int] = set()
    while len(spans) < total:
        moved = False
        for rank, actions in enumerate(schedule.actions):
            while nxt[rank] < len(actions):
                action = actions[nxt[rank]]
                ready = _ready(action, done, last)
                if ready is None:
                    break
                cost = costs[action.stage][action.microbatch]
                key = (action.stage, action.microbatch)
                others = kept[rank] + sum(v for k, v in held[rank].items() if k != key)
                start = max(free[rank], ready)
                if action.kind == "W":  # nothing left to run (see the module doc)
                    end, need, recompute = start, kept[rank] + sum(held[rank].values()), 0.0
                else:
                    end = start + (cost.forward_s if action.kind == "F" else cost.backward_s)
                    need = others + cost.peak_bytes
                    recompute = cost.recompute_s if action.kind != "F" else 0.0
                spans.append(Span(rank, action, start, end, recompute, need))
                if action.kind == "F":
                    held[rank][key] = cost.saved_bytes + cost.output_bytes
                elif action.kind != "W":
                    held[rank].pop(key, None)
                    kept[rank] += cost.output_bytes if action.stage == last else 0
                    if schedule.keeps_sends:
                        sent = _sent(schedule, costs, action)
                        kept[rank] += sent
                        sends[rank] += sent
                    if action.stage not in backwarded:
                        backwarded.add(action.stage)
                        kept[rank] += cost.grad_bytes
                memory[rank] += [(start, need), (end, kept[rank] + sum(held[rank].values()))]
                done[(action.stage, action.kind, action.microbatch)] = end
                free[rank] = end
                nxt[rank] += 1
                moved = True
        if not moved:
            stuck = ", ".join(
                f"rank {r}: {a[nxt[r]]}" for r, a in enumerate(schedule.actions) if nxt[r] < len(a)
            )
            raise RematValueError(
                message(
                    "pipeline",
                    "the schedule deadlocks: no rank can run its next action",
                    stuck,
                    "order each rank's actions so that every dependency runs first",
                )
            )
    # the last stage concatenates its outputs at the end of the step
    merged = sum(costs[last][m].output_bytes for m in range(schedule.n_microbatches))
    end_rank = schedule.rank_of(last)
    memory[end_rank].append((max(free), kept[end_rank] - sends[end_rank] + merged))
    peaks = tuple(max(b for _, b in m) for m in memory)
    return Timeline(tuple(spans), max(free), peaks, tuple(tuple(m) for m in memory))
