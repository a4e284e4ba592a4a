"""megapipe.parallel: the PP x DP (EP folded into DP) grid, its process groups, and launch."""

from megapipe.parallel.config import ParallelConfig
from megapipe.parallel.groups import (
    ProcessGroups,
    RankCoordinates,
    RankGrid,
    create_groups,
    rank_grid,
    release_groups,
)
from megapipe.parallel.launch import (
    LaunchInfo,
    detect_launcher,
    free_port,
    init_distributed,
    resolve_launch,
    start_local_ranks,
)
from megapipe.parallel.slurm_hostlist import expand_hostlist

__all__ = [
    "LaunchInfo",
    "ParallelConfig",
    "ProcessGroups",
    "RankCoordinates",
    "RankGrid",
    "create_groups",
    "detect_launcher",
    "free_port",
    "start_local_ranks",
    "expand_hostlist",
    "init_distributed",
    "rank_grid",
    "release_groups",
    "resolve_launch",
]
