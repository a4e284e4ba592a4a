"""The emulated link with ep = 1: a single process models a link that every row crosses."""

import time

import torch

from megapipe.moe import EmulatedLink, MoEConfig, MoELayer, MoEState


def test_link_with_ep1_stretches_dispatch_and_combine_both_ways_and_keeps_the_bits():
    link = EmulatedLink(bandwidth_bytes_per_s=1e6, latency_s=0.01)
    base = dict(hidden_size=8, num_experts=4, top_k=2, ffn_hidden_size=6, init_std=0.5)
    layer = MoELayer(MoEConfig(**base, link=link), seed=3)
    plain = MoELayer(MoEConfig(**base), seed=3)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    state = MoEState()
    route, dispatch, experts, combine, _ = layer.node_plan().graph.nodes
    _, rows = route.fn(state, (x,))
    modelled = link.transfer_time(rows.numel() * rows.element_size())  # every row crosses
    leaf = rows.detach().requires_grad_()
    started = time.perf_counter()
    (received,) = dispatch.fn(state, (leaf,))
    times = [time.perf_counter() - started]
    (expert_out,) = experts.fn(state, (received,))
    started = time.perf_counter()
    (out,) = combine.fn(state, (expert_out,))
    times.append(time.perf_counter() - started)
    started = time.perf_counter()
    out.backward(torch.ones_like(out))
    backward_s = time.perf_counter() - started
    assert min(times) >= modelled, (times, modelled)
    assert backward_s >= 2 * modelled, (backward_s, modelled)  # the combine's and the dispatch's
    assert torch.equal(layer(x), plain(x))


def test_rows_arrive_in_a_new_buffer_both_ways():
    """As over a real link, the delayed rows (and their gradient) are a new buffer written after
    the wait, so on CUDA a consumer that skips the wait for the comm stream reads unwritten
    memory: a missing wait changes the bits of a bitwise run with a link."""
    link = EmulatedLink(bandwidth_bytes_per_s=1e12)
    x = torch.randn(4, 8, requires_grad=True)
    out = link.delay(x)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    grad = torch.randn(4, 8)
    (x_grad,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(x_grad, grad) and x_grad.data_ptr() != grad.data_ptr()
