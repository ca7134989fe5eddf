"""Who owns each piece of the pool: a storage, a by-product copy of one, or a kernel's scratch.

The pool knows owners as integers. Storages are the non-negative ones; the runtime gives the other
two kinds negative numbers of their own, and the backends that look the pool up for them (the
dynamic runtime's) ask here rather than repeat the arithmetic.
"""

from __future__ import annotations

_SCRATCH_OWNERS = -(2**62)


def transient(storage: int) -> int:
    """Pool owner of a by-product copy of ``storage`` (negative, apart from real storages)."""
    return -2 - storage


def scratch(record: int) -> int:
    """Pool owner of the scratch buffers of ``record``'s kernel while it runs (apart from storages
    and their by-products)."""
    return _SCRATCH_OWNERS - record
