"""Offload: moving saved tensors to host memory, the third choice beside saving and recomputing.

``link`` models the copy time (``remat.Link``); ``pool`` holds the host buffers (pinned on CUDA,
memory torch's allocator does not see on CPU); ``parcel`` is a moved tensor while it waits (its
storage's bytes on the host, how to rebuild it); ``offloader`` moves a tensor out and back
(``Offloader.out`` / ``Offloader.back``, side stream, events, prefetch); ``region`` is the
``with remat.offload():`` block, which moves what autograd saves inside it. ``remat.checkpoint``
and ``remat.scope`` move the outputs a policy decides ``Decision.OFFLOAD`` through an
``Offloader`` too.
"""

from remat.host.link import Link
from remat.host.offloader import Offloader, OffloadStats
from remat.host.parcel import Cargo, Parcel, unmovable
from remat.host.pool import HostPool
from remat.host.region import offload

__all__ = ["Cargo", "HostPool", "Link", "OffloadStats", "Offloader", "Parcel", "offload", "unmovable"]
