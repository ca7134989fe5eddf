"""What any dispatch mode must know of an ATen op, in one place.

remat meets ATen ops in three dispatch modes: the manual forms' tape (``remat.manual.tape``), trace
capture (``remat.trace.capture``) and the dynamic runtime (``remat.dynamic.engine``). Each needs the
same facts: which arguments an op writes (including writes its schema does not declare, such as
batch norm's running statistics), which results alias an argument, whether it draws random
numbers, which namespaces are not ops of the program at all, which generator a random op draws
from and how to save and set that generator's state on any device, and a tensor's geometry. They
read them here; a new mode adds facts here, never a copy of its own. What an op allocates beside
its results, learned per op signature from the allocator, is here too (``scratch``).
"""

from remat.aten.generators import (
    CONTINUES,
    RngState,
    Source,
    capture,
    capture_all,
    replayed,
    restore,
    source_of,
    standing,
    state_nbytes,
)
from remat.aten.schema import (
    GRAD_MODE_PACKETS,
    METADATA_PACKETS,
    READ_OUTSIDE_OPS,
    SKIPPED_NAMESPACES,
    UNSAID_VIEWS,
    VALUE_PACKETS,
    OpFacts,
    draws,
    facts,
    wrapped_numbers,
    writes_hidden,
    written_tensors,
)
from remat.aten.tensors import (
    Geometry,
    describe,
    detached,
    dtype_name,
    geometry,
    made_last,
    next_node,
    overlaps,
    same_counter,
    sharing,
    storage_of,
    version_witness,
)

__all__ = [
    "GRAD_MODE_PACKETS",
    "METADATA_PACKETS",
    "READ_OUTSIDE_OPS",
    "SKIPPED_NAMESPACES",
    "UNSAID_VIEWS",
    "VALUE_PACKETS",
    "Geometry",
    "OpFacts",
    "CONTINUES",
    "RngState",
    "Source",
    "capture",
    "capture_all",
    "describe",
    "detached",
    "dtype_name",
    "draws",
    "facts",
    "geometry",
    "made_last",
    "next_node",
    "replayed",
    "restore",
    "sharing",
    "source_of",
    "standing",
    "state_nbytes",
    "storage_of",
    "version_witness",
    "wrapped_numbers",
    "same_counter",
    "overlaps",
    "writes_hidden",
    "written_tensors",
]
