"""Expert parallelism over gloo: the EP layer equals the single-process layer with every expert
local, for many configurations run inside one pool task (starting processes costs seconds)."""

import time

import torch
import torch.distributed as dist

from megapipe.moe import EmulatedLink, MoEConfig, MoELayer, MoEState

H = 6
E = 8
SEED = 11
LAYER = 3


def _inputs(
    config_id: int, num_ranks: int, shape_3d: bool, even: bool = False
) -> list[torch.Tensor]:
    """Uneven microbatches, one per rank (``even``: 5 tokens on every rank, as padding to a
    capacity requires); feature 0 is positive so routing can be steered."""
    gen = torch.Generator().manual_seed(1000 + config_id)
    xs = []
    for r in range(num_ranks):
        t = 5 if even else 3 + 2 * r
        x = torch.randn(t, H, generator=gen)
        x[:, 0] = x[:, 0].abs() + 1.0
        xs.append(x.reshape(1, t, H) if shape_3d else x)
    return xs


def _steer(layer: MoELayer, starve: int | None, hot: int | None) -> None:
    with torch.no_grad():
        if starve is not None:
            layer.router.weight[starve, 0] = -60.0  # never among the top k when k < E
        if hot is not None:
            layer.router.weight[hot, 0] = 60.0  # first choice of every token


CONFIGS = [
    dict(kw=dict(top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01), starve=5),
    dict(kw=dict(top_k=1, aux_loss_coeff=0.1), starve=2, scale=0.25),
    dict(kw=dict(top_k=E, z_loss_coeff=0.01)),
    dict(kw=dict(top_k=2, aux_loss_coeff=0.1), hot=6),
    dict(kw=dict(top_k=1), hot=1),
    # padded to capacity: every EP rank must have as many tokens (static all-to-all sizes)
    dict(kw=dict(top_k=2, capacity_factor=0.5, aux_loss_coeff=0.1), hot=3, even=True),
    dict(
        kw=dict(
            top_k=3, score_function="sigmoid", shared_expert_intermediate_size=4, aux_loss_coeff=0.1
        ),
        starve=0,
        shape_3d=True,
    ),
]


def _run(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor, scale: float):
    layer.zero_grad(set_to_none=True)
    layer.aux_loss_scale = scale
    x = x.clone().requires_grad_()
    state = MoEState()
    from megapipe.overlap.plan import run_nodes

    (y,) = run_nodes(layer.node_plan(), (x,), state)
    (y * grad).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return y.detach(), layer.aux_loss_log.pop_mean(), x.grad, grads, state


