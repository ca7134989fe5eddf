"""Trace capture, the trace file format, importers and the cost model.

``capture(step)`` records one training step as a ``Trace`` (plain data: tensors, ops, releases);
``save``/``load`` write and read it as versioned JSON Lines (``load`` also reads DTR op logs);
``validate`` checks a trace is a possible program; ``remat.trace.cost`` estimates op times and
``remat.trace.liveness`` computes a trace's live bytes with no budget (``Trace.peak_bytes``).
"""

from remat.trace import cost, liveness
from remat.trace.capture import capture
from remat.trace.codec import load, save
from remat.trace.cost import DeviceProfile
from remat.trace.liveness import Liveness
from remat.trace.types import Event, Op, Phase, Release, TensorInfo, Trace
from remat.trace.validator import validate

__all__ = [
    "DeviceProfile",
    "Event",
    "Liveness",
    "Op",
    "Phase",
    "Release",
    "TensorInfo",
    "Trace",
    "capture",
    "cost",
    "liveness",
    "load",
    "save",
    "validate",
]
