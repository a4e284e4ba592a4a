"""The rank grid: PP x DP x TP (EP folded into TP x DP), and its process groups.

Grid (Megatron's ``initialize_model_parallel`` order: tensor parallel fastest, then data
parallel, pipeline outermost; experts with expert tensor parallelism 1)::

    rank     = (pp_rank * dp + dp_rank) * tp + tp_rank
    slot     = dp_rank * tp + tp_rank     # position among the tp * dp ranks of a pipeline stage
    ep_rank  = slot % ep                  # position inside the expert-parallel block
    edp_rank = slot // ep                 # which replica of the experts (expert-data-parallel)

- TP group: the ``tp`` consecutive ranks with the same ``pp_rank`` and ``dp_rank``.
- PP group: the ``pp`` ranks with the same ``dp_rank`` and ``tp_rank`` (stride ``tp * dp``);
  pipeline p2p runs here.
- DP group: the ``dp`` ranks with the same ``pp_rank`` and ``tp_rank`` (stride ``tp``); dense
  gradients reduce here.
- EP group: ``ep`` consecutive ranks of a pipeline stage; the token all-to-all runs here, so it
  stays on the fastest links when ranks are packed onto hosts in order.
- Expert-DP group: the ``tp * dp // ep`` ranks of a stage with the same ``ep_rank`` (stride
  ``ep``); they hold the same experts, so expert gradients reduce here.

With ``tp = 1`` this is the PP x DP grid (EP and expert-DP inside the DP group). Example
pp=2, dp=4, ep=2 (8 ranks): PP [0,4] [1,5] [2,6] [3,7]; DP [0,1,2,3] [4,5,6,7];
EP [0,1] [2,3] [4,5] [6,7]; expert-DP [0,2] [1,3] [4,6] [5,7]. A Megatron script passes the same
sizes to ``initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)`` and
``ParallelConfig(pp, dp, ep, tp)`` and gets the same groups.

``rank_grid`` is a pure function (tested without processes); ``create_groups`` calls
``dist.new_group`` for every group in the same order on every rank, as torch requires.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megapipe.parallel.config import ParallelConfig

Groups = tuple[tuple[int, ...], ...]
# The kinds of group, in the order they are created.
GROUP_NAMES = ("pp", "dp", "ep", "expert_dp", "tp")


@dataclass(frozen=True)
class RankCoordinates:
    """Where one global rank sits in the grid."""

    rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    expert_dp_rank: int
    tp_rank: int = 0


@dataclass(frozen=True)
class RankGrid:
    """Which global ranks form each PP, DP, EP, expert-DP and TP group (in creation order)."""

    config: ParallelConfig
    pp_groups: Groups
    dp_groups: Groups
    ep_groups: Groups
    expert_dp_groups: Groups
    tp_groups: Groups = ()

    def coordinates(self, rank: int) -> RankCoordinates:
        world = self.config.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank={rank!r} is outside the world of {world} ranks")
        c = self.config
        pp_rank, slot = divmod(rank, c.tp * c.dp)
        dp_rank, tp_rank = divmod(slot, c.tp)
        edp_rank, ep_rank = divmod(slot, c.ep)
        return RankCoordinates(rank, pp_rank, dp_rank, ep_rank, edp_rank, tp_rank)

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The groups (by name, ``GROUP_NAMES``) that contain ``rank``."""
        self.coordinates(rank)
        return {
            name: next(g for g in getattr(self, f"{name}_groups") if rank in g)
            for name in GROUP_NAMES
            if getattr(self, f"{name}_groups")
        }


