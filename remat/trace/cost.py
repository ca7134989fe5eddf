"""The cost model: an op's time estimated from its FLOPs and the bytes it moves, on a roofline.

Measured times exist only for steps run for real on the device one plans for. A step traced on
fake tensors at paper size, or planned for a GPU that is not here, needs an estimate, and so does
any planner that wants costs free of timing noise. The estimate is a function of the Trace alone
(op names, and the shapes and dtypes of the tensors each op reads and makes), so it can be redone
for another device without capturing again::

    est = overhead + max(flops / peak_flops, bytes_moved / bandwidth)

FLOPs are counted for the ops that are compute bound: matrix products, convolutions (and their
backward), fused attention and the oneDNN LSTM layer. Every other op is priced by the bytes it reads
and writes; an op that only makes views moves nothing and costs the overhead. A trace without
shapes (an imported DTR log) is priced by storage bytes only.

The device is a ``DeviceProfile``: a few presets (fp32 peak figures from the vendors' data sheets),
or ``calibrate()`` to measure this machine (one large matmul, one large copy, one tiny op).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from remat._errors import RematValueError, message
from remat.trace.types import Op, TensorInfo, Trace

__all__ = ["PROFILES", "DeviceProfile", "calibrate", "estimate", "op_bytes", "op_cost", "op_flops", "profile"]


@dataclass(frozen=True)
class DeviceProfile:
    """A roofline: peak FLOP/s, memory bandwidth (bytes/s) and a fixed time per op (seconds)."""

    name: str
    flops: float
    bandwidth: float
    overhead: float = 0.0

    def __post_init__(self) -> None:
        for what, value, least in (("flops", self.flops, 0), ("bandwidth", self.bandwidth, 0)):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= least
            ):
                raise RematValueError(
                    message(
                        "trace.DeviceProfile",
                        f"{what} is a finite number above 0",
                        f"got {value!r}",
                        f"pass the device's {what} per second",
                    )
                )
        overhead = self.overhead
        if (
            isinstance(overhead, bool)
            or not isinstance(overhead, (int, float))
            or not math.isfinite(overhead)
            or overhead < 0
        ):
            raise RematValueError(
                message(
                    "trace.DeviceProfile",
                    "overhead is a finite number of seconds, 0 or more",
                    f"got {overhead!r}",
                    "pass e.g. overhead=5e-6",
                )
            )

    def __str__(self) -> str:
        return (
            f"DeviceProfile({self.name}: {self.flops / 1e12:.3g} TFLOP/s, "
            f"{self.bandwidth / 1e9:.3g} GB/s, {self.overhead * 1e6:.3g} us/op)"
        )


# fp32 figures without tensor cores: PyTorch keeps TF32 off for matmuls by default.
PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        DeviceProfile("cpu", flops=100e9, bandwidth=20e9, overhead=5e-6),
        DeviceProfile("titan-v", flops=13.8e12, bandwidth=652e9, overhead=5e-6),
        DeviceProfile("v100", flops=15.7e12, bandwidth=900e9, overhead=5e-6),
        DeviceProfile("a100", flops=19.5e12, bandwidth=1.56e12, overhead=5e-6),
        DeviceProfile("h100", flops=67e12, bandwidth=3.35e12, overhead=4e-6),
    )
}


def profile(spec: DeviceProfile | str) -> DeviceProfile:
    """A preset by name (``"cpu"``, ``"a100"``, ...) or the profile itself."""
    if isinstance(spec, DeviceProfile):
        return spec
    if spec not in PROFILES:
        raise RematValueError(
            message(
                "trace.cost.profile",
                "unknown device profile",
                f"got {spec!r}",
                f"pass one of {', '.join(sorted(PROFILES))} or a DeviceProfile (see calibrate())",
            )
        )
    return PROFILES[spec]


def op_flops(op: Op, tensors: Sequence[TensorInfo]) -> float:
    """Floating-point operations of ``op`` (0.0 for ops priced by bytes, or without shapes)."""
    rule = _FLOP_RULES.get(op.packet)
    if rule is None:
        if "attention" in op.packet:
            rule = _attention
        else:
            return 0.0
    shapes = [tensors[t].shape for t in op.inputs]
    outs = [tensors[t].shape for t in op.outputs]
    if any(s is None for s in shapes) or any(s is None for s in outs):
        return 0.0
    try:  # the rules read the op's arguments by position: an op seen otherwise is priced by bytes
        return float(rule(op.packet, shapes, outs))  # type: ignore[arg-type]
    except (IndexError, ValueError, ZeroDivisionError):  # (storages read twice listed once, ``out=``)
        return 0.0


def op_bytes(op: Op, tensors: Sequence[TensorInfo]) -> int:
    """Bytes ``op`` reads and writes: each distinct input once, each new output storage and each
    mutated input; nothing for an op that only makes views."""
    made = [tensors[t] for t in op.outputs if tensors[t].alias_of is None]
    if not made and not op.mutates:
        return 0
    read = sum(tensors[t].view_bytes for t in dict.fromkeys(op.inputs))
    written = sum(t.view_bytes for t in made) + sum(tensors[t].view_bytes for t in dict.fromkeys(op.mutates))
    return read + written


def op_cost(op: Op, tensors: Sequence[TensorInfo], device: DeviceProfile | str = "cpu") -> float:
    """Estimated seconds of ``op`` on ``device``."""
    dev = profile(device)
    compute = op_flops(op, tensors) / dev.flops
    memory = op_bytes(op, tensors) / dev.bandwidth
    return dev.overhead + max(compute, memory)


def estimate(trace: Trace, device: DeviceProfile | str | None = None) -> Trace:
    """``trace`` with every op's ``est_cost`` set for ``device`` (default: the ``"cpu"`` preset for
    a CPU trace, ``"a100"`` otherwise)."""
    dev = profile(device if device is not None else ("cpu" if trace.device == "cpu" else "a100"))
    events = tuple(
        dataclasses.replace(e, est_cost=op_cost(e, trace.tensors, dev)) if isinstance(e, Op) else e
        for e in trace.events
    )
    return dataclasses.replace(trace, events=events)


Costs = Literal["measured", "estimated"]

_COSTED: dict[int, tuple[Trace, Costs]] = {}


def costed(trace: Trace) -> tuple[Trace, Costs]:
    """The trace whose op costs a simulation adds up, and which costs they are: ``trace`` itself
    where it has measured costs; else (a trace taken on fake tensors, or an import that carries
    none) a copy whose ``cost`` is each op's estimate (its ``est_cost``, or the cost model's for the
    trace's device). Cached for as long as ``trace`` lives."""
    if trace.total_cost > 0:
        return trace, "measured"
    found = _COSTED.get(id(trace))
    if found is None:
        dev = profile("cpu" if trace.device == "cpu" else "a100")
        events = tuple(
            dataclasses.replace(e, cost=e.est_cost or op_cost(e, trace.tensors, dev))
            if isinstance(e, Op)
            else e
            for e in trace.events
        )
        found = _COSTED[id(trace)] = (dataclasses.replace(trace, events=events), "estimated")
        weakref.finalize(trace, _COSTED.pop, id(trace), None)
    return found


