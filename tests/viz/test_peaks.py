"""The peak-per-strategy picture, and ``measure``'s runs checked against the plain step."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from remat.viz.peaks import draw_peaks
from remat.viz.steps import measure

MIB = 2**20
PNG = b"\x89PNG\r\n\x1a\n"


def test_draw_peaks_has_a_bar_per_run_its_ratio_and_budget_ticks(tmp_path: Path) -> None:
    path = tmp_path / "peaks.png"
    peaks = {"none": 8 * MIB, "checkpoint": 2 * MIB, "dtr 50%": 3 * MIB}
    fig = draw_peaks(peaks, path, budgets={"dtr 50%": 4 * MIB}, notes={"dtr 50%": "stopped"})
    assert path.read_bytes()[:8] == PNG
    (ax,) = fig.axes
    assert [p.get_width() for p in ax.patches] == [8.0, 2.0, 3.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["none", "checkpoint", "dtr 50%"]
    assert list(ax.get_yticks()) == [2, 1, 0]  # the first on top
    texts = [t.get_text() for t in ax.texts]
    assert texts == [" 8.00 MiB (1.00x)", " 2.00 MiB (0.25x)", " 3.00 MiB (0.38x), stopped"]
    assert [line.get_xdata()[0] for line in ax.lines if len(line.get_xdata())] == [4.0]


def test_measure_checks_each_finished_run_against_the_plain_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))
    x = torch.randn(64, 32)

    def runs() -> list[tuple[str, int, float | None, str]]:
        measured = measure(model, (x,), lambda: model(x).square().mean(), (0.9, 0.6), ("dtr",), cost="model")
        return [(r.label, r.tracker.peak_bytes, r.grad_diff, r.failure) for r in measured]

    first = runs()
    assert [label for label, *_ in first] == ["plain", "dtr 90%", "dtr 60%"]
    assert first[0][2] is None
    assert all(diff == 0.0 for _, _, diff, failure in first[1:] if not failure)
    assert runs() == first  # cost="model": the same decisions, the same allocator figures
