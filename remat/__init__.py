"""remat: train PyTorch models in less memory by recomputing activations instead of storing them.

Manual forms: ``remat.checkpoint`` (a function or module), ``remat.checkpoint_sequential`` (a chain
cut into segments) and ``remat.scope`` (a region of code, recorded and replayed). Policies in
``remat.policy`` choose per op what to keep. ``remat.plan`` solves for the cheapest recomputation
under a byte budget and applies it; ``remat.pipeline`` plans it per stage and micro-batch of a
pipeline across processes; ``remat.dynamic`` keeps eager training within a budget by
evicting and recomputing online. ``remat.offload`` moves what a block saves to host memory instead
(``remat.host``). ``remat.memory`` measures what it all costs.
"""

from remat import integrations, memory, pipeline, policy, trace, zoo
from remat._errors import RecomputationError, RematError, RematRuntimeError, RematTypeError, RematValueError
from remat.dynamic import dynamic
from remat.host.link import Link
from remat.host.offloader import Offloader
from remat.host.region import offload
from remat.manual.checkpoint import checkpoint
from remat.manual.keywords import set_checkpoint_early_stop
from remat.manual.plainly import plainly
from remat.manual.scope import scope
from remat.manual.sequential import checkpoint_sequential
from remat.planner.api import plan
from remat.planner.plan import Plan
from remat.policy import (
    ByModule,
    Decision,
    OffloadComputeIntensive,
    OffloadLarger,
    OffloadOps,
    OpContext,
    Policy,
    RecomputeAll,
    SaveComputeIntensive,
    SaveOps,
)

__version__ = "0.1.0"

__all__ = [
    "ByModule",
    "Decision",
    "Link",
    "OffloadComputeIntensive",
    "OffloadLarger",
    "OffloadOps",
    "Offloader",
    "OpContext",
    "Plan",
    "Policy",
    "RecomputationError",
    "RecomputeAll",
    "RematError",
    "RematRuntimeError",
    "RematTypeError",
    "RematValueError",
    "SaveComputeIntensive",
    "SaveOps",
    "checkpoint",
    "checkpoint_sequential",
    "dynamic",
    "integrations",
    "memory",
    "offload",
    "pipeline",
    "plainly",
    "plan",
    "policy",
    "scope",
    "set_checkpoint_early_stop",
    "trace",
    "zoo",
]