def calibrate(device: torch.device | str = "cpu", repeats: int = 5) -> DeviceProfile:
    """Measure this machine's roofline in about a second: a square fp32 matmul (FLOP/s), a large
    copy (bytes/s, read plus write) and a one-element add (overhead), medians of ``repeats``."""
    dev = torch.device(device)
    n = 4096 if dev.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    src = torch.empty(2**24, device=dev)
    dst = torch.empty_like(src)
    one = torch.zeros(1, device=dev)
    matmul = _median_time(lambda: torch.mm(a, b), dev, repeats)
    copy = _median_time(lambda: dst.copy_(src), dev, repeats)
    tiny = _median_time(lambda: torch.add(one, one), dev, max(repeats, 50))
    return DeviceProfile(
        f"calibrated-{dev.type}",
        flops=2 * n**3 / max(matmul - tiny, 1e-9),
        bandwidth=2 * src.nbytes / max(copy - tiny, 1e-9),
        overhead=tiny,
    )


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


Shape = tuple[int, ...]


def _matmul(packet: str, ins: list[Shape], outs: list[Shape]) -> int:
    # mm/bmm/mv/dot read (…, m, k) first; addmm/baddbmm/addmv read the bias first.
    a = ins[1] if packet.startswith("add") or packet == "_addmm_activation" else ins[0]
    if packet == "dot":
        return 2 * math.prod(a)
    return 2 * math.prod(outs[0]) * (a[-1] if a else 1)  # a 0-d operand: a scalar product


