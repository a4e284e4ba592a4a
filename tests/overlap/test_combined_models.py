"""The engine on the real model: GPT stages (dense-first, MoE layers) through the tape and the
combined step give exactly the bits of plain autograd and of the sequential path."""

import pytest
import torch
import torch.distributed as dist

from megapipe.models import GPTConfig, build_stage, gpt_loss
from megapipe.overlap.combined import combined_step
from megapipe.overlap.device_streams import make_streams
from megapipe.overlap.node_trace import NodeTrace
from megapipe.overlap.sequential import record_forward, run_backward
from megapipe.overlap.wgrad import WeightGradQueue
from support.overlap_asserts import assert_same_tensors

CONFIG = dict(num_layers=5, first_k_dense_layers=1, hidden_size=16, num_heads=2, seq_length=8,
              ffn_hidden_size=32, moe_ffn_hidden_size=16)
# rope, grouped-query attention, QK norm, kv_channels, tied embeddings (issue 31)
MODERN = dict(CONFIG, num_heads=4, num_query_groups=2, kv_channels=8, qk_layernorm=True,
              position_embedding_type="rope", untie_embeddings_and_output_weights=False)
# issue 40: OLMoE's QK norm over all heads, the top-k weights renormalised (Mixtral, Qwen3-MoE)
PUBLISHED = dict(MODERN, qk_layernorm_scope="all", moe_router_pre_softmax=False)
MODELS = pytest.mark.parametrize("fields", [CONFIG, MODERN, PUBLISHED],
                                 ids=["reference", "modern", "published"])


def _inputs(cfg, part, gen):
    if part == 0:
        return torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
    return torch.randn(2, cfg.seq_length, cfg.hidden_size, generator=gen).requires_grad_(True)


def _grads(stages):
    return [None if p.grad is None else p.grad.clone() for s in stages for p in s.parameters()]


def _backward_grads(stage, tape, outs, is_last, labels, g):
    """Gradients for a tape's outputs: the loss's (via .grad of the returned leaves) or g."""
    if is_last:
        gpt_loss(outs[0], labels).backward()
        return None
    return (g,)


def tape_matches_plain(part: int, num_parts: int, ep: bool, fields: dict = CONFIG) -> int:
    group = dist.group.WORLD if ep else None
    rank = dist.get_rank() if ep else 0
    cfg = GPTConfig(**fields)
    gen = torch.Generator().manual_seed(100 + rank)
    x = _inputs(cfg, part, gen)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
    g = torch.randn(2, cfg.seq_length, cfg.hidden_size, generator=gen)
    is_last = part == num_parts - 1
    ref = build_stage(cfg, part, num_parts, ep_group=group)
    x_ref = x.detach().clone().requires_grad_(x.requires_grad)
    out = ref(x_ref)
    if is_last:
        gpt_loss(out, labels).backward()
    else:
        out.backward(g)
    stage = build_stage(cfg, part, num_parts, ep_group=group)
    outs, tape = record_forward(stage.layer_plans(), (x,))
    assert torch.equal(outs[0], out)
    (gx,) = run_backward(tape, _backward_grads(stage, tape, outs, is_last, labels, g))
    if x.requires_grad:
        assert torch.equal(gx, x_ref.grad)
    assert_same_tensors(_grads([stage]), _grads([ref]))
    return len(list(stage.parameters()))


