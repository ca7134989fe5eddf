"""Pipeline schedules as plain data: per rank, the ordered actions ("1F0": stage 1, forward,
micro-batch 0) that torch.distributed.pipelining's schedule objects execute.

Why a model of our own rather than torch's ``_get_pipeline_order``: the memory a rank needs is set
by how many micro-batches it holds at once (forwarded, not yet backwarded), and that is read off
the order of its actions. For the single-stage schedules torch keeps that order only in the code
of ``_step_microbatches`` (its ``_get_pipeline_order`` for ``Schedule1F1B`` disagrees with what
runs on the last rank in torch 2.13), so the orders here are written from the executed code and
checked against a real run (tests/pipeline: forwards and backwards counted in the stage modules
of a gloo run, in order)::

    gpipe, rank r:  F0 F1 ... F(M-1)  B0 B1 ... B(M-1)                 holds M
    1f1b,  rank r:  F0 ... F(w-1)  B0 Fw B1 F(w+1) ...  B(M-1)         holds w = min(M, P - r)

``interleaved-1f1b`` puts V stages on each rank in a loop (rank r runs stages r, r + P, ...) and
is run by torch's ``ScheduleInterleaved1F1B``, which executes a precomputed list per rank; the
list is rebuilt here from that class's rules (the micro-batches go round the stages by rounds of
``M // max(1, M // P)``, warm-up ``(V - 1) x round + 2 (P - 1 - r)`` forwards, then forward and
backward alternately, backwards from the rank's last stage), and checked against a run as well::

    interleaved-1f1b, P=2, V=2, M=4, rank 0:  0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 ...

``zbv`` (zero bubble, V-shaped; torch's ``ScheduleZBVZeroBubble``) puts two stages on each rank
in a V: rank r runs stage r on the way down and stage 2P - 1 - r on the way back, so rank 0 holds
the first and the last stage and the last rank two adjacent ones (handed over in memory, no send).
Its backward is split into ``I`` (the input gradient, which the previous stage waits for) and
``W`` (the weight gradient, which only fills the rank's idle time); the list is rebuilt from that
class's rules (warm-up ``2 (P - r) - 1`` forwards of the first chunk, then forwards of both
chunks, then F-I-W triples of each chunk in turn, then the I's and the W's left), the
micro-batches it pads to ``2P - 1`` dropped as torch drops them::

    zbv, P=2, M=4, rank 0:  0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 ...

In remat's stages an ``I`` runs the whole backward of its micro-batch and its ``W`` finds nothing
left (NOTE [whole backward at I] in ``remat.pipeline.execute``), so a micro-batch is held from its
forward to its ``I`` or ``B``.

A ``Schedule`` holds no tensors and no process group: ``remat.pipeline.timeline`` walks it with
op times to a makespan and per-rank memory; the executor only picks the matching torch class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from remat._errors import RematTypeError, RematValueError, message
from remat._units import whole

__all__ = ["SCHEDULES", "Action", "Schedule", "build"]

# The schedules modelled here, by the name ``remat.pipeline.plan`` takes.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")

# the backward kinds that end what a micro-batch holds on its stage (see the module doc)
_RELEASES = ("B", "I")


@dataclass(frozen=True, order=True)
class Action:
    """One computation of a stage on a micro-batch: ``kind`` is ``F`` (forward), ``B`` (full
    backward), ``I`` (input gradient) or ``W`` (weight gradient); written as torch writes it,
    ``"1F0"``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``str`` wrote (``"1F0"``)."""
        found = _ACTION.match(text.strip())
        if found is None:
            raise RematValueError(
                message(
                    "pipeline.Action.parse",
                    "an action is <stage><F|B|I|W><micro-batch>",
                    repr(text),
                    "write it as '1F0'",
                )
            )
        return cls(int(found[1]), found[2], int(found[3]))


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``actions[r]`` is rank ``r``'s actions in execution order, over
    ``n_stages`` stages and ``n_microbatches`` micro-batches. ``placement`` is ``"loop"`` (stage
    ``s`` on rank ``s % n_ranks``) or ``"v"`` (down the ranks and back up: stage ``s`` and stage
    ``2 n_ranks - 1 - s`` on one rank)."""

    name: str
    n_ranks: int
    n_stages: int
    n_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    placement: str = "loop"

    @property
    def keeps_sends(self) -> bool:
        """Whether torch runs it with ``_PipelineScheduleRuntime``, which keeps every send's work,
        and the tensor it sends, until the step ends (``interleaved-1f1b``, ``zbv``)."""
        return self.name in ("interleaved-1f1b", "zbv")

    @property
    def split_backward(self) -> bool:
        """Whether the backward is split into ``I`` and ``W`` actions (``zbv``)."""
        return any(a.kind == "I" for row in self.actions for a in row)

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        turn, rank = divmod(stage, self.n_ranks)
        return self.n_ranks - 1 - rank if self.placement == "v" and turn % 2 else rank

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, in order."""
        return tuple(s for s in range(self.n_stages) if self.rank_of(s) == rank)

    def in_flight(self, stage: int) -> int:
        """The most micro-batches ``stage`` holds at once: forwarded and not yet backwarded."""
        held = most = 0
        for action in self.actions[self.rank_of(stage)]:
            if action.stage == stage and action.kind == "F":
                held += 1
                most = max(most, held)
            elif action.stage == stage and action.kind in _RELEASES:
                held -= 1
        return most

    def held_at_forward(self, stage: int, microbatch: int) -> int:
        """How many micro-batches ``stage`` holds when it starts the forward of ``microbatch``,
        that one included."""
        held = 0
        for action in self.actions[self.rank_of(stage)]:
            if action.stage == stage and action.kind == "F":
                held += 1
                if action.microbatch == microbatch:
                    return held
            elif action.stage == stage and action.kind in _RELEASES:
                held -= 1
        raise RematValueError(
            message(
                "pipeline.Schedule",
                "no such forward in the schedule",
                f"stage {stage}, micro-batch {microbatch}",
                "ask for a stage and micro-batch of this schedule",
            )
        )

    def __str__(self) -> str:
        rows = [f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)]
        head = (
            f"Schedule({self.name}, {self.n_ranks} ranks, {self.n_stages} stages, "
            f"{self.n_microbatches} micro-batches)"
        )
        return "\n".join([head, *rows])


def _gpipe(rank: int, m: int) -> list[Action]:
    return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    # as Schedule1F1B._step_microbatches runs: warm-up forwards, then B before F, then cool-down
    warmup = min(m, p - rank)
    out = [Action(rank, "F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        out.append(Action(rank, "B", backward))
        backward += 1
        if forward < m:
            out.append(Action(rank, "F", forward))
            forward += 1
    return out


def _interleaved(rank: int, p: int, v: int, m: int) -> list[Action]:
    # as ScheduleInterleaved1F1B._calculate_single_rank_operations lists them, idle slots left out
    per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    forwards, backwards = [0] * v, [0] * v
    out: list[Action] = []

    def forward(step: int) -> None:
        local = (step // per_round) % v
        out.append(Action(local * p + rank, "F", forwards[local]))
        forwards[local] += 1

    def backward(step: int) -> None:
        local = v - 1 - ((step - warmup) // per_round) % v
        out.append(Action(local * p + rank, "B", backwards[local]))
        backwards[local] += 1

    for step in range(m * v + warmup):
        if step < warmup:
            forward(step)
        elif step < m * v:
            forward(step)
            backward(step)
        else:
            backward(step)
    return out


def _zbv(rank: int, p: int, m: int) -> list[Action]:
    # as ScheduleZBVZeroBubble._calculate_single_rank_operations lists them: padded to 2P - 1
    # micro-batches, the padding and the idle slots left out
    down, up = rank, 2 * p - 1 - rank
    counts = {(down, "F"): 0, (up, "F"): 0, (down, "I"): 0, (up, "I"): 0, (down, "W"): 0, (up, "W"): 0}
    out: list[Action] = []

    def run(stage: int, *kinds: str) -> None:
        for kind in kinds:
            out.append(Action(stage, kind, counts[(stage, kind)]))
            counts[(stage, kind)] += 1

    n = max(2 * p - 1, m)
    for _ in range(2 * (p - rank) - 1):
        run(down, "F")
    for _ in range(rank):
        run(up, "F")
        run(down, "F")
    for _ in range(p - rank):
        run(up, "F", "I", "W")
    while counts[(up, "F")] < counts[(down, "F")] or counts[(down, "F")] < n:
        if counts[(down, "F")] < n:
            run(down, "F")
        run(down, "I", "W")
        run(up, "F", "I", "W")
    for _ in range(rank):
        run(down, "I")
        run(up, "I")
    for _ in range(p - rank):
        run(down, "I", "W")
    for stage in (up, down):
        while counts[(stage, "W")] < counts[(stage, "I")]:
            run(stage, "W")
    return [a for a in out if a.microbatch < m]


_MOST_ACTIONS = 3_000_000  # a schedule of this many actions takes seconds to build and walk


def build(
    name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1, *, api: str = "pipeline"
) -> Schedule:
    """The schedule ``name`` (one of ``SCHEDULES``) for ``n_ranks`` ranks, ``stages_per_rank``
    stages each (more than one for ``interleaved-1f1b``; two, in a V, for ``zbv``), and
    ``n_microbatches`` micro-batches; a refusal names ``api`` (the caller: ``remat.<api>: ...``)."""
    n_ranks, n_microbatches = whole(n_ranks), whole(n_microbatches)
    stages_per_rank = whole(stages_per_rank)
    if name not in SCHEDULES:
        raise RematValueError(
            message(api, "unknown schedule", repr(name), f"use one of {', '.join(SCHEDULES)}")
        )
    ranks = "n_stages" if api == "pipeline.plan" else "n_ranks"  # the caller's name for it
    for what, value in (
        (ranks, n_ranks),
        ("n_microbatches", n_microbatches),
        ("stages_per_rank", stages_per_rank),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise RematTypeError(
                message(api, f"{what} is a whole number", f"{what}={value!r}", f"pass e.g. {what}=2")
            )
    if n_ranks < 1 or n_microbatches < 1 or stages_per_rank < 1:
        raise RematValueError(
            message(
                api,
                "stages, micro-batches and stages per rank must be positive",
                f"{ranks}={n_ranks}, n_microbatches={n_microbatches}, stages_per_rank={stages_per_rank}",
                "pass at least one of each",
            )
        )
    if n_ranks * stages_per_rank * n_microbatches > _MOST_ACTIONS // 3:  # F, B and W of each
        raise RematValueError(
            message(
                api,
                f"a schedule holds at most {_MOST_ACTIONS} actions (each a stage's forward or backward "
                "on one micro-batch)",
                f"{ranks}={n_ranks}, stages_per_rank={stages_per_rank}, n_microbatches={n_microbatches}",
                "pass fewer micro-batches: a pipeline needs a few per stage",
            )
        )
    if name == "zbv" and stages_per_rank != 2:
        raise RematValueError(
            message(
                api,
                "zbv runs exactly two stages per rank, in a V",
                f"stages_per_rank={stages_per_rank}",
                "pass stages_per_rank=2",
            )
        )
    if stages_per_rank > 1 and name not in ("interleaved-1f1b", "zbv"):
        raise RematValueError(
            message(
                api,
                "only interleaved-1f1b runs more than one stage per rank",
                f"{name!r} with stages_per_rank={stages_per_rank}",
                "pass stages_per_rank=1, or schedule='interleaved-1f1b' (or 'zbv', two in a V)",
            )
        )
    rounds = max(1, n_microbatches // n_ranks)
    if name == "interleaved-1f1b" and n_microbatches % rounds:
        raise RematValueError(
            message(
                api,
                "interleaved-1f1b needs the micro-batches in whole rounds: a multiple of "
                "n_microbatches // n_ranks",
                f"{n_microbatches} micro-batches on {n_ranks} ranks: {rounds} rounds",
                f"use a multiple of {n_ranks} micro-batches, or fewer than {n_ranks}",
            )
        )
    if name == "1f1b" and n_microbatches < n_ranks:
        raise RematValueError(
            message(
                api,
                "1f1b needs at least as many micro-batches as stages",
                f"{n_microbatches} < {n_ranks}",
                "raise n_microbatches or use schedule='gpipe'",
            )
        )
    if name == "gpipe":
        rows = [_gpipe(r, n_microbatches) for r in range(n_ranks)]
    elif name == "1f1b":
        rows = [_one_f_one_b(r, n_ranks, n_microbatches) for r in range(n_ranks)]
    elif name == "zbv":
        rows = [_zbv(r, n_ranks, n_microbatches) for r in range(n_ranks)]
    else:
        rows = [_interleaved(r, n_ranks, stages_per_rank, n_microbatches) for r in range(n_ranks)]
    return Schedule(
        name,
        n_ranks,
        n_ranks * stages_per_rank,
        n_microbatches,
        tuple(tuple(r) for r in rows),
        "v" if name == "zbv" else "loop",
    )
