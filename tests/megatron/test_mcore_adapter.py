"""Megatron-Core's own MoE GPT through megapipe: Megatron's numbers, in every schedule, overlapped.

Each case runs on 4 gloo ranks (one shared pool): Megatron's own ``get_forward_backward_func``
(no overlap; its DDP and ``finalize_model_grads``) as the reference, then megapipe's front end
on freshly built chunks with the same weights and data, plain and with
``overlap_moe_expert_parallel_comm=True``. Auxiliary loss on (coefficient 0.01), fp32.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core",
    reason="megatron-core is not installed (pip install 'megapipe[megatron]'; scripts/setup.sh "
    "installs it)",
)

from support.mcore_cases import (  # noqa: E402
    McoreCase,
    bf16_combined_case,
    compare_case,
    warm_up,
)

CASES = [
    McoreCase(pp=1, ep=1),
    McoreCase(pp=1, ep=2, shared_expert=True, reduce="ddp"),
    McoreCase(pp=2, ep=2),  # megapipe's combined 1F1B: Megatron has none without vpp
    McoreCase(pp=2, ep=1, tie=True),
    McoreCase(pp=2, vpp=2, ep=2),
    McoreCase(pp=2, vpp=2, ep=1, tie=True, reduce="ddp"),
    McoreCase(pp=2, vpp=2, ep=2, schedule="zb1p"),
    McoreCase(pp=2, vpp=2, ep=2, schedule="zbv"),
    McoreCase(pp=2, vpp=2, ep=2, schedule="dualpipev", shared_expert=True),
]

# Megatron's split, paired as in its combined 1F1B: (comm stream node, compute stream node)
FOUR_PAIRS = [
    (("B", "combine"), ("F", "attn")),
    (("F", "dispatch"), ("B", "mlp")),
    (("B", "dispatch"), ("F", "mlp")),
    (("F", "combine"), ("B", "attn")),
]


def _run_on_pool(pool, fn, *args):
    """``pool.run`` with room for a busy machine: one case runs Megatron and megapipe three
    times on 4 processes (seconds alone, minutes when other jobs share the 2 cores)."""
    limit, pool.timeout = pool.timeout, max(pool.timeout, 600.0)
    try:
        return pool.run(fn, *args)
    finally:
        pool.timeout = limit


@pytest.fixture(scope="module")
def results(rank_pools):
    pool = rank_pools(4)
    _run_on_pool(pool, warm_up)
    return {case: _run_on_pool(pool, compare_case, case) for case in CASES}


def _assert_grads(got: dict, want: dict, exact: bool, what: str) -> None:
    assert got.keys() == want.keys(), (what, set(got) ^ set(want))
    for name, ref in want.items():
        if exact:
            assert torch.equal(got[name], ref), (what, name)
        else:
            scale = ref.abs().max().item()
            torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=1e-6 * scale,
                                       msg=lambda m: f"{what} {name}: {m}")


def _merged(outs: list[dict], run: str) -> tuple[dict, dict]:
    """A run's losses per DP rank and gradients per global parameter name, over all ranks;
    data-parallel replicas of a gradient must agree bitwise."""
    losses, grads = {}, {}
    for out in outs:
        if out[run]["losses"]:
            losses[out[run]["dp_rank"]] = out[run]["losses"]
        for name, grad in out[run]["grads"].items():
            if name in grads:
                assert torch.equal(grads[name], grad), (run, "replicas differ", name)
            grads[name] = grad
    return losses, grads


@pytest.mark.parametrize("case", CASES, ids=str)
def test_megapipe_gives_megatrons_numbers(results, case):
    """Losses bitwise (the forward performs Megatron's operations); every gradient within 1e-6
    relative, bitwise where the reduction is Megatron's own (its DDP). The zbv and dualpipev
    cases place the model in a V, so they compare the model's gradients over all ranks."""
    exact = case.reduce == "ddp" and not case.tie
    ref_losses, ref_grads = _merged(results[case], "reference")
    assert len(ref_losses) == case.dp and len(ref_grads) > 20
    for run in ("plain", "overlap"):
        losses, grads = _merged(results[case], run)
        assert losses == ref_losses, run
        _assert_grads(grads, ref_grads, exact and run == "plain", run)
    if case.v_placement:
        return
    for rank, out in enumerate(results[case]):  # same placement: rank by rank
        _assert_grads(out["plain"]["grads"], out["reference"]["grads"], exact, f"rank {rank}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_combined_is_bitwise_the_plain_run(results, case):
    for rank, out in enumerate(results[case]):
        plain, overlap = out["plain"]["grads"], out["overlap"]["grads"]
        _assert_grads(overlap, plain, exact=not case.tie, what=f"rank {rank} overlap")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_trace_shows_the_four_pairs_in_every_paired_moe_layer(results, case):
    for rank, out in enumerate(results[case]):
        pairs = out["overlap"]["pairs"]
        assert pairs, f"rank {rank}: no paired slots"
        assert len(pairs) % 4 == 0, (rank, pairs)
        for start in range(0, len(pairs), 4):
            assert list(pairs[start:start + 4]) == FOUR_PAIRS, (rank, start, pairs)


BF16_CASES = [
    McoreCase(pp=1, ep=2, shared_expert=True),  # Megatron's combined 1F1B without pipelining
    McoreCase(pp=2, vpp=2, ep=2),  # and its interleaved combined 1F1B
]


@pytest.mark.parametrize("case", BF16_CASES, ids=str)
def test_bf16_combined_step_is_bitwise_megatrons_combined_1f1b(rank_pools, case):
    """bf16 as a Megatron script sets it up (config.bf16, Float16Module, DDP with fp32 gradient
    buffers, finalize_model_grads): megapipe's combined step gives bitwise the losses and
    gradients of Megatron's own overlapped schedule (overlap_moe_expert_parallel_comm)."""
    outs = _run_on_pool(rank_pools(4), bf16_combined_case, case)
    ref_losses, ref_grads = _merged(outs, "reference")
    losses, grads = _merged(outs, "overlap")
    assert len(ref_losses) == case.dp and losses == ref_losses
    _assert_grads(grads, ref_grads, exact=True, what="bf16 overlap")


def _config(**overrides):
    from types import SimpleNamespace

    fields = dict(
        tensor_model_parallel_size=1, sequence_parallel=False, context_parallel_size=1,
        expert_tensor_parallel_size=1, mtp_num_layers=None, fp8=None, fp4=None,
        cuda_graph_impl="none", recompute_granularity=None, cpu_offloading=False,
        fine_grained_activation_offloading=False, moe_shared_expert_overlap=False,
        num_moe_experts=4, moe_token_dispatcher_type="alltoall", fp16=False,
        calculate_per_token_loss=False,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("override,named", [
    ({"tensor_model_parallel_size": 2}, "tensor parallelism"),
    ({"sequence_parallel": True}, "sequence parallelism"),
    ({"moe_token_dispatcher_type": "flex"}, "flex/DeepEP"),
    ({"mtp_num_layers": 1}, "MTP"),
    ({"fp8": "hybrid"}, "FP8"),
    ({"cuda_graph_impl": "local"}, "CUDA graphs"),
    ({"recompute_granularity": "full"}, "recomputation"),
    ({"fp16": True}, "loss scaling"),
    ({"calculate_per_token_loss": True}, "calculate_per_token_loss"),
])
def test_unsupported_features_are_named(override, named):
    from megapipe.megatron.mcore_support import check_supported

    check_supported(_config())  # the tests' configuration passes
    with pytest.raises(NotImplementedError, match=named):
        check_supported(_config(**override))


def test_an_unsupported_megatron_version_is_one_clear_error(monkeypatch):
    import megatron.core

    from megapipe.megatron.mcore_support import check_mcore_version

    assert check_mcore_version() == "0.16.1"
    monkeypatch.setattr(megatron.core, "__version__", "0.15.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.15\.0 is not supported.*0\.16\.1"):
        check_mcore_version()


def test_other_modules_pass_through_unwrapped():
    from megapipe.megatron.mcore_adapter import as_stage_module
    from megapipe.megatron.mcore_support import find_gpt_model

    module = torch.nn.Linear(2, 2)
    assert as_stage_module(module) is module and find_gpt_model(module) is None


def test_megatron_ddp_is_refused_where_it_would_reduce_wrongly():
    from types import SimpleNamespace

    from megapipe.megatron.mcore_support import check_ddp

    class DistributedDataParallel(torch.nn.Module):  # stands for Megatron's (same module path)
        __module__ = "megatron.core.distributed.distributed_data_parallel"

        def __init__(self, overlap_grad_reduce):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.ddp_config = SimpleNamespace(overlap_grad_reduce=overlap_grad_reduce)

        def finish_grad_sync(self):
            pass

    check_ddp(torch.nn.Linear(2, 2), reduce_grads=True)  # no DDP: nothing to refuse
    check_ddp(DistributedDataParallel(False), reduce_grads=False)
    with pytest.raises(ValueError, match="reduce_grads=False"):
        check_ddp(DistributedDataParallel(False), reduce_grads=True)
    check_ddp(DistributedDataParallel(True), reduce_grads=False)  # its hooks run (ddp_hooks)
