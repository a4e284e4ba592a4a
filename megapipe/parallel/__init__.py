"""megapipe.parallel: the PP x DP (EP folded into DP) grid, its process groups, and launch."""

from megapipe.parallel.config import ParallelConfig
from megapipe.parallel.groups import ProcessGroups, RankCoordinates, RankLayout, create_groups, rank_layout
from megapipe.parallel.launch import LaunchInfo, expand_hostlist, init_distributed, resolve_launch

__all__ = [
    "LaunchInfo", "ParallelConfig", "ProcessGroups", "RankCoordinates", "RankLayout", "create_groups",
    "expand_hostlist", "init_distributed", "rank_layout", "resolve_launch",
]
