"""NOTE [region model] per region, as data: what a plan's regions keep, drop, replay and hold.

Why apart from the walk over the step (``remat.planner.predict``): these are the facts of the
plan, read off the trace once before any memory is counted, each by one step with one question:
what each region keeps (``kept_values``), writes of what was made before it (``outside_writes``),
hands autograd a handle for and drops early (``region_targets``), where it replays
(``replay_points``) and what its replay runs and what its plan holds (``replay_ops``).
``predict`` adds the tapes' holds (``remat.planner.holds``) and walks the events.

NOTE [written from outside] An op of a region that writes in place a storage made before the region
(an in-place ReLU opening a block, over the previous block's output; a buffer a module updates,
``self.avg.mul_(0.9)``, but not batch norm's statistics, whose writes are blank: NOTE [blank writes]
in ``remat.manual.blank``) makes the tape snapshot the old value and give the written one a value
id of its own, made by that op (NOTE [aliasing] in ``remat.manual.tape``). So what autograd saves
of the storage after the write, while the region records, gets a handle like any value the region
made: the storage is one of the region's targets, dropped early where no other save holds it, and
the replay makes it again from the snapshot (a copy beside the original where it is still alive).
Ops of the region that read the storage before its first write there read the snapshot, as the
writer does; the ones after it read what the writer's replay makes. The snapshot, not the
storage, is what the replay plan holds. A buffer counts as such a storage (spectral norm's ``u`` and
``v``, which its power iteration writes with ``out=``): a replayed op that reads it after the write
replays the write. A write into a view of such a storage (instance norm's running statistics) is
not one of the region's targets; the tape keeps the view's snapshot to the replay
(``remat.planner.holds``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from remat import aten
from remat.trace.types import Op, Phase, Trace

__all__ = [
    "RegionOps",
    "always_kept",
    "Rerun",
    "RegionPlans",
    "StepFacts",
    "kept_values",
    "outside_writes",
    "region_targets",
    "replay_ops",
    "replay_points",
    "read_back",
    "step_facts",
    "writes",
    "written_after",
]


@dataclass(frozen=True)
class Rerun:
    """A region the executor runs as one call of ``module`` run again (NOTE [module re-run] in
    ``remat.planner.rerun_regions``): its re-run runs the region's ops before trace op ``stop``
    (where autograd's last save in the call comes); ``inputs``: the storages the call was given
    (roots, constants left out), which it holds."""

    module: str
    stop: int
    inputs: frozenset[int] = frozenset()


@dataclass(frozen=True)
class RegionOps:
    """A region in trace op indices: its forward ops (in order) and those whose outputs it keeps;
    ``rerun`` where the executor runs it as its module again instead of from a tape; ``anchored``
    where its ops are exactly one call of one module (NOTE [bare forward] in
    ``remat.planner.module_calls``)."""

    ops: tuple[int, ...]
    save: frozenset[int] = frozenset()
    rerun: Rerun | None = None
    anchored: bool = False


@dataclass(frozen=True)
class StepFacts:
    """What every step reads of the trace: each tensor's storage (``root``), each op's cost, the
    storages autograd saved, each storage's forward readers and maker, each op's region."""

    root: Sequence[int]
    cost: list[float]
    saved_roots: set[int]
    readers: dict[int, list[int]]
    maker: dict[int, int]
    region_of: dict[int, int]

    def region_made(self, r: int) -> int | None:
        """The region of the op that made storage ``r``, if any."""
        return self.region_of.get(self.maker.get(r, -1))


@dataclass(frozen=True)
class RegionPlans:
    """Per region (NOTE [region model]): what it keeps, what autograd saved while it recorded
    (``packed``), its replay plan's targets (``planned``) and those a backward op reads, which it
    replays (``targets``), the ops its replay runs (``need``) and what its plan holds; the first op
    of the region writing each storage made before it (``written``, NOTE [written from outside])
    and those whose snapshot the replay reads (``snapped``)."""

    kept: list[set[int]]
    packed: list[set[int]]
    planned: list[set[int]]
    targets: list[set[int]]
    need: list[set[int]]
    held_by_plan: list[set[int]]
    written: list[dict[int, int]]
    snapped: list[set[int]]


def step_facts(trace: Trace, regions: Sequence[RegionOps]) -> StepFacts:
    tensors = trace.tensors
    root = trace.roots  # cached on the trace: every prediction of a step reads the same
    use_measured = trace.total_cost > 0
    cost = [op.cost if use_measured else op.est_cost for op in trace.ops]
    readers: dict[int, list[int]] = {}
    maker: dict[int, int] = {}
    for op in trace.ops:
        if op.phase is not Phase.FORWARD:
            continue
        for t in op.inputs:
            readers.setdefault(root[t], []).append(op.index)
        for t in op.outputs:
            if tensors[t].alias_of is None and not tensors[t].constant:
                maker.setdefault(t, op.index)
    region_of = {i: g for g, region in enumerate(regions) for i in region.ops}
    return StepFacts(root, cost, {root[t] for t in trace.saved}, readers, maker, region_of)


def always_kept(trace: Trace, maker: Mapping[int, int]) -> frozenset[int]:
    """The ops (of ``maker``: storage -> the forward op that made it) whose results every region on
    a tape keeps: what autograd saved and the program holds past the step anyway (NOTE [held past
    the step] in ``remat.trace.types``), and what ``torch.tensor`` made in the step, which the tape
    holds as an input from outside."""
    kept = trace.outliving & trace.saved_roots
    return frozenset(
        i for t, i in maker.items() if t in kept or trace.ops[i].name == "aten.lift_fresh.default"
    )


def kept_values(trace: Trace, regions: Sequence[RegionOps], facts: StepFacts) -> list[set[int]]:
    """What each region keeps: outputs of its SAVE ops that no later op of the region writes."""
    root = facts.root
    written: set[int] = set()  # roots an op of their own region writes in place
    for op in trace.ops:
        g = facts.region_of.get(op.index, -1)
        for t in op.mutates:
            if g >= 0 and facts.region_made(root[t]) == g:
                written.add(root[t])
    kept: list[set[int]] = [set() for _ in regions]
    for g, region in enumerate(regions):
        for i in region.save:
            for t in trace.ops[i].outputs:
                r = root[t]
                if facts.maker.get(r) == i and r not in written:  # writers come after the maker
                    kept[g].add(r)
    return kept


def outside_writes(trace: Trace, regions: Sequence[RegionOps], facts: StepFacts) -> list[dict[int, int]]:
    """Per region recorded on a tape, the storages made before it that its ops write in place (as
    the tensor that owns the storage, not a view of it), each with the first op that does (NOTE
    [written from outside])."""
    found: list[dict[int, int]] = [{} for _ in regions]
    for g, region in enumerate(regions):
        for i in region.ops if region.rerun is None else ():
            op = trace.ops[i]
            for t in writes(op):
                info = trace.tensors[t]  # a storage written whole, not through a view: the tape
                # keeps another tensor on it as it is, which the trace would not tell apart; a
                # buffer too (``self.avg.mul_(0.9)``), where its op declares the write
                declared = not info.constant or t in op.mutates and not aten.writes_hidden(op.name)
                if info.alias_of is None and declared and facts.region_made(t) != g:
                    found[g].setdefault(t, i)
    return found


def region_targets(
    trace: Trace,
    regions: Sequence[RegionOps],
    facts: StepFacts,
    kept: list[set[int]],
    written: list[dict[int, int]],
) -> tuple[list[set[int]], list[set[int]], dict[int, list[int]]]:
    """Per region its targets and what autograd saved while it recorded; and by forward op, the
    dropped targets that die after it. A storage the region writes from outside is a target where
    a save comes after the write (NOTE [written from outside])."""
    # A save at position p (NOTE in ``Trace``) is in region g's tape when first < p <= last.
    window: dict[int, int] = {}
    for g, region in enumerate(regions):
        for p in range(region.ops[0] + 1, region.ops[-1] + 1) if region.ops else ():
            window[p] = g
    # a module re-run's hooks also see what its last op saves of its own outputs
    ends = {region.ops[-1] + 1: g for g, region in enumerate(regions) if region.rerun and region.ops}
    packed: list[set[int]] = [set() for _ in regions]  # roots saved while the region records
    held_by_autograd: set[int] = set()  # roots some save holds as in the plain step
    rewritten: list[set[int]] = [set() for _ in regions]  # saved after the region wrote them
    for t, p in trace.saved_at:
        r = facts.root[t]
        g = window.get(p, -1)
        # after op p - 1, the write's or later; a view of it saved too (a linear layer's 2-d view)
        if g >= 0 and p > written[g].get(r, len(trace.ops)):
            packed[g].add(r)
            rewritten[g].add(r)
            continue
        rerun = regions[ends[p]].rerun if p in ends else None
        if rerun is not None and facts.region_made(r) == ends[p]:
            mine, others = read_back(trace, r, rerun.module)
            g = ends[p] if mine else g
            if mine and others:  # saved by a later op too, which holds it
                held_by_autograd.add(r)
        if g >= 0:
            packed[g].add(r)
        if g < 0 or r in kept[g] or facts.region_made(r) != g:
            held_by_autograd.add(r)
    targets: list[set[int]] = [set() for _ in regions]
    drop_after: dict[int, list[int]] = {}
    readers, let_go = facts.readers, dict(trace.let_go)
    for r in facts.saved_roots:
        made_in = facts.region_made(r)
        if made_in is None or r in kept[made_in]:
            continue
        g = made_in
        if trace.saved_at:
            if r not in packed[g]:
                continue
            dropped_early = r not in held_by_autograd
        else:  # when saves are not placed: those by an op of the region that reads the tensor
            inside = [i for i in readers.get(r, ()) if facts.region_of.get(i) == g]
            if facts.maker[r] == regions[g].ops[-1] or (not inside and readers.get(r)):
                continue
            dropped_early = all(facts.region_of.get(i) == g for i in readers.get(r, ()))
        targets[g].add(r)
        if dropped_early:  # after its last reader, or as late as the program held it (NOTE [let go])
            drop_after.setdefault(_gone(facts, r, let_go), []).append(r)
    for g, rs in enumerate(rewritten):
        targets[g].update(rs)
        for r in rs - held_by_autograd:
            drop_after.setdefault(_gone(facts, r, let_go), []).append(r)
    return targets, packed, drop_after


def _gone(facts: StepFacts, r: int, let_go: dict[int, int]) -> int:
    """The forward op after which storage ``r`` dies where no save holds it: its last reader, or as
    late as the program held it (NOTE [let go])."""
    return max([facts.maker.get(r, -1), *facts.readers.get(r, ()), let_go.get(r, -1)])


def replay_points(
    trace: Trace, regions: Sequence[RegionOps], facts: StepFacts, targets: list[set[int]]
) -> dict[int, list[int]]:
    """By backward op, the regions replayed just before it: at the first op reading a target that
    a node of the region runs (its module is one of the region's: backward ops carry the module of
    the forward op whose node runs them), since only those unpack a handle; a later block's node
    that saved the same storage itself (a rotary table every layer reads) holds it as in the plain
    step. A region none of whose modules reads a target replays at the first op that reads one."""
    modules = [{trace.ops[i].module for i in region.ops} for region in regions]
    first: dict[int, int] = {}  # region -> first backward op reading a target
    own: dict[int, int] = {}  # region -> first such op of the region's own modules
    owners: dict[int, list[int]] = {}  # a storage written from outside has two (NOTE [written from outside])
    for g, ts in enumerate(targets):
        for r in ts:
            owners.setdefault(r, []).append(g)
    for op in trace.ops:
        if op.phase is Phase.BACKWARD:
            for t in op.inputs:
                for g in owners.get(facts.root[t], ()):
                    first.setdefault(g, op.index)
                    if op.module in modules[g]:
                        own.setdefault(g, op.index)
    replay_at: dict[int, list[int]] = {}
    for g in sorted(first):
        replay_at.setdefault(own.get(g, first[g]), []).append(g)
    return replay_at


def replay_ops(
    trace: Trace,
    regions: Sequence[RegionOps],
    facts: StepFacts,
    kept: list[set[int]],
    planned: list[set[int]],
    written: list[dict[int, int]],
) -> tuple[list[set[int]], list[set[int]], list[set[int]]]:
    """The ops each replay runs: those that lead to the targets, stopping at kept values and at
    values from outside the region (a module re-run: every op before its last save); what they
    read of those, which the region's plan holds (a module re-run: what its call was given); and
    the storages written from outside whose snapshot they read (NOTE [written from outside])."""
    root = facts.root
    need: list[set[int]] = []
    held_by_plan: list[set[int]] = []
    snapped: list[set[int]] = []
    for g, region in enumerate(regions):
        if region.rerun is not None:  # NOTE [module re-run]: every op before the last save
            need.append({i for i in region.ops if i < region.rerun.stop})
            held_by_plan.append(set(region.rerun.inputs) if planned[g] else set())
            snapped.append(set())
            continue
        wanted = set(planned[g])
        ops_needed: set[int] = set()
        outside: set[int] = set()
        snaps: set[int] = set()
        for i in reversed(region.ops):
            op = trace.ops[i]
            # NOTE [kept beside a written output] an op runs again when it makes or writes a value
            # the replay wants, even where it keeps another of its outputs: batch norm keeps its
            # statistics while an in-place ReLU after it writes its result, which the tape then
            # replays (kept values exclude written ones), so it runs batch norm again
            if not {root[t] for t in (*op.outputs, *op.mutates)} & wanted:
                continue
            ops_needed.add(i)
            for t in op.inputs:
                r = root[t]
                if r in written[g]:  # after the region's first write of it, the writer's value (a
                    # buffer too: spectral norm's ``u``, which its power iteration writes in place;
                    # read through a view of it, as a linear layer reads a 3-d input, too)
                    (wanted if written[g][r] < i else snaps).add(r)
                elif trace.tensors[r].constant:
                    continue
                elif facts.region_made(r) == g and r not in kept[g]:
                    wanted.add(r)
                else:
                    outside.add(r)
        need.append(ops_needed)
        held_by_plan.append(outside if planned[g] else set())
        snapped.append(snaps)
    return need, held_by_plan, snapped


def writes(op: Op) -> tuple[int, ...]:
    """The tensors ``op`` writes in place: those it says it mutates and, for batch norm in training,
    the running statistics its schema does not declare (its last two tensor inputs when it has
    three or more: ``remat.manual.tape`` snapshots both kinds when an op of a region writes them). The
    trace does not say whether batch norm ran in training mode or tracks running statistics, so a
    frozen one (or one without statistics) is counted with a snapshot it does not take: an
    overestimate of two vectors of its channels."""
    hidden = aten.writes_hidden(op.name) and len(op.inputs) >= 3
    return tuple(dict.fromkeys((*op.mutates, *(op.inputs[-2:] if hidden else ()))))


def read_back(trace: Trace, r: int, module: str) -> tuple[bool, bool]:
    """Whether backward ops of ``module`` or its submodules read storage ``r`` (backward ops carry
    the module of the forward op whose node runs them), and whether others do."""
    prefix = module + "."
    inside = [m == module or m.startswith(prefix) for m in trace.backward_modules.get(r, ())]
    return any(inside), not all(inside)


def written_after(
    trace: Trace, last_write: Mapping[int, int], maker: Mapping[int, int], members: Sequence[int]
) -> tuple[frozenset[int], frozenset[int]]:
    """NOTE [written after the region] A storage the program writes in place after a region has
    ended (``last_write``: per storage, the last forward op writing it) holds another value by
    backward: the replay can neither read it (a value from before the region, which a tape keeps
    with its version and a call run again holds as its input) nor keep it (a value the region
    makes). So the ops of ``members`` that read such a storage made before the region keep their
    outputs (the first set: the replay stops there), and those that make one are not kept (the
    second: the replay makes the value again)."""
    root, end = trace.roots, members[-1]
    later = {r for r, i in last_write.items() if i > end and not trace.tensors[r].constant}
    if not later:
        return frozenset(), frozenset()
    inside = set(members)
    stale = {
        i
        for i in members
        for t in trace.ops[i].inputs
        if root[t] in later and maker.get(root[t], -1) not in inside
    }
    fixed = {i for i in members if any(root[t] in later for t in trace.ops[i].outputs)}
    return frozenset(stale), frozenset(fixed)
