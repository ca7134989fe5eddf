"""Measuring what a pipeline's schedule costs each rank beyond its stages' compute: the
``ActionCost`` the pipeline model adds per action (NOTE [per-action cost] in
``remat.pipeline.timeline``), from a short run of torch's own schedule on two gloo processes.

Why a run of its own, and with next to no compute: the stage times ``remat.pipeline.plan`` measures
are op times, traced in one process; what a rank spends around them (torch's ``PipelineStage``
code and the autograd call per forward and backward, gloo's send and receive, the step's splitting
and merging) shows only when the schedule runs between processes, and only apart from the compute
when there is next to none. Two processes, one intra-op thread each (as ``remat.pipeline.launch``
runs its ranks), measure in turn:

- the link: a message of one element, one activation and 16 activations sent to the other rank
  and back; half the round trip, fitted as ``a + bytes x byte_s``, and the CPU time of each send
  and each receive (``time.process_time``: gloo's own thread included) of an activation;
- the schedule: torch's ``ScheduleGPipe`` over two stages that multiply their input by one
  parameter, on ``2`` and ``8`` micro-batches of the activation's shape, with a loss (forward and
  backward) and without one (forwards only); each rank's CPU time of a step.

Per rank, the difference between the two step lengths over 6 micro-batches is what one
micro-batch costs it: without a loss a forward and one transfer (rank 0 sends, rank 1 receives),
with one a backward and the other transfer added; less the measured send and receive, the forward
and backward figures. The step's fixed cost is the rest of the 2-micro-batch step, and the link's
latency is ``a`` less the send and the receive, which the model counts on the ranks. Each figure
is the median of ``rounds`` samples taken in interleaved rounds; a figure the machine's noise puts
below zero is taken as zero, and where that is the latency (a link faster than the send and the
receive's CPU time) the per-byte figure is fitted again without it (``_link_figures``).

``calibrate`` starts its two processes with ``torch.multiprocessing.spawn``: each imports the
caller's main module, so a script that calls it must do so under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat.pipeline.timeline import ActionCost

__all__ = ["calibrate", "check", "figures", "samples"]

_SHORT, _LONG = 2, 8  # micro-batches of the two step lengths
_MESSAGES = (0, 1, 16)  # message sizes, in activations (0: one element)
_Samples = dict[str, list[float]]


class _Scale(nn.Module):
    """A stage with next to no compute: its input times one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _link(
    rank: int, activation: torch.Tensor, rounds: int, group: dist.ProcessGroup | None, out: _Samples
) -> None:
    """Round trips of each message size (rank 0 first sends, rank 1 sends it back)."""
    peer = 1 - rank
    messages = [activation.new_zeros(max(1, k * activation.numel())) for k in _MESSAGES]
    for timed in range(rounds + 1):  # the first round untimed
        for k, x in enumerate(messages):
            dist.barrier(group)
            wall = time.perf_counter()
            for turn in (rank, peer):  # rank 0 sends first, then receives; rank 1 the other way
                cpu = time.process_time()
                work = dist.isend(x, peer) if turn == 0 else dist.irecv(x, peer)
                assert work is not None  # None only outside the group
                work.wait()
                if timed and _MESSAGES[k] == 1:
                    out["send" if turn == 0 else "receive"].append(time.process_time() - cpu)
            if timed and rank == 0:
                out[f"trip{k}"].append(time.perf_counter() - wall)