def _positions(shape: Shape) -> int:
    return math.prod(shape) // max(shape[1], 1) if len(shape) > 1 else 1


def _conv(packet: str, ins: list[Shape], outs: list[Shape]) -> int:
    # 2 FLOPs per weight element per position; the cheaper side's positions (the output for a
    # strided conv, the input for a transposed one), so stride and padding need not be known.
    x, w = ins[0], ins[1]
    return 2 * math.prod(w) * min(_positions(x), _positions(outs[0]))


def _conv_backward(packet: str, ins: list[Shape], outs: list[Shape]) -> int:
    grad_out, x, w = ins[0], ins[1], ins[2]
    forward = 2 * math.prod(w) * min(_positions(x), _positions(grad_out))
    grads = sum(1 for s in outs if s in (x, w))  # grad_input and grad_weight, not grad_bias
    return forward * max(grads, 1)


def _attention(packet: str, ins: list[Shape], outs: list[Shape]) -> float:
    backward = "backward" in packet
    q, k, v = ins[1:4] if backward else ins[0:3]
    # The _scaled_dot_product_* ops take (batch, heads, seq, dim); the low-level
    # _flash_attention_* / _efficient_attention_* ones take (batch, seq, heads, dim).
    seq_dim = (
        -2 if packet.startswith("_scaled_dot_product") or packet == "scaled_dot_product_attention" else 1
    )
    batch_heads = math.prod(q) // (q[seq_dim] * q[-1])
    forward = 2 * batch_heads * q[seq_dim] * k[seq_dim] * (q[-1] + v[-1])
    return forward * (2.5 if backward else 1.0)  # backward: 4 matmuls plus QK^T again


def _rnn_layer(packet: str, ins: list[Shape], outs: list[Shape]) -> float:
    # mkldnn_rnn_layer(input (T, B, I), w_ih (G, I), w_hh (G, H), ...): one input and one hidden
    # matmul per step; the backward needs twice that.
    x, w_ih, w_hh = ins[0], ins[1], ins[2]
    forward = 2 * (math.prod(x) // x[-1]) * (math.prod(w_ih) + math.prod(w_hh))
    return forward * (2.0 if "backward" in packet else 1.0)


_FLOP_RULES: dict[str, Callable[[str, list[Shape], list[Shape]], float]] = {
    **dict.fromkeys(
        ("mm", "bmm", "mv", "dot", "addmm", "baddbmm", "addbmm", "addmv", "_addmm_activation"), _matmul
    ),
    **dict.fromkeys(
        (
            "convolution",
            "_convolution",
            "convolution_overrideable",
            "cudnn_convolution",
            "cudnn_convolution_transpose",
            "mkldnn_convolution",
            "miopen_convolution",
            "_slow_conv2d_forward",
            "slow_conv3d_forward",
            "_nnpack_spatial_convolution",
        ),
        _conv,
    ),
    **dict.fromkeys(
        (
            "convolution_backward",
            "convolution_backward_overrideable",
            "mkldnn_convolution_backward",
            "_slow_conv2d_backward",
        ),
        _conv_backward,
    ),
    **dict.fromkeys(("mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"), _rnn_layer),
}