def _close(failures: list[str], what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Relative tolerance 1e-6, measured against the tensor's largest entry (expert gradients
    sum the ranks' contributions in a different order than the single-process layer)."""
    try:
        atol = 1e-6 * float(b.abs().max()) if b.numel() else 0.0
        torch.testing.assert_close(a, b, rtol=1e-6, atol=atol)
    except AssertionError as err:  # collect: raising now would leave peers in a collective
        failures.append(f"{what}: {err}")


def check_ep_matches_single_process(ep: int) -> dict:
    """On every rank of the world: EP layers over groups of ``ep`` ranks vs the all-local layer."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
    group = groups[rank // ep]
    ep_rank = rank % ep
    local = E // ep
    members = list(range(rank - ep_rank, rank - ep_rank + ep))
    seen_idle_expert = seen_drop = False
    failures: list[str] = []
    for cid, case in enumerate(CONFIGS):
        config = MoEConfig(
            hidden_size=H, num_experts=E, ffn_hidden_size=5, init_std=0.5, **case["kw"]
        )
        xs = _inputs(cid, world, case.get("shape_3d", False), case.get("even", False))
        gs = [
            torch.randn(x.shape, generator=torch.Generator().manual_seed(r))
            for r, x in enumerate(xs)
        ]
        scale = case.get("scale", 1.0)
        ep_layer = MoELayer(config, ep_group=group, layer_index=LAYER, seed=SEED)
        ref_layer = MoELayer(config, ep_group=None, layer_index=LAYER, seed=SEED)
        for layer in (ep_layer, ref_layer):
            _steer(layer, case.get("starve"), case.get("hot"))
        y, aux, gx, grads, state = _run(ep_layer, xs[rank], gs[rank], scale)
        refs = [_run(ref_layer, xs[r], gs[r], scale) for r in members]
        ry, raux, rgx, rgrads, rstate = refs[ep_rank]
        name = f"ep={ep} config {cid} {case}"
        _close(failures, f"{name} output", y, ry)
        _close(failures, f"{name} aux loss", aux, raux)
        _close(failures, f"{name} input grad", gx, rgx)
        for pname, g in grads.items():
            if pname.startswith("experts."):
                # an expert sees the tokens of every rank in its EP group
                expected = sum(ref[3][pname] for ref in refs)[
                    ep_rank * local : (ep_rank + 1) * local
                ]
            else:
                expected = rgrads[pname]
            _close(failures, f"{name} grad {pname}", g, expected)
        all_counts = sum(ref[4].rows_per_expert for ref in refs)
        seen_idle_expert |= bool((all_counts == 0).any())
        seen_drop |= bool((state.choice_rows < 0).any())
    assert not failures, "\n".join(failures)
    assert seen_idle_expert and seen_drop, "the configurations must cover idle experts and drops"
    return {"configs": len(CONFIGS)}


def test_ep2_matches_single_process(rank_pools):
    assert rank_pools(2).run(check_ep_matches_single_process, 2)[0] == {"configs": len(CONFIGS)}


def test_ep4_and_ep2_subgroups_match_single_process(rank_pools):
    pool = rank_pools(4)
    pool.run(check_ep_matches_single_process, 4)
    pool.run(check_ep_matches_single_process, 2)


def check_ep1_group_issues_no_collective() -> bool:
    """A size-1 EP group gives the all-local layer; no collective runs (rank 1 issues none)."""
    rank = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    config = MoEConfig(hidden_size=H, num_experts=4, top_k=2, ffn_hidden_size=5, init_std=0.5)
    x = _inputs(0, 1, False)[0]
    y = MoELayer(config, ep_group=groups[rank], layer_index=LAYER, seed=SEED)(x)
    if rank == 0:  # rank 1 runs nothing else: a collective here would hang
        ref = MoELayer(config, layer_index=LAYER, seed=SEED)(x)
        assert torch.equal(y, ref)
    return True


def check_invalid_ep_config_raises_before_collectives() -> str:
    config = MoEConfig(hidden_size=H, num_experts=6, top_k=2, ffn_hidden_size=5)
    try:
        MoELayer(config, ep_group=dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return "no error"


def test_ep1_and_invalid_ep_size(rank_pools):
    pool = rank_pools(4)
    assert pool.run(check_ep1_group_issues_no_collective) == [True] * 4
    messages = pool.run(check_invalid_ep_config_raises_before_collectives)
    assert all("num_experts=6 must be divisible by the EP group size 4" in m for m in messages)


def check_emulated_link_sleeps_modelled_time() -> list[str]:
    """Dispatch (forward) and its backward take at least the modelled link time; results are
    bitwise those without the link."""
    rank = dist.get_rank()
    link = EmulatedLink(bandwidth_bytes_per_s=2e5, latency_s=0.02)
    base = dict(hidden_size=H, num_experts=4, top_k=2, ffn_hidden_size=5, init_std=0.5)
    layer = MoELayer(MoEConfig(**base, link=link), ep_group=dist.group.WORLD, seed=SEED)
    plain = MoELayer(MoEConfig(**base), ep_group=dist.group.WORLD, seed=SEED)
    x = _inputs(5, 2, False)[rank].requires_grad_()
    state = MoEState()
    route, dispatch, *_ = layer.node_plan().graph.nodes
    probs, rows = route.fn(state, (x,))
    rows_leaf = rows.detach().requires_grad_()
    started = time.perf_counter()
    (received,) = dispatch.fn(state, (rows_leaf,))
    forward_s = time.perf_counter() - started
    plan = state.dispatch_splits
    row_bytes = H * 4
    sent = (sum(plan.input_splits) - plan.input_splits[rank]) * row_bytes
    received_bytes = (sum(plan.output_splits) - plan.output_splits[rank]) * row_bytes
    started = time.perf_counter()
    received.backward(torch.ones_like(received))
    backward_s = time.perf_counter() - started
    assert forward_s >= link.transfer_time(sent), (forward_s, link.transfer_time(sent))
    assert backward_s >= link.transfer_time(received_bytes), (backward_s, received_bytes)
    assert torch.equal(layer(x), plain(x))
    return [layer.describe(), plain.describe()]


def test_emulated_link_sleeps_at_least_modelled_time(rank_pools):
    described = rank_pools(2).run(check_emulated_link_sleeps_modelled_time)
    assert "emulated link ON" in described[0][0] and "emulated link off" in described[0][1]
