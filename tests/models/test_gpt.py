import pytest
import torch

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage, stage_ids_of_rank
from megapipe.overlap.plan import NodeKind, run_nodes

DENSE = GPTConfig(num_layers=6, first_k_dense_layers=6)
MOE = GPTConfig(num_layers=6, first_k_dense_layers=1, moe_layer_freq=2)  # MoE layers 1, 3, 5
MOE_SHARED = GPTConfig(
    num_layers=4, moe_score_function="sigmoid", moe_shared_expert_intermediate_size=16, moe_top_k=1
)
# rope + grouped-query attention + QK norm + kv_channels + tied embeddings
MODERN = GPTConfig(
    num_layers=4, num_heads=4, num_query_groups=2, kv_channels=6, qk_layernorm=True,
    position_embedding_type="rope", untie_embeddings_and_output_weights=False,
)
CONFIGS = pytest.mark.parametrize(
    "config", [DENSE, MOE, MOE_SHARED, MODERN], ids=["dense", "moe", "moe_shared", "modern"]
)


def _batch(config, batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, config.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _pipeline_loss_and_grads(stages, tokens, labels):
    """Run stages in order with detached hand-offs (as a pipeline does); loss and named grads
    (a weight two stages hold, tied embeddings, gets the sum, as ``pipeline.grad_sync`` does)."""
    x, outputs = tokens, []
    for stage in stages:
        x_in = x if x.dtype == torch.int64 else x.detach().requires_grad_()
        outputs.append((x_in, stage(x_in)))
        x = outputs[-1][1]
    loss = gpt_loss(x, labels)
    loss.backward()
    for (_, out), (next_in, _) in zip(reversed(outputs[:-1]), reversed(outputs[1:])):
        out.backward(next_in.grad)
    named = {}
    for stage in stages:
        for n, p in stage.named_parameters():
            named[n] = p.grad if n not in named else named[n] + p.grad
    return loss.item(), named


@CONFIGS
@pytest.mark.parametrize("num_parts", [1, 2, 4])
def test_split_model_has_same_weights_loss_and_grads(config, num_parts):
    tokens, labels = _batch(config)
    full = build_stage(config, 0, 1)
    ref_loss, ref_grads = _pipeline_loss_and_grads([full], tokens, labels)
    stages = [build_stage(config, p, num_parts) for p in range(num_parts)]
    weights = {}
    for stage in stages:
        weights.update(stage.state_dict())
    assert weights.keys() == full.state_dict().keys()
    assert all(torch.equal(weights[n], t) for n, t in full.state_dict().items())
    loss, grads = _pipeline_loss_and_grads(stages, tokens, labels)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@CONFIGS
@pytest.mark.parametrize("placement", ["loop", "v"])
def test_stages_gathered_by_placement_give_the_same_loss(config, placement):
    pp, num_stages = 2, 4
    tokens, labels = _batch(config)
    owned = {}
    for rank in range(pp):
        for stage_id in stage_ids_of_rank(rank, pp, num_stages, placement):
            owned[stage_id] = build_stage(config, stage_id, num_stages)
    assert sorted(owned) == list(range(num_stages))
    x = tokens
    for stage_id in range(num_stages):
        x = owned[stage_id](x)
    assert gpt_loss(x, labels).item() == gpt_loss(build_stage(config, 0, 1)(tokens), labels).item()


@CONFIGS
def test_layer_plans_in_order_equal_forward(config):
    tokens, _ = _batch(config)
    for part in range(2):
        stage = build_stage(config, part, 2)
        x = tokens if part == 0 else torch.randn(3, config.seq_length, config.hidden_size)
        plans = stage.layer_plans()
        names = [[node.name for node in plan.graph.nodes] for plan in plans]
        assert (names[0] == ["embedding"]) == (part == 0)
        assert (names[-1] == ["head"]) == (part == 1)
        values = (x,)
        for plan in plans:
            values = run_nodes(plan, values)
        assert torch.equal(values[0], stage(x))
        for layer in stage.layers.values():
            kinds = [node.kind for node in layer.node_plan().graph.nodes]
            if layer.is_moe:
                compute, comm = NodeKind.COMPUTE, NodeKind.COMM
                assert kinds == [compute, comm, compute, comm, compute]
            else:
                assert kinds == [NodeKind.COMPUTE]


def test_init_depends_on_seed_only():
    a, b = build_stage(DENSE, 0, 1), build_stage(DENSE, 0, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_stage(GPTConfig(num_layers=6, first_k_dense_layers=6, seed=1), 0, 1)
    assert not torch.equal(a.layers["0"].attention.w_qkv, c.layers["0"].attention.w_qkv)
    # distinct layers draw distinct weights
    assert not torch.equal(a.layers["0"].attention.w_qkv, a.layers["1"].attention.w_qkv)


def test_bad_inputs_and_configs_rejected():
    first, second = build_stage(DENSE, 0, 2), build_stage(DENSE, 1, 2)
    with pytest.raises(ValueError, match="int64 token ids"):
        first(torch.randn(2, 4))
    with pytest.raises(ValueError, match="sequence length 17 exceeds GPTConfig.seq_length=16"):
        first(torch.zeros(1, 17, dtype=torch.int64))
    with pytest.raises(ValueError, match="float hidden states"):
        second(torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="hidden_size=30 must be divisible by num_heads=4"):
        GPTConfig(hidden_size=30)
    with pytest.raises(ValueError, match="moe_top_k=5 must lie in"):
        GPTConfig(moe_top_k=5)
    with pytest.raises(ValueError, match="model_part=2 outside"):
        build_stage(DENSE, 2, 2)


def test_moe_layout_follows_config():
    stage = build_stage(MOE, 0, 1)
    moe = [layer.is_moe for layer in stage.layers.values()]
    assert moe == [False, True, False, True, False, True]
    assert [m.layer_index for m in stage.moe_layers()] == [1, 3, 5]
    # experts are keyed by global layer index: a later stage holds the same layer-5 experts
    last = build_stage(MOE, 1, 2)
    assert torch.equal(last.layers["5"].moe.experts.w_gate, stage.layers["5"].moe.experts.w_gate)


def _run_node_by_node(plans, x, labels):
    """Drive every node's forward and backward separately on the tape, detaching at node
    boundaries (as the overlap engine does); returns the loss and the grad of the stage input."""
    from megapipe.overlap.sequential import record_forward, run_backward

    (out,), tape = record_forward(plans, (x.requires_grad_(),))
    loss = gpt_loss(out, labels)
    (grad,) = torch.autograd.grad(loss, out)
    (x_grad,) = run_backward(tape, (grad,))
    return loss.item(), x_grad


@CONFIGS
def test_nodes_driven_one_by_one_match_autograd(config):
    """The residual going around the comm nodes gets its gradient when nodes run detached."""
    tokens, labels = _batch(config)
    stage = build_stage(config, 1, 2)
    x = build_stage(config, 0, 2)(tokens).detach().requires_grad_()
    loss = gpt_loss(stage(x), labels)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad()
    node_loss, node_x_grad = _run_node_by_node(stage.layer_plans(), x.detach(), labels)
    assert node_loss == loss.item()
    torch.testing.assert_close(node_x_grad, x.grad, rtol=1e-6, atol=1e-8)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-6, atol=1e-8, msg=name)
