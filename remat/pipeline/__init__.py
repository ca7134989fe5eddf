"""Pipelines across processes with recomputation planned per stage and per micro-batch.

``plan`` cuts a chain of modules into stages and plans each stage's recomputation (the static
planner's ``remat.Plan``) within its rank's budget, given how many micro-batches the schedule
(``remat.pipeline.schedule``) makes that rank hold at once; the ``PipelinePlan`` it returns runs on
torch.distributed.pipelining (``stages``, ``schedule``), and its pipeline model
(``remat.pipeline.timeline``) predicts the step's makespan and each rank's memory over time: the
makespan from the stages' op times and what each action costs a rank beyond them (``calibrate``
measures it: an ``ActionCost``). ``ManualStage`` runs a stage with remat's manual forms instead,
in torchgpipe's modes (``always``, ``except_last``, ``never``).
torch.distributed.pipelining is imported only when stages are built.
"""

from remat.pipeline.api import plan
from remat.pipeline.calibrate import calibrate
from remat.pipeline.manual import ManualStage
from remat.pipeline.plan import PipelinePlan
from remat.pipeline.schedule import SCHEDULES, Action, Schedule, build
from remat.pipeline.stage_plan import StagePlan
from remat.pipeline.timeline import ActionCost, Cost, Span, Timeline, walk

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionCost",
    "Cost",
    "ManualStage",
    "PipelinePlan",
    "Schedule",
    "Span",
    "StagePlan",
    "Timeline",
    "build",
    "calibrate",
    "plan",
    "walk",
]
