"""The device-free rematerialization core: memory pool, recomputation graph, runtime, policies.

The simulator (:mod:`remat.sim`) drives it with recorded op times; an eager runtime drives the very
same code with real tensors through :class:`~remat.core.backend.Backend`.
"""

from remat.core.backend import Backend
from remat.core.graph import Graph, Record
from remat.core.policies import EvictionPolicy, get, names
from remat.core.pool import AddressPool, BytePool, End, Fit, OutOfMemory, Pool
from remat.core.runtime import Runtime
from remat.core.telemetry import Telemetry

__all__ = [
    "AddressPool",
    "Backend",
    "BytePool",
    "End",
    "EvictionPolicy",
    "Fit",
    "Graph",
    "OutOfMemory",
    "Pool",
    "Record",
    "Runtime",
    "Telemetry",
    "get",
    "names",
]
