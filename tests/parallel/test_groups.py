import pytest
import torch
import torch.distributed as dist

from megapipe.parallel.config import ParallelConfig
from megapipe.parallel.groups import create_groups, rank_grid


def _grids(max_world: int = 8):
    for pp in range(1, max_world + 1):
        for tp in (1, 2, 4):
            for dp in range(1, max_world // (pp * tp) + 1):
                for ep in range(1, tp * dp + 1):
                    if (tp * dp) % ep == 0:
                        yield ParallelConfig(pp, dp, ep, tp)


def test_example_grid_pp2_dp4_ep2():
    grid = rank_grid(ParallelConfig(pp=2, dp=4, ep=2))
    assert grid.pp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert grid.dp_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert grid.ep_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert grid.expert_dp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    c = grid.coordinates(6)
    assert (c.pp_rank, c.dp_rank, c.ep_rank, c.expert_dp_rank) == (1, 2, 0, 1)
    assert grid.groups_of(6) == {"pp": (2, 6), "dp": (4, 5, 6, 7), "ep": (6, 7),
                                 "expert_dp": (4, 6)}


def test_example_grid_tp2_pp2_ep2_is_megatrons():
    """Megatron's initialize_model_parallel(2, 2, expert_model_parallel_size=2) on 8 ranks:
    tensor parallel fastest, then data parallel; EP over consecutive ranks of a stage."""
    grid = rank_grid(ParallelConfig(pp=2, dp=2, ep=2, tp=2))
    assert grid.tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert grid.dp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert grid.pp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert grid.ep_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert grid.expert_dp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    c = grid.coordinates(6)
    assert (c.pp_rank, c.dp_rank, c.tp_rank, c.ep_rank, c.expert_dp_rank) == (1, 1, 0, 0, 1)
    assert rank_grid(ParallelConfig(pp=2, dp=4)).tp_groups == ()  # tp 1: no groups to make


@pytest.mark.parametrize("config", list(_grids()), ids=str)
def test_grid_invariants(config):
    grid = rank_grid(config)
    world = set(range(config.world_size))
    sizes = {"pp": config.pp, "dp": config.dp, "ep": config.ep, "expert_dp": config.expert_dp}
    if config.tp > 1:
        sizes["tp"] = config.tp
    for name, size in sizes.items():
        groups = getattr(grid, f"{name}_groups")
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(world), f"{name} groups must partition the world"
        assert all(len(g) == size for g in groups), name
    for rank in world:
        c = grid.coordinates(rank)
        mine = grid.groups_of(rank)
        assert rank == (c.pp_rank * config.dp + c.dp_rank) * config.tp + c.tp_rank  # Megatron's
        assert mine["pp"][c.pp_rank] == rank and mine["dp"][c.dp_rank] == rank
        assert mine["ep"][c.ep_rank] == rank and mine["expert_dp"][c.expert_dp_rank] == rank
        # PP peers share the data- and tensor-parallel position; DP peers the tensor position
        assert all(grid.coordinates(r).dp_rank == c.dp_rank for r in mine["pp"])
        assert all(grid.coordinates(r).tp_rank == c.tp_rank for r in mine["pp"] + mine["dp"])
        stage = {r for r in world if grid.coordinates(r).pp_rank == c.pp_rank}
        assert set(mine["ep"]) <= stage and set(mine["expert_dp"]) <= stage
        if config.tp == 1:  # EP and expert-DP then live inside the DP group
            assert set(mine["ep"]) <= set(mine["dp"]) and set(mine["expert_dp"]) <= set(mine["dp"])
        # expert-DP peers hold the same experts: same EP position, one per EP block
        assert all(grid.coordinates(r).ep_rank == c.ep_rank for r in mine["expert_dp"])
        assert set(mine["ep"]) & set(mine["expert_dp"]) == {rank}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pp=0, dp=1), "pp must be >= 1, got pp=0"),
        (dict(pp=1, dp=-2), "dp must be >= 1, got dp=-2"),
        (dict(pp=1, dp=2, ep=0), "ep must be >= 1, got ep=0"),
        (dict(pp=1, dp=6, ep=4), "ep=4 must divide dp=6"),
        (dict(pp=1, dp=3, ep=4, tp=2), r"ep=4 must divide tp x dp = 2 x 3"),
        (dict(pp=1, dp=1, tp=0), "tp must be >= 1, got tp=0"),
    ],
)
def test_bad_sizes_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_bad_types_and_world_rejected():
    with pytest.raises(TypeError, match="pp must be an int, got 2.0"):
        ParallelConfig(pp=2.0, dp=1)
    with pytest.raises(TypeError, match="ep must be an int, got True"):
        ParallelConfig(pp=1, dp=1, ep=True)
    with pytest.raises(ValueError, match="world_size=6 is not divisible by pp=4"):
        ParallelConfig.from_world_size(6, pp=4)
    assert ParallelConfig.from_world_size(8, pp=2, ep=2) == ParallelConfig(2, 4, 2)
    with pytest.raises(ValueError, match="world_size=8 does not match pp x dp = 2 x 2 = 4"):
        ParallelConfig(2, 2).check_world_size(8)
    assert ParallelConfig.from_world_size(8, pp=2, ep=2, tp=2) == ParallelConfig(2, 2, 2, 2)
    with pytest.raises(ValueError, match="world_size=8 does not match pp x dp x tp"):
        ParallelConfig(2, 1, tp=2).check_world_size(8)
    with pytest.raises(ValueError, match="not divisible by pp x tp = 2 x 3"):
        ParallelConfig.from_world_size(8, pp=2, tp=3)
    with pytest.raises(ValueError, match="rank=8 is outside the world of 8 ranks"):
        rank_grid(ParallelConfig(2, 4)).coordinates(8)


