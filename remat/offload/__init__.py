"""Offload: moving saved tensors to host memory, the third choice beside saving and recomputing."""

from remat.offload.link import Link

__all__ = ["Link"]