def _steps(
    rank: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    rounds: int,
    group: dist.ProcessGroup | None,
    out: _Samples,
) -> None:
    """Each rank's CPU time of a GPipe step over two ``_Scale`` stages, per step length, with a
    loss and without."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    cpu, last = torch.device("cpu"), rank == 1

    def meta(grad: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(grad)

    runs = {}
    for m in (_SHORT, _LONG):
        for backward in (True, False):
            stage = PipelineStage(
                _Scale(), rank, 2, cpu, input_args=meta(rank > 0), output_args=meta(True), group=group
            )
            loss = nn.functional.mse_loss if backward else None
            batch = torch.zeros(m * shape[0], *shape[1:], dtype=dtype)
            runs[f"{'full' if backward else 'forward'}{m}"] = (ScheduleGPipe(stage, m, loss_fn=loss), batch)
    for timed in range(rounds + 1):  # the first round untimed: each stage sizes its buffers
        for key, (schedule, batch) in runs.items():
            dist.barrier(group)
            clock = time.process_time()
            if last:
                schedule.step(target=batch if key.startswith("full") else None)
            else:
                schedule.step(batch)
            if timed:
                out[key].append(time.process_time() - clock)


def samples(
    rank: int, n_ranks: int, activation: tuple[int, ...], dtype: torch.dtype, rounds: int
) -> _Samples | None:
    """Inside a gloo process group of ``n_ranks``, where every rank calls it: ranks 0 and 1
    measure (see the module doc) and return their samples, the others None (the figures come from
    ``figures``). ``remat.pipeline.launch`` runs it in the processes it starts anyway."""
    group = dist.new_group([0, 1]) if n_ranks > 2 else None
    if rank > 1:
        return None
    out: _Samples = {
        key: []
        for key in (
            "send",
            "receive",
            *(f"trip{k}" for k in range(len(_MESSAGES))),
            *(f"{kind}{m}" for kind in ("full", "forward") for m in (_SHORT, _LONG)),
        )
    }
    _link(rank, torch.zeros(activation, dtype=dtype), rounds, group, out)
    _steps(rank, activation, dtype, rounds, group, out)
    return out


def _worker(rank: int, shape: tuple[int, ...], dtype: torch.dtype, rounds: int, workdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init", rank=rank, world_size=2)
    try:
        torch.save(samples(rank, 2, shape, dtype, rounds), Path(workdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _fit(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """The least-squares line ``seconds = a + size x b``: ``(a, b)``."""
    mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(seconds)
    spread = sum((x - mean_x) ** 2 for x in sizes)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / spread
    return mean_y - b * mean_x, b


def _link_figures(sizes: list[float], one_way: list[float], on_ranks: float) -> tuple[float, float]:
    """``(latency_s, byte_s)`` of the line ``one_way = on_ranks + latency_s + size x byte_s``, neither
    below zero: where the fitted slope is negative the line is flat at the mean, and where its
    intercept is below ``on_ranks`` (the send and the receive, counted on the ranks) the slope is
    fitted again through ``on_ranks`` with no latency, so that the model's one-way time stays near
    the measured one instead of lying above it by the clamped latency."""
    a, per_byte = _fit(sizes, one_way)
    if per_byte < 0:
        a, per_byte = statistics.fmean(one_way), 0.0
    if a >= on_ranks:
        return a - on_ranks, per_byte
    through = sum(x * (y - on_ranks) for x, y in zip(sizes, one_way, strict=True)) / sum(x * x for x in sizes)
    return 0.0, max(through, 0.0)


def figures(ranks: list[_Samples], activation: tuple[int, ...], dtype: torch.dtype) -> ActionCost:
    """The ``ActionCost`` that ranks 0 and 1's ``samples`` of ``activation`` give (see the module
    doc)."""
    element_bytes, numel = torch.empty((), dtype=dtype).element_size(), math.prod(activation)
    med = [{key: statistics.median(v) for key, v in r.items() if v} for r in ranks]
    send = statistics.median(ranks[0]["send"] + ranks[1]["send"])
    receive = statistics.median(ranks[0]["receive"] + ranks[1]["receive"])

    def slope(r: int, kind: str) -> float:
        return (med[r][f"{kind}{_LONG}"] - med[r][f"{kind}{_SHORT}"]) / (_LONG - _SHORT)

    # per micro-batch without a loss: rank 0 a forward and a send, rank 1 a receive and a forward
    forward = statistics.fmean([slope(0, "forward") - send, slope(1, "forward") - receive])
    # the backward adds to each the other transfer: rank 0 receives the gradient, rank 1 sends it
    backward = statistics.fmean(
        [slope(0, "full") - slope(0, "forward") - receive, slope(1, "full") - slope(1, "forward") - send]
    )
    step = statistics.fmean(med[r][f"full{_SHORT}"] - _SHORT * slope(r, "full") for r in (0, 1))
    sizes = [float(max(1, k * numel) * element_bytes) for k in _MESSAGES]
    latency, per_byte = _link_figures(
        sizes, [med[0][f"trip{k}"] / 2 for k in range(len(_MESSAGES))], send + receive
    )
    return ActionCost(
        forward_s=max(forward, 0.0),
        backward_s=max(backward, 0.0),
        send_s=send,
        receive_s=receive,
        latency_s=latency,
        byte_s=per_byte,
        step_s=max(step, 0.0),
    )


def check(activation: tuple[int, ...], dtype: torch.dtype, rounds: int, api: str) -> None:
    """Refuse (naming ``api``) an ``activation`` that is no shape, a ``dtype`` no gradient flows
    in, or fewer than 3 ``rounds``."""
    if not activation or not all(isinstance(n, int) and n > 0 for n in activation):
        raise RematValueError(
            message(
                api,
                "activation is a shape of positive sizes, the rows first",
                repr(activation),
                "pass one micro-batch's activation shape, such as (128, 64)",
            )
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise RematValueError(
            message(api, "dtype is a floating dtype (a gradient flows back)", dtype, "pass torch.float32")
        )
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 3:
        raise RematValueError(
            message(api, "rounds must be a whole number, at least 3", repr(rounds), "pass rounds=15 or so")
        )


def calibrate(
    activation: tuple[int, ...] = (128, 64),
    dtype: torch.dtype = torch.float32,
    rounds: int = 15,
    workdir: str | os.PathLike[str] | None = None,
) -> ActionCost:
    """What each schedule action costs a rank beyond its stage's compute, measured on two gloo
    processes of this host with messages of ``activation``'s shape (one micro-batch's activation,
    the rows first) and ``dtype`` (see the module doc): ``rounds`` samples of each figure, files in
    ``workdir`` (a temporary folder, removed at the end, by default). Took 20 to 38 s of wall time
    on a shared 2-core machine, most of it starting the two processes and importing torch in them
    (``remat.pipeline.launch.run_calibrated`` measures the same in the processes it starts for its
    jobs). The processes are spawned: call it under ``if __name__ == "__main__":`` in a script
    (see the module doc). Pass the result to ``remat.pipeline.plan(action_cost=...)``."""
    check(activation, dtype, rounds, "pipeline.calibrate")
    if workdir is not None and not isinstance(workdir, str | os.PathLike):
        raise RematTypeError(
            message(
                "pipeline.calibrate",
                "workdir is a folder's path or None",
                f"got {type(workdir).__name__}",
                "pass a str or a pathlib.Path, or leave it out (a temporary folder)",
            )
        )
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="remat-calibrate-") as folder:
            return _measure(tuple(activation), dtype, rounds, Path(folder))
    return _measure(tuple(activation), dtype, rounds, Path(workdir))


def _measure(activation: tuple[int, ...], dtype: torch.dtype, rounds: int, folder: Path) -> ActionCost:
    """``calibrate``'s run, its files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "init").unlink(missing_ok=True)
    mp.spawn(_worker, args=(activation, dtype, rounds, str(folder)), nprocs=2, join=True)
    return figures([torch.load(folder / f"rank{r}.pt") for r in (0, 1)], activation, dtype)
