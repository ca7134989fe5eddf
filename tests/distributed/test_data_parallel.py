"""remat's forms inside DDP and FSDP2, on gloo with two CPU processes: the same loss, gradients and
batch-norm buffers as one process running the same global batch, bit for bit, and a lower peak on
every rank with per-block recomputation.

One spawn runs every check (``data_parallel_ranks.CHECKS``) and writes each rank's results; the
tests here read them. DDP runs with ``static_graph=True, find_unused_parameters=False`` and two
steps (the static graph is built in the first and used in the second), and ``ddp-dynamic`` without
the static graph; FSDP2 shards every block and
the root, resharding after forward unless the check says ``fsdp-keep``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch.multiprocessing as mp
from data_parallel_ranks import CHECKS, WORLD, worker

pytestmark = pytest.mark.slow  # two processes importing transformers, then every check

Results = list[dict[str, dict[str, Any]]]

EXACT = [
    f"{p}-{m}-{f}"
    for p, m, f in CHECKS
    if p != "fsdp-visible"
    and (p, f) not in {("fsdp", "whole-scope"), ("fsdp", "merged-plan")}
    and (m, f) != ("cnn", "whole-scope")
]
LOWER = [
    (f"{p}-{m}-plain", f"{p}-{m}-{f}")
    for p, m, f in CHECKS
    if f in ("checkpoint", "scope", "hf-checkpoint", "plan") and (p, m, "plain") in CHECKS
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    folder = tmp_path_factory.mktemp("data_parallel")
    mp.spawn(worker, args=(str(folder),), nprocs=WORLD)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]


def verdicts(results: Results, name: str) -> list[str]:
    return [str(rank[name]["verdict"]) for rank in results]


@pytest.mark.parametrize("name", EXACT)
def test_equal_to_one_process(results: Results, name: str) -> None:
    assert verdicts(results, name) == ["ok"] * WORLD


@pytest.mark.parametrize(("plain", "remat"), LOWER, ids=[r for _, r in LOWER])
def test_per_block_recomputation_lowers_each_ranks_peak(results: Results, plain: str, remat: str) -> None:
    for rank in results:  # the second step's peak, measured by the allocator on each rank
        assert rank[remat]["peaks"][-1] < rank[plain]["peaks"][-1]


def test_fsdp_hooks_are_ops_of_the_model_unless_hidden(results: Results) -> None:
    for verdict in verdicts(results, "fsdp-visible-gpt2-plan"):
        assert verdict.startswith("RecomputationError: remat.plan: the model's forward diverged")


def test_region_across_resharded_units_is_refused_in_forward(results: Results) -> None:
    for verdict in verdicts(results, "fsdp-gpt2-whole-scope"):
        assert verdict.startswith(
            "RematRuntimeError: remat.integrations.distributed: a recomputed region spans FSDP2 units"
        )
        assert "(transformer.h.0 resharded, then transformer.h.1 ran in the same region)" in verdict


def test_plan_region_across_resharded_units_is_refused_in_forward(results: Results) -> None:
    for verdict in verdicts(results, "fsdp-cnn-merged-plan"):
        assert verdict.startswith("RematRuntimeError: remat.integrations.distributed: a recomputed region")
        assert "(layers.0 resharded, then layers.1 ran in the same region)" in verdict


def test_region_across_resharded_units_without_hidden_hooks_says_why(results: Results) -> None:
    for verdict in verdicts(results, "fsdp-visible-gpt2-whole-scope"):
        assert verdict.startswith("RecomputationError") and "freed" in verdict


def test_scope_around_ddp_with_batch_norm(results: Results) -> None:
    assert verdicts(results, "ddp-cnn-whole-scope") == ["ok"] * WORLD