def rank_grid(config: ParallelConfig) -> RankGrid:
    """The rank grid of ``config`` (see the module docstring); pure, no processes needed."""
    pp, dp, ep, tp = config.pp, config.dp, config.ep, config.tp
    per_stage = tp * dp

    def rank(pp_rank: int, slot: int) -> int:
        return pp_rank * per_stage + slot

    tp_groups = (
        tuple(  # none without tensor parallelism: no singleton groups to create
            tuple(rank(p, d * tp + t) for t in range(tp)) for p in range(pp) for d in range(dp)
        )
        if tp > 1
        else ()
    )
    pp_groups = tuple(tuple(rank(p, s) for p in range(pp)) for s in range(per_stage))
    dp_groups = tuple(
        tuple(rank(p, d * tp + t) for d in range(dp)) for p in range(pp) for t in range(tp)
    )
    ep_groups = tuple(
        tuple(rank(p, block * ep + e) for e in range(ep))
        for p in range(pp)
        for block in range(per_stage // ep)
    )
    expert_dp_groups = tuple(
        tuple(rank(p, block * ep + e) for block in range(per_stage // ep))
        for p in range(pp)
        for e in range(ep)
    )
    return RankGrid(config, pp_groups, dp_groups, ep_groups, expert_dp_groups, tp_groups)


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups, their global ranks, and its grid coordinates.

    ``pp_ranks[i]`` is the global rank of pipeline position i, which p2p send/recv need.
    """

    config: ParallelConfig
    grid: RankGrid
    coordinates: RankCoordinates
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    expert_dp: dist.ProcessGroup
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    expert_dp_ranks: tuple[int, ...]
    tp: dist.ProcessGroup | None = None  # None without tensor parallelism (tp = 1)
    tp_ranks: tuple[int, ...] = ()

    @property
    def rank(self) -> int:
        return self.coordinates.rank

    @property
    def pp_rank(self) -> int:
        return self.coordinates.pp_rank

    @property
    def dp_rank(self) -> int:
        return self.coordinates.dp_rank

    @property
    def ep_rank(self) -> int:
        return self.coordinates.ep_rank

    @property
    def expert_dp_rank(self) -> int:
        return self.coordinates.expert_dp_rank

    @property
    def tp_rank(self) -> int:
        return self.coordinates.tp_rank


def group_options(name: str, high_priority: Sequence[str], backend: str) -> dict[str, Any]:
    """``dist.new_group`` keyword arguments for group ``name``: on NCCL, a group named in
    ``high_priority`` gets ``ProcessGroupNCCL.Options(is_high_priority_stream=True)``, so its
    kernels run on a high-priority CUDA stream (e.g. the EP all-to-all beside compute)."""
    if name not in high_priority or backend != "nccl":
        return {}
    return {"pg_options": dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)}


def create_groups(
    config: ParallelConfig,
    backend: str | None = None,
    high_priority: Sequence[str] = (),
    timeout: timedelta | None = None,
) -> ProcessGroups:
    """Build every PP, DP, EP, expert-DP and TP group and return the ones holding this rank.

    Must be called on every rank of an initialised default group, with the same config; the
    world size is checked first, so a mismatch fails before any group is created.
    ``high_priority``: names (``GROUP_NAMES``) of the groups whose NCCL communicators use
    high-priority streams (``group_options``; nothing changes on gloo). ``timeout`` bounds every
    collective of the groups (None: torch's default for the backend).
    """
    unknown = [name for name in high_priority if name not in GROUP_NAMES]
    if unknown:
        raise ValueError(f"high_priority={unknown} are not group names; known: {GROUP_NAMES}")
    if not dist.is_initialized():
        raise RuntimeError(
            "create_groups needs an initialised default process group; call "
            "megapipe.parallel.launch.init_distributed() first"
        )
    config.check_world_size(dist.get_world_size())
    grid = rank_grid(config)
    me = dist.get_rank()
    mine: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}
    for name in GROUP_NAMES:
        for ranks in getattr(grid, f"{name}_groups"):
            # every rank creates every group, in the same order; only members keep theirs
            options = group_options(name, high_priority, backend or dist.get_backend())
            if timeout is not None:
                options["timeout"] = timeout
            group = dist.new_group(list(ranks), backend=backend, **options)
            if me in ranks:
                mine[(name, ranks)] = group
    return assemble_groups(grid, me, lambda name, ranks: mine[(name, ranks)])


def release_groups(groups: ProcessGroups) -> None:
    """End this rank's groups of a finished job (``create_groups``'s; the default group stays):
    until ended, each gloo group keeps threads (one wakes every 10 ms) and each NCCL group its
    communicator's buffers, so a process that runs job after job would gather them. Every rank
    calls it at the same point, after its last collective on them."""
    ended: set[int] = set()
    for group in (groups.pp, groups.dp, groups.ep, groups.expert_dp, groups.tp):
        if group is None or group is dist.GroupMember.WORLD or id(group) in ended:
            continue
        ended.add(id(group))
        dist.destroy_process_group(group)


def assemble_groups(
    grid: RankGrid,
    rank: int,
    group_of: Callable[[str, tuple[int, ...]], dist.ProcessGroup],
) -> ProcessGroups:
    """``rank``'s ProcessGroups, with ``group_of(name, ranks)`` giving the torch group of each of
    its groups (``name`` in ``GROUP_NAMES``).

    ``create_groups`` builds the groups itself; a caller that created them otherwise (for
    instance once, over part of a larger world) assembles the same object from its own.
    """
    mine = grid.groups_of(rank)
    return ProcessGroups(
        config=grid.config,
        grid=grid,
        coordinates=grid.coordinates(rank),
        pp=group_of("pp", mine["pp"]),
        dp=group_of("dp", mine["dp"]),
        ep=group_of("ep", mine["ep"]),
        expert_dp=group_of("expert_dp", mine["expert_dp"]),
        pp_ranks=mine["pp"],
        dp_ranks=mine["dp"],
        ep_ranks=mine["ep"],
        expert_dp_ranks=mine["expert_dp"],
        tp=group_of("tp", mine["tp"]) if "tp" in mine else None,
        tp_ranks=mine.get("tp", (rank,)),
    )


@dataclass(frozen=True)
class PipelinePosition:
    """Where this process sits in its pipeline: ``rank`` (0 .. pp-1), the global rank of every
    position (``ranks``, what p2p send/recv address) and the group p2p runs over (None: the
    default group, or no pipeline at all when pp = 1)."""

    rank: int
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None


def pipeline_position(
    pp: int, groups: ProcessGroups | None = None, pp_group: dist.ProcessGroup | None = None
) -> PipelinePosition:
    """This process's place in a ``pp``-rank pipeline: from ``groups`` (``create_groups``),
    else from ``pp_group``, else the default group is the pipeline. pp = 1 needs nothing."""
    if groups is not None:
        if groups.config.pp != pp:
            raise ValueError(
                f"the schedule has pp={pp} ranks but the process groups have pp={groups.config.pp}"
            )
        return PipelinePosition(groups.pp_rank, groups.pp_ranks, groups.pp)
    if pp == 1:
        return PipelinePosition(0, (0,), None)
    if not dist.is_initialized():
        raise RuntimeError(
            f"a {pp}-rank pipeline needs torch.distributed initialised "
            "(or pass groups=create_groups(...))"
        )
    size = dist.get_world_size(pp_group)
    if size != pp:
        raise ValueError(f"the schedule has pp={pp} ranks but the pipeline group has {size}")
    ranks = tuple(
        dist.get_global_rank(pp_group, r) if pp_group is not None else r for r in range(size)
    )
    return PipelinePosition(dist.get_rank(pp_group), ranks, pp_group)
