"""megapipe.parallel: the PP x DP (EP folded into DP) grid, its process groups, and launch."""

from megapipe.parallel.config import ParallelConfig
from megapipe.parallel.groups import ProcessGroups, RankCoordinates, RankLayout, create_groups, rank_layout
from megapipe.parallel.launch import (
    LaunchInfo, detect_launcher, free_port, init_distributed, resolve_launch, start_local_ranks,
)
from megapipe.parallel.slurm_hostlist import expand_hostlist

__all__ = [
    "LaunchInfo", "ParallelConfig", "ProcessGroups", "RankCoordinates", "RankLayout", "create_groups",
    "detect_launcher", "free_port", "start_local_ranks",
    "expand_hostlist", "init_distributed", "rank_layout", "resolve_launch",
]
