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
Each rank also holds the tensors it sends; what it receives lands in buffers its stages make when
the first step starts (NOTE [receive buffers]). The single-stage schedules (``gpipe``, ``1f1b``)
keep their last send operations referenced a little past their wait: ``transfer_bytes``, one
micro-batch's output (sent forward) and input gradient (sent backward); with them the model meets
the allocator's count on the first rank of a 2-rank gloo run (tests/pipeline). The schedules torch
runs with ``_PipelineScheduleRuntime`` (``interleaved-1f1b``, ``zbv``: ``Schedule.keeps_sends``)
keep every send's work, and the tensor it sent, until the step ends (NOTE [sends kept to the end]):
from a micro-batch's backward on, the stage's output and the gradient of its input stay; a V's
hand-over between two stages of one rank keeps them as well, in the receiving stage's buffers. The
last stage's output is counted beside its saved bytes, once: where the loss saves its input
(``mse_loss``) the stage's measured saved bytes leave it out (NOTE [the output counted once] in
``remat.pipeline.measure``). A rank waiting for a message holds what it held; what the message
costs in time is the per-action cost's (below).
A schedule whose dependencies cannot be met (a deadlock) raises before anything runs.

NOTE [receive buffers] torch's ``PipelineStage`` makes, when the first step starts, one receive
buffer per micro-batch for the stage's input (all stages but the first) and for the gradient of
its output (all but the last), and keeps them for every later step: so the first step adds them
to what later steps add. A buffer a stage of the same rank fills (a V's hand-over) is replaced by
the tensor handed over, right after the action that makes it, and the first buffer goes then.
``Timeline.peak_bytes`` is the first step's (what a budget must hold), ``steady_peak_bytes``
every later step's; measured on 2 gloo ranks (tests/pipeline), the first step exceeded a later
one by exactly the buffers the model counts still alive at its peak.

Time (NOTE [per-action cost]): an action's duration is its stage's compute (``Cost``) plus what
running it costs the rank beyond that (``ActionCost``: torch's stage code and autograd per forward
or backward, gloo's work per send and per receive), and every rank starts its first action after
the step's own fixed cost; a message between two ranks arrives ``latency_s + bytes x byte_s``
after the action that sends it ends. Without these terms (``ActionCost()``, all zero) the model
has op times only, and the ranks' CPU time was 1.2-1.6x the busy time it gave them on the wide
chain, 1.7-2.1x on the narrow one (benchmarks/pipeline); the figures are measured by
``remat.pipeline.calibrate``.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat._errors import RematValueError, message
from remat.pipeline.costs import ActionCost, Cost, check
from remat.pipeline.schedule import Action, Schedule

__all__ = ["ActionCost", "Cost", "Span", "Timeline", "walk"]

# the backward kinds whose input (the gradient of the stage's output) comes from the next stage
_CROSSING = ("B", "I")


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
    each rank's ``peak_bytes`` in the first step and its memory over time in it (``memory[r]``:
    (seconds, bytes) points, the bytes holding until the next point), each rank's
    ``steady_peak_bytes`` in every later step (its receive buffers made before it: NOTE [receive
    buffers]), and ``step_s``, the step's fixed cost on every rank before its first action."""

    spans: tuple[Span, ...]
    makespan: float
    peak_bytes: tuple[int, ...]
    memory: tuple[tuple[tuple[float, int], ...], ...]
    steady_peak_bytes: tuple[int, ...]
    step_s: float = 0.0

    def busy(self, rank: int) -> float:
        """Seconds ``rank`` works during the step: its actions and the step's fixed cost."""
        return self.step_s + sum(s.end - s.start for s in self.spans if s.rank == rank)


def _source(action: Action, last: int) -> tuple[int, str, int] | None:
    """The action whose end ``action`` waits for (see the module doc), or None."""
    if action.kind == "F":
        return (action.stage - 1, "F", action.microbatch) if action.stage > 0 else None
    if action.kind == "W":
        return (action.stage, "I", action.microbatch)
    if action.stage == last:
        return (action.stage, "F", action.microbatch)
    return (action.stage + 1, action.kind, action.microbatch)


def _overhead(schedule: Schedule, action: Action, per: ActionCost) -> float:
    """What ``action`` costs its rank beyond its compute (NOTE [per-action cost]): the forward's
    or backward's own cost, a receive for what comes from another rank's stage and a send for what
    goes to one. ``W`` sends and receives nothing and, its backward run at ``I``, runs nothing."""
    if action.kind == "W":
        return 0.0
    rank, stage, last = schedule.rank_of(action.stage), action.stage, schedule.n_stages - 1
    before = stage > 0 and schedule.rank_of(stage - 1) != rank
    after = stage < last and schedule.rank_of(stage + 1) != rank
    if action.kind == "F":
        return per.forward_s + per.receive_s * before + per.send_s * after
    return per.backward_s + per.receive_s * after + per.send_s * before


def _link(schedule: Schedule, costs: tuple[tuple[Cost, ...], ...], action: Action, per: ActionCost) -> float:
    """The seconds ``action``'s input takes to cross from another rank: an activation (forward)
    or the gradient of this stage's output (backward), none from its own rank."""
    stage, last = action.stage, schedule.n_stages - 1
    if action.kind == "F" and stage > 0:
        source, sent = stage - 1, costs[stage - 1][action.microbatch].sent
    elif action.kind in _CROSSING and stage < last:
        source, sent = stage + 1, costs[stage][action.microbatch].sent
    else:
        return 0.0
    if schedule.rank_of(source) == schedule.rank_of(stage):
        return 0.0
    return per.latency_s + sent * per.byte_s


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
    out = costs[stage][m].output_bytes if stage < schedule.n_stages - 1 else 0  # the tensor sent, all
    return out + (costs[stage - 1][m].sent if stage > 0 else 0)  # of its storage (a slice's too)


def _buffers(schedule: Schedule, costs: tuple[tuple[Cost, ...], ...]) -> list[int]:
    """Each rank's receive buffers when the first step starts (NOTE [receive buffers]): per
    micro-batch, its stages' inputs (from the previous stage) and their outputs' gradients."""
    out = [0] * schedule.n_ranks
    for s in range(schedule.n_stages):
        for m in range(schedule.n_microbatches):
            inputs = costs[s - 1][m].sent if s > 0 else 0
            grads = costs[s][m].sent if s < schedule.n_stages - 1 else 0
            out[schedule.rank_of(s)] += inputs + grads
    return out


def _handed_over(schedule: Schedule, costs: tuple[tuple[Cost, ...], ...], action: Action) -> int:
    """The first-step receive buffer ``action`` replaces on its own rank: a V's hand-over of its
    output to the next stage (a forward) or of its input's gradient to the previous one."""
    stage, m, rank = action.stage, action.microbatch, schedule.rank_of(action.stage)
    if action.kind == "F" and stage < schedule.n_stages - 1 and schedule.rank_of(stage + 1) == rank:
        return costs[stage][m].sent
    if action.kind in _CROSSING and stage > 0 and schedule.rank_of(stage - 1) == rank:
        return costs[stage - 1][m].sent
    return 0


def walk(
    schedule: Schedule, costs: tuple[tuple[Cost, ...], ...], per_action: ActionCost | None = None
) -> Timeline:
    """Walk ``schedule`` with ``costs[stage][microbatch]`` and what each action costs its rank
    beyond them (``per_action``, none by default; see the module doc), the figures checked first."""
    check(schedule, costs, per_action)
    return _walk(schedule, costs, per_action)


def _walk(
    schedule: Schedule, costs: tuple[tuple[Cost, ...], ...], per_action: ActionCost | None = None
) -> Timeline:
    """``walk`` without the check: the planner's own walks (a stage's plans weighed one by one, each
    cut of a search), of costs its ``StagePlan``s make, where the check took a fifth of the time."""
    per = ActionCost() if per_action is None else per_action
    last = schedule.n_stages - 1
    done: dict[tuple[int, str, int], float] = {}
    nxt = [0] * schedule.n_ranks
    free = [per.step_s] * schedule.n_ranks
    held: list[dict[tuple[int, int], int]] = [{} for _ in range(schedule.n_ranks)]
    # the transfers' tensors, the outputs the last stage keeps, the gradients, the sends kept
    kept = [
        0
        if schedule.keeps_sends or not costs[0]
        else sum(costs[s][0].transfer_bytes for s in schedule.stages_of(r))
        for r in range(schedule.n_ranks)
    ]
    sends = [0] * schedule.n_ranks
    buffers = _buffers(schedule, costs)
    memory: list[list[tuple[float, int]]] = [[(0.0, b)] for b in buffers]
    steady = [0] * schedule.n_ranks
    spans: list[Span] = []
    total = sum(len(a) for a in schedule.actions)
    backwarded: set[int] = set()
    while len(spans) < total:
        moved = False
        for rank, actions in enumerate(schedule.actions):
            while nxt[rank] < len(actions):
                action = actions[nxt[rank]]
                source = _source(action, last)
                finished = 0.0 if source is None else done.get(source)
                if finished is None:
                    break
                ready = finished + _link(schedule, costs, action, per)
                cost = costs[action.stage][action.microbatch]
                key = (action.stage, action.microbatch)
                others = kept[rank] + sum(v for k, v in held[rank].items() if k != key)
                start = max(free[rank], ready)
                if action.kind == "W":  # nothing left to run (see the module doc)
                    end, need, recompute = start, kept[rank] + sum(held[rank].values()), 0.0
                else:
                    compute = cost.forward_s if action.kind == "F" else cost.backward_s
                    end = start + compute + _overhead(schedule, action, per)
                    later = cost.later_peak_bytes if action.stage in backwarded else None
                    need = others + (cost.peak_bytes if later is None else later)
                    recompute = cost.recompute_s if action.kind != "F" else 0.0
                spans.append(Span(rank, action, start, end, recompute, need + buffers[rank]))
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
                after = kept[rank] + sum(held[rank].values())
                steady[rank] = max(steady[rank], need, after)
                first = buffers[rank]
                buffers[rank] -= _handed_over(schedule, costs, action)
                memory[rank] += [(start, need + first), (end, after + buffers[rank])]
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
    merged = sum(costs[last][m].sent for m in range(schedule.n_microbatches))
    end_rank = schedule.rank_of(last)
    ending = kept[end_rank] - sends[end_rank] + merged
    memory[end_rank].append((max(free), ending + buffers[end_rank]))
    steady[end_rank] = max(steady[end_rank], ending)
    peaks = tuple(max(b for _, b in m) for m in memory)
    return Timeline(
        tuple(spans), max(free), peaks, tuple(tuple(m) for m in memory), tuple(steady), per.step_s
    )
