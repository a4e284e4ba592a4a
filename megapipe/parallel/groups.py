"""The rank layout of the PP x DP (x EP folded into DP) grid, and its process groups.

Layout (Megatron order, data-parallel fastest, pipeline outermost)::

    rank     = pp_rank * dp + dp_rank
    ep_rank  = dp_rank % ep           # position inside the expert-parallel block
    edp_rank = dp_rank // ep          # which replica of the experts (expert-data-parallel)

- PP group: the ``pp`` ranks with the same ``dp_rank`` (stride ``dp``); pipeline p2p runs here.
- DP group: the ``dp`` consecutive ranks with the same ``pp_rank``; dense gradients reduce here.
- EP group: ``ep`` consecutive ranks inside a DP group; the token all-to-all runs here, so it
  stays on the fastest links when ranks are packed onto nodes in order.
- Expert-DP group: the ``dp // ep`` ranks of a DP group with the same ``ep_rank`` (stride
  ``ep``); they hold the same experts, so expert gradients reduce here.

Example pp=2, dp=4, ep=2 (8 ranks): PP [0,4] [1,5] [2,6] [3,7]; DP [0,1,2,3] [4,5,6,7];
EP [0,1] [2,3] [4,5] [6,7]; expert-DP [0,2] [1,3] [4,6] [5,7].

``rank_layout`` is a pure function (tested without processes); ``create_groups`` calls
``dist.new_group`` for every group in the same order on every rank, as torch requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from megapipe.parallel.config import ParallelConfig

Groups = tuple[tuple[int, ...], ...]
# The four kinds of group, in the order they are created.
GROUP_NAMES = ("pp", "dp", "ep", "expert_dp")


@dataclass(frozen=True)
class RankCoordinates:
    """Where one global rank sits in the grid."""

    rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    expert_dp_rank: int


@dataclass(frozen=True)
class RankLayout:
    """Which global ranks form each PP, DP, EP and expert-DP group (in creation order)."""

    config: ParallelConfig
    pp_groups: Groups
    dp_groups: Groups
    ep_groups: Groups
    expert_dp_groups: Groups

    def coordinates(self, rank: int) -> RankCoordinates:
        world = self.config.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank={rank!r} is outside the world of {world} ranks")
        pp_rank, dp_rank = divmod(rank, self.config.dp)
        edp_rank, ep_rank = divmod(dp_rank, self.config.ep)
        return RankCoordinates(rank, pp_rank, dp_rank, ep_rank, edp_rank)

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The four groups (by name) that contain ``rank``."""
        self.coordinates(rank)
        return {
            name: next(g for g in getattr(self, f"{name}_groups") if rank in g)
            for name in GROUP_NAMES
        }


def rank_layout(config: ParallelConfig) -> RankLayout:
    """The rank layout of ``config`` (see the module docstring); pure, no processes needed."""
    pp, dp, ep = config.pp, config.dp, config.ep

    def rank(pp_rank: int, dp_rank: int) -> int:
        return pp_rank * dp + dp_rank

    pp_groups = tuple(tuple(rank(p, d) for p in range(pp)) for d in range(dp))
    dp_groups = tuple(tuple(rank(p, d) for d in range(dp)) for p in range(pp))
    ep_groups = tuple(
        tuple(rank(p, block * ep + e) for e in range(ep))
        for p in range(pp)
        for block in range(dp // ep)
    )
    expert_dp_groups = tuple(
        tuple(rank(p, block * ep + e) for block in range(dp // ep))
        for p in range(pp)
        for e in range(ep)
    )
    return RankLayout(config, pp_groups, dp_groups, ep_groups, expert_dp_groups)


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's process groups, their global ranks, and its grid coordinates.

    ``pp_ranks[i]`` is the global rank of pipeline position i, which p2p send/recv need.
    """

    config: ParallelConfig
    layout: RankLayout
    coordinates: RankCoordinates
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    ep: dist.ProcessGroup
    expert_dp: dist.ProcessGroup
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    expert_dp_ranks: tuple[int, ...]

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
    """Build every PP, DP, EP and expert-DP group and return the ones holding this rank.

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
    layout = rank_layout(config)
    me = dist.get_rank()
    mine: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}
    for name in GROUP_NAMES:
        for ranks in getattr(layout, f"{name}_groups"):
            # every rank creates every group, in the same order; only members keep theirs
            options = group_options(name, high_priority, backend or dist.get_backend())
            if timeout is not None:
                options["timeout"] = timeout
            group = dist.new_group(list(ranks), backend=backend, **options)
            if me in ranks:
                mine[(name, ranks)] = group
    return assemble_groups(layout, me, lambda name, ranks: mine[(name, ranks)])


def assemble_groups(
    layout: RankLayout,
    rank: int,
    group_of: Callable[[str, tuple[int, ...]], dist.ProcessGroup],
) -> ProcessGroups:
    """``rank``'s ProcessGroups, with ``group_of(name, ranks)`` giving the torch group of each of
    its four groups (``name`` in ``GROUP_NAMES``).

    ``create_groups`` builds the groups itself; a caller that created them otherwise (for
    instance once, over part of a larger world) assembles the same object from its own.
    """
    mine = layout.groups_of(rank)
    return ProcessGroups(
        config=layout.config,
        layout=layout,
        coordinates=layout.coordinates(rank),
        pp=group_of("pp", mine["pp"]),
        dp=group_of("dp", mine["dp"]),
        ep=group_of("ep", mine["ep"]),
        expert_dp=group_of("expert_dp", mine["expert_dp"]),
        pp_ranks=mine["pp"],
        dp_ranks=mine["dp"],
        ep_ranks=mine["ep"],
        expert_dp_ranks=mine["expert_dp"],
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
