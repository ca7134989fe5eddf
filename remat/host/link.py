"""The link model: how long moving bytes between device and host takes.

Offload trades link time for device memory. Every part of remat that weighs that trade (the manual
forms on a machine without a GPU, the planner, the simulator, the dynamic runtime) reads the same
``Link``: a bandwidth per direction and a fixed latency per transfer. On CUDA, ``Link.measure()``
times real pinned copies; elsewhere the figures are what the user states (defaults: a PCIe 4 x16
link, 25 GB/s each way, 10 µs per transfer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from remat._errors import RematRuntimeError, message
from remat._units import format_bytes, parse_bytes, parse_rate, parse_seconds


@dataclass(frozen=True, init=False)
class Link:
    """Bandwidths in bytes per second (``d2h``: device to host, ``h2d``: host to device) and the
    latency of one transfer in seconds. Accepts strings: ``Link(d2h="25GB/s", latency="10us")``."""

    d2h: float = field(default=25e9)
    h2d: float = field(default=25e9)
    latency: float = field(default=10e-6)

    def __init__(
        self, d2h: float | str = 25e9, h2d: float | str = 25e9, latency: float | str = 10e-6
    ) -> None:
        object.__setattr__(self, "d2h", parse_rate(d2h, "Link"))
        object.__setattr__(self, "h2d", parse_rate(h2d, "Link"))
        object.__setattr__(self, "latency", parse_seconds(latency, "Link"))

    def d2h_seconds(self, nbytes: int) -> float:
        """Time to copy ``nbytes`` from device to host."""
        return self.latency + nbytes / self.d2h

    def h2d_seconds(self, nbytes: int) -> float:
        """Time to copy ``nbytes`` from host to device."""
        return self.latency + nbytes / self.h2d

    def __str__(self) -> str:
        return (
            f"Link(d2h={format_bytes(self.d2h)}/s, h2d={format_bytes(self.h2d)}/s, "
            f"latency={self.latency * 1e6:.1f} µs)"
        )

    @classmethod
    def measure(
        cls, device: torch.device | str | None = None, nbytes: int | str = "64MiB", repeats: int = 5
    ) -> Link:
        """Time pinned copies of ``nbytes`` each way on a CUDA device (the median of ``repeats``),
        and the latency from a copy of 4 bytes. Needs a GPU."""
        dev = torch.device(device) if device is not None else torch.device("cuda")
        if dev.type != "cuda" or not torch.cuda.is_available():
            raise RematRuntimeError(
                message(
                    "Link.measure",
                    "measuring a link needs a CUDA device",
                    f"got device {dev}, CUDA available: {torch.cuda.is_available()}",
                    'state the link instead, e.g. remat.Link(d2h="25GB/s", h2d="25GB/s")',
                )
            )
        size = parse_bytes(nbytes, "Link.measure")

        def timed(n: int, to_host: bool) -> float:
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            on_device = torch.empty(n, dtype=torch.uint8, device=dev)
            times = []
            for _ in range(max(repeats, 1)):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                if to_host:
                    host.copy_(on_device, non_blocking=True)
                else:
                    on_device.copy_(host, non_blocking=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return sorted(times)[len(times) // 2]

        latency = min(timed(4, True), timed(4, False))
        d2h = timed(size, True)
        h2d = timed(size, False)
        return cls(d2h=size / max(d2h - latency, 1e-9), h2d=size / max(h2d - latency, 1e-9), latency=latency)
