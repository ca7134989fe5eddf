"""remat.trace.cost: FLOPs and bytes per op from the trace's shapes, the roofline, presets."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import remat
from remat.trace import Op, TensorInfo, capture, cost


def _op(
    name: str, inputs: list[tuple[int, ...]], outputs: list[tuple[int, ...]]
) -> tuple[Op, list[TensorInfo]]:
    tensors = [
        TensorInfo(i, 4 * math.prod(s), shape=s, dtype="float32") for i, s in enumerate(inputs + outputs)
    ]
    n = len(inputs)
    return Op(0, name, tuple(range(n)), tuple(range(n, n + len(outputs)))), tensors


@pytest.mark.parametrize(
    ("name", "inputs", "outputs", "flops"),
    [
        ("aten.mm.default", [(8, 16), (16, 32)], [(8, 32)], 2 * 8 * 16 * 32),
        ("aten.addmm.default", [(32,), (8, 16), (16, 32)], [(8, 32)], 2 * 8 * 16 * 32),
        ("aten.bmm.default", [(4, 8, 16), (4, 16, 32)], [(4, 8, 32)], 2 * 4 * 8 * 16 * 32),
        # 3x3 conv, 8 -> 16 channels, stride 2 on 32x32: 16x16 output positions per image.
        (
            "aten.convolution.default",
            [(2, 8, 32, 32), (16, 8, 3, 3)],
            [(2, 16, 16, 16)],
            2 * 2 * 256 * 16 * 8 * 9,
        ),
        # its backward, asked for grad_input and grad_weight (and grad_bias, which costs no FLOPs here)
        (
            "aten.convolution_backward.default",
            [(2, 16, 16, 16), (2, 8, 32, 32), (16, 8, 3, 3)],
            [(2, 8, 32, 32), (16, 8, 3, 3), (16,)],
            2 * (2 * 2 * 256 * 16 * 8 * 9),
        ),
        (
            "aten._scaled_dot_product_flash_attention_for_cpu.default",
            [(2, 4, 128, 64), (2, 4, 256, 64), (2, 4, 256, 64)],
            [(2, 4, 128, 64)],
            2 * 2 * 4 * 128 * 256 * (64 + 64),
        ),
        ("aten.relu.default", [(8, 16)], [(8, 16)], 0),
    ],
)
def test_flops_from_shapes(
    name: str, inputs: list[tuple[int, ...]], outputs: list[tuple[int, ...]], flops: int
) -> None:
    op, tensors = _op(name, inputs, outputs)
    assert cost.op_flops(op, tensors) == flops


def test_bytes_and_roofline() -> None:
    op, tensors = _op("aten.relu.default", [(1000,)], [(1000,)])
    assert cost.op_bytes(op, tensors) == 8000
    dev = cost.DeviceProfile("test", flops=1e9, bandwidth=1e6, overhead=1e-6)
    assert cost.op_cost(op, tensors, dev) == pytest.approx(1e-6 + 8000 / 1e6)
    mm, mm_tensors = _op("aten.mm.default", [(100, 100), (100, 100)], [(100, 100)])
    assert cost.op_cost(mm, mm_tensors, dev) == pytest.approx(1e-6 + max(2e6 / 1e9, 120_000 / 1e6))
    # An op that only makes a view moves nothing and costs the overhead.
    view = Op(0, "aten.view.default", (0,), (1,))
    assert cost.op_bytes(view, [TensorInfo(0, 400, shape=(100,), dtype="float32"), TensorInfo(1, 0, 0)]) == 0
    # Without shapes (a DTR log), an op is priced by the bytes of the storages it touches.
    dtr = Op(0, "cudnn_convolution", (0, 1), (2,))
    dtr_tensors = [TensorInfo(0, 100), TensorInfo(1, 50), TensorInfo(2, 100)]
    assert cost.op_flops(dtr, dtr_tensors) == 0 and cost.op_bytes(dtr, dtr_tensors) == 250


def test_estimate_fills_every_op_and_depends_on_the_device() -> None:
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))
    x = torch.randn(2, 3, 16, 16)
    net(x)
    trace = capture(net, (x,), lambda out: out.sum(), repeats=1)
    assert all(op.est_cost > 0 for op in trace.ops)
    on_gpu = cost.estimate(trace, "h100")
    assert on_gpu.total_est_cost < trace.total_est_cost
    assert [op.cost for op in on_gpu.ops] == [op.cost for op in trace.ops]
    conv = next(op for op in trace.ops if op.packet == "convolution")
    assert cost.op_flops(conv, trace.tensors) == 2 * 2 * 14 * 14 * 8 * 3 * 9


def test_profiles() -> None:
    assert cost.profile("a100") is cost.PROFILES["a100"]
    assert "TFLOP/s" in str(cost.PROFILES["h100"])
    with pytest.raises(
        remat.RematValueError, match=r"remat\.trace\.cost\.profile: unknown device profile.*a100"
    ):
        cost.profile("tpu")


def test_calibrate_turns_the_timed_runs_into_a_roofline(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fixed clock, not this machine's: with repeats=2, two 1024x1024 matmuls of 2 ms each, two
    # copies of 2**24 floats of 10 ms each, then fifty one-element adds of 1 µs each.
    runs = iter([2e-3] * 2 + [1e-2] * 2 + [1e-6] * 50)
    now, calls = [0.0], itertools.count()

    def clock() -> float:  # read twice around each run: at its start, then at its end
        if next(calls) % 2:
            now[0] += next(runs)
        return now[0]

    monkeypatch.setattr(cost, "time", SimpleNamespace(perf_counter=clock))
    dev = cost.calibrate("cpu", repeats=2)
    assert dev.name == "calibrated-cpu"
    assert dev.flops == pytest.approx(2 * 1024**3 / (2e-3 - 1e-6))
    assert dev.bandwidth == pytest.approx(2 * 4 * 2**24 / (1e-2 - 1e-6))
    assert dev.overhead == pytest.approx(1e-6)
