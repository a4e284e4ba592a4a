"""Rank-side code of the sync-free dispatch tests (``moe.rank_capacity``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.moe.dispatcher import TokenDispatcher
from megapipe.moe.rank_capacity import RankCapacityDispatch, lane_rows
from support.host_syncs import HostSyncs

EXPERTS, HIDDEN = 4, 8


def _inputs(rank: int, rows: int, skew: bool):
    """Expert-ordered rows and their per-expert counts (device), different on every rank;
    ``skew`` sends most rows to EP rank 0's experts."""
    g = torch.Generator().manual_seed(10 + rank)
    weights = torch.tensor([8.0, 8.0, 1.0, 1.0]) if skew else torch.ones(EXPERTS)
    labels = torch.multinomial(weights, rows, replacement=True, generator=g).sort().values
    counts = torch.bincount(labels, minlength=EXPERTS)
    return torch.randn(rows, HIDDEN, generator=g), counts


def _dropless(group, rows, counts):
    x = rows.clone().requires_grad_()
    d = TokenDispatcher(EXPERTS, group)
    expert_rows, splits = d.dispatch(x, counts)
    out = d.combine(expert_rows * 2 + 1, splits)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape))
    return expert_rows.detach(), out.detach(), x.grad, splits


def _sync_free(group, rows, counts, factor):
    x = rows.clone().requires_grad_()
    d = RankCapacityDispatch(EXPERTS, lane_rows(rows.shape[0], factor, dist.get_world_size(group)),
                             group)
    with HostSyncs() as syncs:
        expert_rows, splits = d.dispatch(x, counts)
        out = d.combine(expert_rows * 2 + 1, splits)
        out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape))
    overflow = splits.overflow.to(torch.int32)
    dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)  # did any rank overflow
    return expert_rows.detach(), out.detach(), x.grad, splits, syncs.events, bool(overflow), d


def compare(rows: int, factor: float, skew: bool) -> dict:
    """The sync-free exchange beside the dropless one on this rank (gloo, the whole world)."""
    group = dist.group.WORLD
    x, counts = _inputs(dist.get_rank(), rows, skew)
    want_rows, want_out, want_grad, want = _dropless(group, x, counts)
    got_rows, got_out, got_grad, got, syncs, overflowed, d = _sync_free(group, x, counts, factor)
    n = want_rows.shape[0]
    return {
        "overflowed": overflowed,
        "syncs": [e.op for e in syncs],
        "buffer_rows": got_rows.shape[0],
        "fits": n <= got_rows.shape[0],
        "rows_equal": n <= got_rows.shape[0] and torch.equal(got_rows[:n], want_rows),
        "padding_zero": bool((got_rows[n:] == 0).all()),
        "offsets_equal": torch.equal(
            got.offsets, torch.cumsum(torch.tensor(want.tokens_per_local_expert), 0).int()),
        "out_equal": torch.equal(got_out, want_out),
        "grad_equal": torch.equal(got_grad, want_grad),
        "buffer_bytes": d.buffer_bytes(HIDDEN, torch.float32),
    }


def pretrain_step_syncs(argv: list[str]) -> dict:
    """A real pretrain step (after a warm-up step) under ``HostSyncs``: where each host sync
    was made, and whether the step ran again."""
    from megapipe.train.config.parse import parse_pretrain_args
    from megapipe.train.job import build_job
    from megapipe.train.step import train_step

    job = build_job(parse_pretrain_args(argv, env={}))
    try:
        train_step(job, job.batches.next_batch(), 1)
        with HostSyncs() as syncs:
            stats = train_step(job, job.batches.next_batch(), 2)
    finally:
        job.close()
    return {"syncs": sorted({(e.where, e.op, e.node is not None) for e in syncs.events}),
            "ran_again": stats.ran_again}
