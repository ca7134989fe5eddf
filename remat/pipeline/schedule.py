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

A ``Schedule`` holds no tensors and no process group: ``remat.pipeline.timeline`` walks it with
op times to a makespan and per-rank memory; the executor only picks the matching torch class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from remat._errors import RematValueError, message

__all__ = ["SCHEDULES", "Action", "Schedule", "build"]

# The schedules modelled here, by the name ``remat.pipeline.plan`` takes.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")

_ACTION = re.compile(r"^(\d+)([FBW])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One computation of a stage on a micro-batch: ``kind`` is ``F`` (forward), ``B`` (full
    backward) or ``W`` (weight gradient only); written as torch writes it, ``"1F0"``."""

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
                    "an action is <stage><F|B|W><micro-batch>",
                    repr(text),
                    "write it as '1F0'",
                )
            )
        return cls(int(found[1]), found[2], int(found[3]))


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``actions[r]`` is rank ``r``'s actions in execution order, over
    ``n_stages`` stages (stage ``s`` on rank ``s % n_ranks``) and ``n_microbatches`` micro-batches."""

    name: str
    n_ranks: int
    n_stages: int
    n_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return stage % self.n_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, in order."""
        return tuple(range(rank, self.n_stages, self.n_ranks))

    def in_flight(self, stage: int) -> int:
        """The most micro-batches ``stage`` holds at once: forwarded and not yet backwarded."""
        held = most = 0
        for action in self.actions[self.rank_of(stage)]:
            if action.stage == stage and action.kind == "F":
                held += 1
                most = max(most, held)
            elif action.stage == stage and action.kind == "B":
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
            elif action.stage == stage and action.kind == "B":
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


def build(
    name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1, *, api: str = "pipeline"
) -> Schedule:
    """The schedule ``name`` (one of ``SCHEDULES``) for ``n_ranks`` ranks, ``stages_per_rank``
    stages each (more than one for ``interleaved-1f1b`` only), and ``n_microbatches``
    micro-batches; a refusal names ``api`` (the caller: ``remat.<api>: ...``)."""
    if name not in SCHEDULES:
        raise RematValueError(
            message(api, "unknown schedule", repr(name), f"use one of {', '.join(SCHEDULES)}")
        )
    if n_ranks < 1 or n_microbatches < 1:
        raise RematValueError(
            message(
                api,
                "stages and micro-batches must be positive",
                f"n_stages={n_ranks}, n_microbatches={n_microbatches}",
                "pass at least one of each",
            )
        )
    if stages_per_rank < 1 or (stages_per_rank > 1 and name != "interleaved-1f1b"):
        raise RematValueError(
            message(
                api,
                "only interleaved-1f1b runs more than one stage per rank",
                f"{name!r} with stages_per_rank={stages_per_rank}",
                "pass stages_per_rank=1 or schedule='interleaved-1f1b'",
            )
        )
    rounds = max(1, n_microbatches // n_ranks)
    if name == "interleaved-1f1b" and n_microbatches % rounds:
        raise RematValueError(
            message(
                api,
                "interleaved-1f1b needs the micro-batches in whole rounds: a multiple of "
                "n_micro-batches // n_ranks",
                f"{n_microbatches} micro-batches on {n_ranks} ranks, rounds of {rounds}",
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
    else:
        rows = [_interleaved(r, n_ranks, stages_per_rank, n_microbatches) for r in range(n_ranks)]
    return Schedule(name, n_ranks, n_ranks * stages_per_rank, n_microbatches, tuple(tuple(r) for r in rows))
