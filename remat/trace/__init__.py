"""Trace capture, the trace file format, importers and the cost model."""

from remat.trace.types import Event, Op, Phase, Release, TensorInfo, Trace

__all__ = ["Event", "Op", "Phase", "Release", "TensorInfo", "Trace"]