def _sum_over_groups(configs):
    """For each config: build the groups and all-reduce the global rank over each of them."""
    out = []
    for config in configs:
        groups = create_groups(config)
        sums = {}
        for name in ("pp", "dp", "ep", "expert_dp"):
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t, group=getattr(groups, name))
            sums[name] = (t.item(), getattr(groups, f"{name}_ranks"))
        out.append((groups.coordinates, sums))
    return out


def _create_with_wrong_world():
    try:
        create_groups(ParallelConfig(pp=2, dp=4))
    except ValueError as err:
        return str(err)
    return "no error"


def test_create_groups_all_reduces_over_the_grid(rank_pools):
    configs = [ParallelConfig(2, 2, 2), ParallelConfig(1, 4, 2), ParallelConfig(4, 1, 1)]
    results = rank_pools(4).run(_sum_over_groups, configs)
    for rank, per_config in enumerate(results):
        for config, (coords, sums) in zip(configs, per_config):
            grid = rank_grid(config)
            assert coords == grid.coordinates(rank)
            for name, ranks in grid.groups_of(rank).items():
                assert sums[name] == (float(sum(ranks)), ranks), (config, rank, name)


def test_create_groups_rejects_wrong_world_before_any_group(rank_pools):
    messages = rank_pools(4).run(_create_with_wrong_world)
    assert all("world_size=4 does not match pp x dp = 2 x 4 = 8" in m for m in messages)


def test_high_priority_groups_get_nccl_high_priority_streams(monkeypatch):
    """On NCCL, the groups named in ``high_priority`` are created with
    ``ProcessGroupNCCL.Options(is_high_priority_stream=True)``, the others plainly (the CPU
    build has no NCCL: its Options class and the world are stood in for)."""

    class Options:
        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self.is_high_priority_stream = is_high_priority_stream

    created = []

    def new_group(ranks, backend=None, **kwargs):
        created.append((tuple(ranks), kwargs))
        return object()

    monkeypatch.setattr(dist, "ProcessGroupNCCL", type("NCCL", (), {"Options": Options}),
                        raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", new_group)
    config = ParallelConfig(pp=2, dp=4, ep=2)
    create_groups(config, high_priority=["ep"])
    grid = rank_grid(config)
    with_options = [ranks for ranks, kw in created if kw]
    assert with_options == list(grid.ep_groups)  # every EP group, and only those
    assert all(kw["pg_options"].is_high_priority_stream for _, kw in created if kw)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    created.clear()
    create_groups(config, high_priority=["ep"])
    assert all(kw == {} for _, kw in created)  # nothing to set on gloo
    with pytest.raises(ValueError, match=r"high_priority=\['xp'\] are not group names"):
        create_groups(config, high_priority=["xp"])
