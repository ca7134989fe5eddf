"""Timing one op of a traced step: the host's seconds and, on CUDA, the device's.

NOTE [CUDA op time]
On CUDA the host launches kernels ahead of the device, so a step takes about the longer of the
host's time and the device's, not their sum. Each op is timed both ways. The device's time: events
around the op's first repeat, behind a sleeping kernel that keeps the device busy while the host
launches it (so the launch is not in it). The host's time: around the call in the later repeats,
the device idle and the allocator warm before each (the program's own run may wait on a fresh
``cudaMalloc``). An op that runs once (not pure) gives both from its one run, behind the sleep (so
its host time includes any wait of its own for the device). The trace takes the device's times
where their sum is the larger (a device-bound step), else the host's. Measured on an H100 (torch
2.11) with a plain timer on warm models: GPT-2 small at batch 8 x 512 ran in 93.2 ms against 90.7
ms of device time and 71.6 of host; ResNet-50 at 32 x 224 in 26.0 ms against 20.6 and 28.5; GPT-2
at 2 x 128 in 45.6 ms against 12.0 and 42.3; timing each op from a synchronize to a synchronize
(a synchronization's latency and the launch added to every op) put the first at 151 ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves

__all__ = ["run_timed"]

CUDA_HEAD_START = 1_000_000  # GPU cycles (about 0.5 ms) the device sleeps while an op is launched


def run_timed(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], leaves: Sequence[torch.Tensor], runs: int
) -> tuple[Any, float, float | None]:
    """Run the op ``runs`` times: its first result, the host's seconds and, on CUDA, the device's
    (NOTE [CUDA op time]). The first call is the program's own; repeats (pure ATen ops only: no
    mutation, no RNG draw, no collective) run on the same inputs and their results are dropped at
    once."""
    cuda = any(t.is_cuda for t in leaves)
    times, on_device = [], []
    out = None
    for i in range(runs):
        if cuda:
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if i == min(1, runs - 1):
                torch.cuda._sleep(CUDA_HEAD_START)
            begin.record()
        start = time.perf_counter()
        result = func(*args, **kwargs)
        times.append(time.perf_counter() - start)
        if cuda:
            end.record()
            end.synchronize()
            on_device.append(begin.elapsed_time(end) / 1e3)
        if i == 0:
            out = result
            ran = (*leaves, *tree_leaves(out))
            if any(isinstance(t, torch.Tensor) and (is_fake(t) or t.is_meta) for t in ran):
                return out, 0.0, None  # nothing ran: fake and meta tensors have no time
        del result
    if not cuda:
        return out, statistics.median(times), None
    host = statistics.median(times[2:]) if runs > 2 else times[0]
    return out, host, on_device[1] if runs > 1 else on_device[0]
