"""Single-process MoE layer: against a naive per-token loop, node plan, aux loss, edge cases."""

import pytest
import torch
import torch.nn.functional as F

from megapipe.moe import (
    AuxLossLog,
    GroupedExperts,
    MoEConfig,
    MoELayer,
    MoEState,
    pass_leading,
    sort_by_expert,
)
from megapipe.overlap.plan import LayerState, NodeKind, run_nodes

H = 6


def naive_moe(layer: MoELayer, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Per-token loop over routing choices; with a capacity each expert keeps its first tokens."""
    tokens = x.reshape(-1, H)
    routed = layer.router(tokens)
    ex = layer.experts
    taken = [0] * layer.config.num_experts
    outs = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros(H)
        for j in range(layer.config.top_k):
            e = int(routed.indices[t, j])
            if capacity is not None:
                if taken[e] >= capacity:
                    continue
                taken[e] += 1
            mlp = (F.silu(tokens[t] @ ex.w_gate[e]) * (tokens[t] @ ex.w_up[e])) @ ex.w_down[e]
            acc = acc + routed.probs[t, j] * mlp
        outs.append(acc)
    out = torch.stack(outs)
    if layer.shared_expert is not None:
        out = out + layer.shared_expert(tokens)
    return out.reshape(x.shape)


def make(**kw) -> MoELayer:
    cfg = dict(hidden_size=H, num_experts=4, top_k=2, ffn_hidden_size=5, init_std=0.5)
    cfg.update(kw)
    return MoELayer(MoEConfig(**cfg), layer_index=2, seed=7)


CASES = [
    dict(),
    dict(top_k=1),
    dict(top_k=4),
    dict(score_function="sigmoid", shared_expert_intermediate_size=3),
    dict(capacity_factor=0.5),
    dict(pre_softmax=False),  # the top-k weights renormalised (Megatron's default, Mixtral's)
]


@pytest.mark.parametrize("kw", CASES)
def test_layer_matches_naive_loop_forward_and_backward(kw):
    layer = make(**kw)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    y = layer(x1)
    assert y.shape == x.shape
    capacity = layer.config.capacity(10)
    ref = naive_moe(layer, x2, capacity)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    grads = torch.autograd.grad((y * g).sum(), [x1, *layer.parameters()])
    ref_grads = torch.autograd.grad((ref * g).sum(), [x2, *layer.parameters()], allow_unused=True)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-5, atol=1e-6)


def test_sigmoid_weights_are_normalised_and_softmax_weights_are_not():
    tokens = torch.randn(7, H)
    sig = make(score_function="sigmoid").router(tokens)
    torch.testing.assert_close(sig.probs.sum(-1), torch.ones(7))
    soft = make(top_k=2).router(tokens)
    assert (soft.probs.sum(-1) < 1).all()
    renormalised = make(top_k=2, pre_softmax=False).router(tokens)
    torch.testing.assert_close(renormalised.probs.sum(-1), torch.ones(7))
    assert torch.equal(renormalised.indices, soft.indices)
    torch.testing.assert_close(renormalised.probs, soft.probs / soft.probs.sum(-1, keepdim=True))


def test_plan_permutation_orders_by_expert_and_drops_over_capacity():
    indices = torch.tensor([[2, 0], [2, 1], [2, 0], [3, 2]])
    row_choice, choice_rows, counts = sort_by_expert(indices, 4)
    assert counts.tolist() == [2, 1, 4, 1]
    assert indices.reshape(-1)[row_choice].tolist() == [0, 0, 1, 2, 2, 2, 2, 3]
    assert row_choice.tolist() == [1, 5, 3, 0, 2, 4, 7, 6]
    assert (choice_rows.reshape(-1)[row_choice] == torch.arange(8)).all()
    # with a capacity every expert gets exactly 2 rows: its earliest choices, then padding (-1)
    row_choice, choice_rows, counts = sort_by_expert(indices, 4, capacity=2)
    assert counts.tolist() == [2, 2, 2, 2]
    assert row_choice.tolist() == [1, 5, 3, -1, 0, 2, 6, -1]  # expert 2 keeps tokens 0 and 1
    assert choice_rows.tolist() == [[4, 0], [5, 2], [-1, 1], [6, -1]]


def test_plan_permutation_makes_no_host_sync():
    """Static shapes, no bincount/nonzero/boolean indexing (they read back to the host on CUDA)."""
    from support.host_syncs import HostSyncs

    indices = torch.randint(0, 8, (64, 2), generator=torch.Generator().manual_seed(0))
    with HostSyncs() as syncs:
        for capacity in (None, 5):
            sort_by_expert(indices, 8, capacity)
        indices[indices > 3].sum()  # the instrument sees a boolean index (it must fail here)
    assert [e.op for e in syncs.events] == ["boolean indexing"], syncs.events


def test_capacity_factor_drops_tokens_and_pads_every_expert():
    layer = make(capacity_factor=0.25)
    state = MoEState()
    x = torch.randn(12, H)
    out = run_nodes(layer.node_plan(), (x,), state)[0]
    capacity = layer.config.capacity(12)
    assert capacity == 2
    assert state.rows_per_expert.tolist() == [capacity] * 4
    assert state.row_choice.numel() == 4 * capacity  # padded: a static number of rows
    kept = int((state.choice_rows >= 0).sum())
    assert kept == int((state.row_choice >= 0).sum()) < 24  # some choices dropped, rest padding
    torch.testing.assert_close(out, naive_moe(layer, x, capacity), rtol=1e-5, atol=1e-6)


def test_node_plan_shape_and_leading_tensors_go_around_the_all_to_alls():
    """Route, a fork of one branch (dispatch, experts, combine), finish: what route leaves for
    finish (a leading residual, the shared expert's input, the combine weights) goes around the
    branch, whose nodes read only the rows."""
    layer = make(shared_expert_intermediate_size=3)
    plan = layer.node_plan()
    assert [(n.name, n.kind) for n in plan.graph.nodes] == [
        ("route", NodeKind.COMPUTE),
        ("dispatch", NodeKind.COMM),
        ("experts", NodeKind.COMPUTE),
        ("combine", NodeKind.COMM),
        ("finish", NodeKind.COMPUTE),
    ]
    assert plan.graph.nodes[1].reads_host  # dropless: the dispatch reads its split sizes
    route, dispatch, experts, combine, finish = plan.graph.nodes
    x = torch.randn(3, 4, H)
    residual = torch.randn(3, 4, H)
    state = MoEState()
    *around, rows = route.fn(state, (residual, x))
    assert around[0] is residual and len(around) == 3  # residual, shared input, probs
    (rows,) = combine.fn(state, experts.fn(state, dispatch.fn(state, (rows,))))
    values = finish.fn(state, (*around, rows))
    assert values[0] is residual
    assert len(values) == 2
    assert torch.equal(values[1], layer(x))
    with pytest.raises(ValueError, match="trailing tensors"):
        pass_leading(lambda s, t: t, 3)(LayerState(), (x,))


def test_aux_loss_gradient_is_coeff_times_scale_and_value_is_logged():
    coeff, z_coeff, scale = 0.1, 0.01, 0.25
    layer = make(aux_loss_coeff=coeff, z_loss_coeff=z_coeff)
    layer.aux_loss_scale = scale
    x = torch.randn(9, H)
    # a zero output gradient leaves only the injected auxiliary gradient on the router
    (layer(x) * torch.zeros(9, H)).sum().backward()
    routed = layer.router.reference(x)
    aux = coeff * routed.load_balancing_loss + z_coeff * routed.z_loss
    (expected,) = torch.autograd.grad(scale * aux, layer.router.weight)
    assert expected.abs().max() > 0
    torch.testing.assert_close(layer.router.weight.grad, expected, rtol=1e-6, atol=1e-9)
    logged = layer.aux_loss_log.pop_all()
    assert len(logged) == 1 and not logged[0].requires_grad
    torch.testing.assert_close(logged[0], aux.detach())
    assert layer.aux_loss_log.pop_mean() is None


def test_aux_loss_log_mean():
    log = AuxLossLog()
    log.record(torch.tensor(1.0))
    log.record(torch.tensor(3.0, requires_grad=True))
    assert len(log) == 2
    assert log.pop_mean().item() == 2.0
    assert len(log) == 0


def test_load_balancing_loss_is_one_for_uniform_scores():
    from megapipe.moe.router import load_balancing_loss

    scores = torch.full((4, 4), 0.25)
    indices = torch.tensor([[0], [1], [2], [3]])
    assert load_balancing_loss(scores, indices, 4).item() == pytest.approx(1.0)


def test_experts_depend_only_on_seed_layer_and_global_index():
    full = GroupedExperts(H, 5, num_local_experts=4, first_expert=0, seed=3, layer_index=1)
    part = GroupedExperts(H, 5, num_local_experts=2, first_expert=2, seed=3, layer_index=1)
    assert torch.equal(full.w_down[2:], part.w_down)
    assert all(p.expert_parallel for p in part.parameters())
    other_layer = GroupedExperts(H, 5, num_local_experts=4, first_expert=0, seed=3, layer_index=2)
    assert not torch.equal(full.w_gate, other_layer.w_gate)
    a, b = make(), make()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not hasattr(a.router.weight, "expert_parallel")


def test_empty_microbatch_is_rejected():
    with pytest.raises(ValueError, match="empty microbatch"):
        make()(torch.zeros(0, 3, H))


def test_wrong_hidden_size_is_rejected():
    with pytest.raises(ValueError, match=r"expected \[b, s, 6\]"):
        make()(torch.zeros(4, H + 1))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(top_k=5), "top_k=5 must be <= num_experts=4"),
        (dict(top_k=0), "top_k=0 must be >= 1"),
        (dict(score_function="relu"), "score_function='relu'"),
        (dict(capacity_factor=0.0), "capacity_factor=0.0"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff=-1.0"),
        (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    ],
)
def test_invalid_config_is_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_link_description():
    from megapipe.moe import EmulatedLink

    link = EmulatedLink(2e9, 5e-6)
    assert "ON" in link.describe() and "2 GB/s" in link.describe()
    assert "emulated link ON" in make(link=link).describe()
    assert "emulated link off" in make().describe()
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=0"):
        EmulatedLink(0)
