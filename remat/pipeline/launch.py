"""Running a PipelinePlan's step on local CPU processes over gloo, and reading back what each rank
measured: gradients, buffers, the allocator's peak, forward ops run, CPU time.

Why one launcher for the tests, the demo and the benchmark: starting a process group costs
seconds, so one spawn runs every job given (a warm-up step and the measured steps each), and
every rank writes its results to a file the caller reads; the model is built in each process
by ``Job.build`` (seeded alike), and the plan travels as its JSON. Each measured step starts from
the same buffers, with gradients cleared and every rank's generator seeded with ``seed + rank``,
so a single-process reference can reproduce it (``reference``). ``run_calibrated`` also measures,
in the same processes before the jobs, what each schedule action costs a rank beyond its compute
(``remat.pipeline.calibrate``): the processes are started once.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat._errors import RematValueError, message
from remat.memory import track
from remat.pipeline.calibrate import check, figures, samples
from remat.pipeline.execute import torch_stage
from remat.pipeline.plan import PipelinePlan
from remat.pipeline.timeline import ActionCost

__all__ = ["Job", "RankResult", "reference", "run", "run_calibrated"]

# what the calibration is given: one micro-batch's activation shape, its dtype, the rounds
_Calibration = tuple[tuple[int, ...], torch.dtype, int]


@dataclass(frozen=True)
class Job:
    """What every rank runs: ``build()`` makes the model (the same in every process), ``plan`` is
    the ``PipelinePlan``'s JSON, ``inputs`` and ``target`` the whole batch the schedule splits.
    ``wrap`` (a picklable function of a stage module) replaces the plan's stage modules, for a
    comparison such as per-block ``torch.utils.checkpoint`` or none; the first step (its memory
    measured) warms up, ``steps`` steps are timed and one more is measured (memory, counted ops,
    order).
    ``counted`` names ATen ops to count on each rank (forward-only ops count the forwards and
    their recomputations)."""

    build: Callable[[], nn.Module]
    plan: dict[str, Any]
    inputs: torch.Tensor
    target: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    seed: int = 0
    wrap: Callable[[nn.Module], nn.Module] | None = None
    steps: int = 1
    counted: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankResult:
    """What one rank measured: its stage's ``grads`` and ``buffers`` by the model's names, the
    allocator's ``peak_bytes`` in the measured step (one after the first) and
    ``first_peak_bytes`` in the first step (NOTE [receive buffers] in ``remat.pipeline.timeline``),
    ``counts`` of the counted ops in the measured step,
    the median ``cpu_seconds`` of a step, the median ``wall_seconds`` from the step's start on
    every rank (after a barrier) until every rank has finished it (a barrier): the pipeline's
    makespan, ``fastest_wall_seconds``, the shortest of those (the step least delayed by other work
    on the host), and ``order``: the forwards and backwards its stage ran in the measured step, as
    actions (``"0F1"``)."""

    rank: int
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    peak_bytes: int
    counts: dict[str, int]
    cpu_seconds: float
    wall_seconds: float
    fastest_wall_seconds: float
    order: tuple[str, ...]
    first_peak_bytes: int


class _Counter(TorchDispatchMode):
    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.counts = dict.fromkeys(names, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        if name in self.counts:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _order(stage: Any, n_microbatches: int, backward: str, log: list[str]) -> None:
    """Log the forwards and backwards of torch's pipeline ``stage`` as actions: a forward when its
    module runs, a backward (``backward``: ``B``, or ``I`` under a split backward) when its
    output's gradient arrives, and under a split backward each ``W`` when the schedule runs it."""
    index, count = stage.stage_index, [0]

    def forward(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        i = count[0] % n_microbatches
        count[0] += 1
        log.append(f"{index}F{i}")
        if out.requires_grad:
            out.register_hook(lambda grad: log.append(f"{index}{backward}{i}"))  # type: ignore[func-returns-value]

    stage.submod.register_forward_hook(forward)
    if backward == "I":
        weights = stage.backward_weight_one_chunk

        def logged(bwd_chunk_id: int, last_backward: bool = False) -> None:
            log.append(f"{index}W{bwd_chunk_id}")
            weights(bwd_chunk_id, last_backward=last_backward)

        stage.backward_weight_one_chunk = logged


def _one(job: Job, rank: int, n_ranks: int) -> RankResult:
    torch.manual_seed(job.seed)
    model = job.build()
    plan = PipelinePlan.from_json(job.plan, model)
    if job.wrap is None:
        stages = plan.stages(rank, "cpu")
    else:
        modules, cpu = plan.stage_modules(), torch.device("cpu")
        stages = [
            torch_stage(
                job.wrap(modules[sp.stage]), sp, plan.order.n_stages, cpu, None, plan.order.split_backward
            )
            for sp in plan.stage_plans
            if sp.rank == rank
        ]
    log: list[str] = []
    for stage in stages:
        _order(stage, plan.order.n_microbatches, "I" if plan.order.split_backward else "B", log)
    schedule = plan.schedule(stages, job.loss_fn)
    first, last = rank == 0, rank == plan.order.rank_of(plan.order.n_stages - 1)
    start = {k: v.detach().clone() for k, v in model.named_buffers()}

    def step() -> None:
        kwargs: dict[str, Any] = {"target": job.target, "losses": []} if last else {}
        schedule.step(*((job.inputs,) if first else ()), **kwargs)

    def reset() -> None:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(start[name])
        model.zero_grad(set_to_none=True)
        log.clear()
        torch.manual_seed(job.seed + rank)
        dist.barrier()

    with track(allocator=True) as first_memory:
        step()
    seconds, walls = [], []
    for _ in range(job.steps):  # timed bare: the tracker and the counter cost time per op
        reset()
        clock, wall = time.process_time(), time.perf_counter()
        step()
        seconds.append(time.process_time() - clock)
        dist.barrier()
        walls.append(time.perf_counter() - wall)
    reset()
    counter = _Counter(job.counted)
    with track(allocator=True) as memory, counter:
        step()
    params = {id(p) for stage in stages for p in stage.submod.parameters()}
    buffers = {id(b) for stage in stages for b in stage.submod.buffers()}
    return RankResult(
        rank,
        {
            n: p.grad.detach().clone()
            for n, p in model.named_parameters()
            if id(p) in params and p.grad is not None
        },
        {n: b.detach().clone() for n, b in model.named_buffers() if id(b) in buffers},
        memory.peak_bytes,
        counter.counts,
        statistics.median(seconds),
        statistics.median(walls),
        min(walls),
        tuple(log),
        first_memory.peak_bytes,
    )


def _worker(
    rank: int, jobs: Sequence[Job], n_ranks: int, workdir: str, calibration: _Calibration | None
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init", rank=rank, world_size=n_ranks)
    try:
        measured = None if calibration is None else samples(rank, n_ranks, *calibration)
        torch.save((measured, [_one(job, rank, n_ranks) for job in jobs]), Path(workdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(
    jobs: Sequence[Job], n_ranks: int, workdir: str | os.PathLike[str], calibration: _Calibration | None
) -> list[tuple[Any, list[RankResult]]]:
    # absolute: in ``file://out/gloo/init`` the rendezvous takes ``out`` for a host, and the file
    # for ``/gloo/init``
    folder = Path(workdir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "init").unlink(missing_ok=True)
    mp.spawn(_worker, args=(list(jobs), n_ranks, str(folder), calibration), nprocs=n_ranks, join=True)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(n_ranks)]


def run(jobs: Sequence[Job], n_ranks: int, workdir: str | os.PathLike[str]) -> list[list[RankResult]]:
    """Run ``jobs`` one after another on ``n_ranks`` spawned CPU processes over gloo (files in
    ``workdir``); per job, each rank's result."""
    per_rank = [results for _, results in _spawn(jobs, n_ranks, workdir, None)]
    return [[per_rank[r][j] for r in range(n_ranks)] for j in range(len(jobs))]


def run_calibrated(
    jobs: Sequence[Job],
    n_ranks: int,
    workdir: str | os.PathLike[str],
    activation: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    rounds: int = 15,
) -> tuple[list[list[RankResult]], ActionCost]:
    """``run``, the same processes first measuring what each schedule action costs a rank beyond
    its compute (``remat.pipeline.calibrate``'s measurement, on ranks 0 and 1, with messages of
    ``activation``'s shape and ``dtype``, ``rounds`` samples each): per job each rank's result,
    and the ``ActionCost``. ``n_ranks`` is at least 2."""
    check(activation, dtype, rounds, "pipeline.launch.run_calibrated")
    if n_ranks < 2:
        raise RematValueError(
            message(
                "pipeline.launch.run_calibrated",
                "the calibration sends between two ranks",
                f"n_ranks={n_ranks}",
                "run on 2 ranks or more",
            )
        )
    spawned = _spawn(jobs, n_ranks, workdir, (tuple(activation), dtype, rounds))
    per_rank = [results for _, results in spawned]
    cost = figures([spawned[0][0], spawned[1][0]], tuple(activation), dtype)
    return [[per_rank[r][j] for r in range(n_ranks)] for j in range(len(jobs))], cost


def reference(job: Job) -> nn.Module:
    """The measured step of ``job`` in one process, without recomputation: every rank's actions
    run one after another in an order their dependencies allow, each from its rank's generator
    (seeded as the rank's), every forward and backward a separate autograd call as on the ranks,
    and the gradients divided by the number of micro-batches as torch's schedules scale them.
    Each stage's gradients are then summed over the same micro-batches in the same order as on
    its rank, from the same values. Returns the model, holding the gradients and buffers."""
    torch.manual_seed(job.seed)
    model = job.build()
    plan = PipelinePlan.from_json(job.plan, model)
    stages, order = plan.stage_modules(), plan.order
    m, last = order.n_microbatches, order.n_stages - 1
    states = []
    for rank in range(order.n_ranks):
        torch.manual_seed(job.seed + rank)
        states.append(torch.random.get_rng_state())
    inputs, targets = job.inputs.tensor_split(m), job.target.tensor_split(m)
    received: dict[tuple[int, int], torch.Tensor] = {}
    sent: dict[tuple[int, int], torch.Tensor] = {}
    done: set[tuple[int, str, int]] = set()
    pending = [list(actions) for actions in order.actions]
    while any(pending):
        for rank, actions in enumerate(pending):
            while actions:
                a = actions[0]
                if a.kind == "F":
                    after = None if a.stage == 0 else (a.stage - 1, "F", a.microbatch)
                elif a.kind == "W":
                    after = (a.stage, "I", a.microbatch)
                else:
                    after = (
                        (a.stage, "F", a.microbatch)
                        if a.stage == last
                        else (a.stage + 1, a.kind, a.microbatch)
                    )
                if after is not None and after not in done:
                    break
                key = (a.stage, a.microbatch)
                if a.kind == "F":
                    x = inputs[a.microbatch] if a.stage == 0 else sent[(a.stage - 1, a.microbatch)].detach()
                    received[key] = x.requires_grad_(a.stage > 0 and x.is_floating_point())
                    torch.random.set_rng_state(states[rank])
                    sent[key] = stages[a.stage](received[key])
                    states[rank] = torch.random.get_rng_state()
                elif a.kind == "W":  # nothing left: the whole backward ran at I
                    pass
                elif a.stage == last:
                    job.loss_fn(sent[key], targets[a.microbatch]).backward()
                else:
                    sent[key].backward(received[(a.stage + 1, a.microbatch)].grad)
                done.add((a.stage, a.kind, a.microbatch))
                actions.pop(0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(m)
    return model
