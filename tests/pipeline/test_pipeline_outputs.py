"""A stage whose output is not one contiguous tensor: torch's stage sends (and the next one
receives, and the last one merges) ``output.contiguous()``, whose bytes are the output's elements.
The pipeline model took the output's storage for all of it: a stride-0 expanded view counted 64
bytes where 131072 cross (a plan accepted a budget every rank then exceeded), a column slice
counted the whole wider tensor (a budget the plain pipeline meets was refused). On 2 gloo
processes, one spawn for both jobs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat.pipeline as pp
from remat.pipeline.launch import Job, run

M, ROWS, WIDE = 4, 16, 2048


class _Broadcast(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1, keepdim=True).expand(-1, WIDE)  # storage: ROWS x 1; elements: ROWS x WIDE


class _Narrow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x))[:, :32]  # a column slice of a wider tensor


def expanded() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 32), nn.Tanh(), _Broadcast(), nn.Linear(WIDE, 32), nn.Tanh(), nn.Linear(32, 32)
    )


def narrowed() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Narrow() for _ in range(4)])


CASES = {"expanded": (expanded, [3]), "narrowed": (narrowed, [2])}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[pp.PipelinePlan, list[int]]]:
    torch.manual_seed(0)
    x, y = torch.randn(M * ROWS, 32), torch.randn(M * ROWS, 32)
    plans, jobs = {}, []
    for name, (build, cut) in CASES.items():
        plans[name] = plan = pp.plan(
            build(),
            x[:ROWS],
            n_stages=2,
            n_microbatches=M,
            schedule="1f1b",
            boundaries=cut,
            budget_per_rank="1GB",
            loss_fn=nn.functional.mse_loss,
            target=y[:ROWS],
        )
        jobs.append(Job(build, plan.to_json(), x, y, nn.functional.mse_loss, seed=1))
    results = run(jobs, 2, tmp_path_factory.mktemp("outputs"))
    peaks = [[r.first_peak_bytes for r in rs] for rs in results]
    return {name: (plans[name], p) for name, p in zip(plans, peaks, strict=True)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_crosses_is_the_outputs_elements(measured, name: str) -> None:
    plan, _ = measured[name]
    first = plan.stage_plans[0]
    assert first.sent_bytes == ROWS * (WIDE if name == "expanded" else 32) * 4
    assert first.output_bytes == first.sent_bytes  # the stage holds the contiguous tensor it sends


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_ranks_first_step_peak_is_the_predicted_one(measured, name: str) -> None:
    plan, peaks = measured[name]
    predicted = plan.timeline().peak_bytes
    for rank, peak in enumerate(peaks):
        assert abs(peak - predicted[rank]) <= 0.05 * predicted[rank], (rank, peak, predicted[rank])
