"""Dynamic rematerialization of eager PyTorch under a hard memory budget (DTR, DTE, Coop).

``with remat.dynamic(budget="6GB", policy="coop"): ...`` around ordinary training code (see
:func:`remat.dynamic.region.dynamic`), or a module wrapped so that each call runs in a region
(:class:`DynamicModule`). The decisions come from the same core as the simulator
(:mod:`remat.core`); this package binds it to real tensors.
"""

from remat.dynamic import accounting, arena  # noqa: F401  (they register the memory backends)
from remat.dynamic.module import DynamicModule
from remat.dynamic.region import Dynamic, dynamic
from remat.dynamic.stats import Comparison, DynamicStats

__all__ = ["Comparison", "Dynamic", "DynamicModule", "DynamicStats", "dynamic"]
