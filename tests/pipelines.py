"""Checks the pipeline tests share: ops counted by name, and a run's gradients and buffers against
the single-process reference (``remat.pipeline.launch.reference``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat.pipeline.launch import Job, RankResult, reference


class Counted(TorchDispatchMode):
    """Counts the ATen ops named ``name`` run under it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.count = name, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += str(func) == self.name
        return func(*args, **(kwargs or {}))


def assert_equal_to_one_process(job: Job, results: Sequence[RankResult]) -> None:
    """Every rank's gradients and buffers equal, bit for bit, those of ``job`` run in one process
    on one intra-op thread, and every gradient is some rank's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = reference(job)
    finally:
        torch.set_num_threads(threads)
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    buffers = dict(ref.named_buffers())
    seen = set()
    for result in results:
        for name, grad in result.grads.items():
            assert torch.equal(grad, grads[name]), name
            seen.add(name)
        for name, value in result.buffers.items():
            assert torch.equal(value, buffers[name]), name
    assert seen == set(grads)