def combined_matches_sequential(f_part: int, b_part: int, num_parts: int, defer: bool, ep: bool,
                                fields: dict = CONFIG) -> int:
    group = dist.group.WORLD if ep else None
    rank = dist.get_rank() if ep else 0
    cfg = GPTConfig(**fields)
    gen = torch.Generator().manual_seed(rank)
    x_i, x_j = _inputs(cfg, f_part, gen), _inputs(cfg, b_part, gen)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
    g_j = torch.randn(2, cfg.seq_length, cfg.hidden_size, generator=gen)
    b_last = b_part == num_parts - 1
    results = []
    for combined in (False, True):
        stages = {p: build_stage(cfg, p, num_parts, ep_group=group)
                  for p in sorted({f_part, b_part})}
        outs_j, tape_j = record_forward(stages[b_part].layer_plans(), (x_j,))
        grads_j = _backward_grads(stages[b_part], tape_j, outs_j, b_last, labels, g_j)
        if combined:
            trace = NodeTrace()
            with make_streams("cpu") as streams:
                outs_i, tape_i, gx_j = combined_step(
                    stages[f_part].layer_plans(), (x_i,), tape_j, grads_j, streams,
                    delay_wgrad_compute=defer, trace=trace,
                )
            comm_beside_compute = [
                s for s in trace.spans if s.kind == "comm"
                and any(c.kind == "compute" and c.direction != s.direction for c in trace.spans)
            ]
            assert comm_beside_compute
        else:
            outs_i, tape_i = record_forward(stages[f_part].layer_plans(), (x_i,))
            queue = WeightGradQueue() if defer else None
            gx_j = run_backward(tape_j, grads_j, wgrad=queue)
            if queue is not None:
                queue.run()
        results.append((outs_i, gx_j, _grads(stages.values())))
    (o_seq, g_seq, p_seq), (o_comb, g_comb, p_comb) = results
    assert_same_tensors(list(o_seq), list(o_comb))
    assert_same_tensors(list(g_seq), list(g_comb))
    assert_same_tensors(p_seq, p_comb)
    return len(p_seq)


@MODELS
@pytest.mark.parametrize("part", [0, 1])
def test_tape_matches_plain_autograd_on_gpt_stages(part, fields):
    assert tape_matches_plain(part, 2, ep=False, fields=fields) > 0


@MODELS
@pytest.mark.parametrize(
    "f_part,b_part,defer", [(0, 1, False), (0, 1, True), (1, 1, True), (1, 0, False)]
)
def test_combined_step_on_gpt_stages_is_bitwise_sequential(f_part, b_part, defer, fields):
    assert combined_matches_sequential(f_part, b_part, 2, defer, ep=False, fields=fields) > 0


def _on_ranks():
    checks = [tape_matches_plain(1, 2, ep=True), tape_matches_plain(0, 2, ep=True, fields=MODERN)]
    for f_part, b_part, defer in [(0, 1, True), (1, 1, False), (1, 0, True)]:
        checks.append(combined_matches_sequential(f_part, b_part, 2, defer, ep=True))
    checks.append(combined_matches_sequential(1, 0, 2, True, ep=True, fields=MODERN))
    return checks


def test_gpt_stages_with_ep2_all_to_all_on_two_ranks(rank_pools):
    for checks in rank_pools(2).run(_on_ranks):
        assert all(n > 0 for n in checks)


def test_trace_of_gpt_stage_pairs_every_moe_comm_node_as_specified():
    cfg = GPTConfig(**CONFIG)
    stage = build_stage(cfg, 1, 2)
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
    outs_j, tape_j = record_forward(stage.layer_plans(), (_inputs(cfg, 1, gen),))
    gpt_loss(outs_j[0], labels).backward()
    trace = NodeTrace()
    with make_streams("cpu") as streams:
        combined_step(stage.layer_plans(), (_inputs(cfg, 1, gen),), tape_j, None, streams,
                      delay_wgrad_compute=True, trace=trace)
    expected = {("B", "combine"): ("F", "attention"), ("F", "dispatch"): ("B", "experts"),
                ("B", "dispatch"): ("F", "experts"), ("F", "combine"): ("B", "attention")}
    moe_layers = {s.layer for s in trace.spans if s.kind == "comm"}
    checked = 0
    for slot in trace.slots():
        for comm in (s for s in slot if s.kind == "comm"):
            if len(tape_j.layers) - 1 - comm.layer not in moe_layers:
                continue  # beside a dense layer, the embedding or the head
            beside = {(s.direction, s.node.split(".")[-1]) for s in slot if s.kind == "compute"}
            assert expected[(comm.direction, comm.node.split(".")[-1])] in beside
            checked += 1
    assert checked >= 4
