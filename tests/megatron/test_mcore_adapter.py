"""Megatron-Core's own MoE GPT through megapipe: Megatron's numbers, release by release.

Each case runs on 4 gloo ranks (one pool per megatron-core release, its processes importing
that release): Megatron's own ``get_forward_backward_func`` (no overlap; its DDP and
``finalize_model_grads``) as the reference, then megapipe's front end on freshly built chunks
with the same weights and data, plain and with ``overlap_moe_expert_parallel_comm=True``.
Auxiliary loss on (coefficient 0.01), fp32; the bf16 cases compare with Megatron's own
combined 1F1B. The newest release runs every case; an older one runs, for each difference
between it and the newest (the table in ``megapipe/megatron/mcore_release.py``), the first case
that reaches it (``support.mcore_differences``: derived from the table, not chosen by hand).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core",
    reason="megatron-core is not installed (pip install 'megapipe[megatron]'; scripts/setup.sh "
    "installs it)",
)

from support import mcore_cases, mcore_checks  # noqa: E402
from support.mcore_differences import REACHES, cases_on, row_key, table  # noqa: E402
from support.mcore_models import McoreCase  # noqa: E402
from support.mcore_releases import RELEASES, ReleaseUnavailable, release_dir  # noqa: E402
from support.rank_pool import run_with_room  # noqa: E402

# (case, the releases it needs: None for any); grouped by layout (tp, pp, ep), since a new
# layout makes Megatron's process groups again. The newest release runs them all; an older one
# the first that reaches each of its differences from the newest (module docstring), so a case
# that should run on older releases comes first among those reaching the same difference.
CASES = [
    (McoreCase(pp=1, ep=1), None),
    (McoreCase(pp=1, ep=2, shared_expert=True, reduce="ddp"), None),
    # Megatron's deferred weight gradients (TE's contract), driven after each node's backward
    (McoreCase(pp=1, ep=2, delay_wgrad=True, mtp=1), None),
    # a pre-MLP norm returning (output, residual), as the fused residual RMSNorm does (0.17+)
    (McoreCase(pp=1, ep=2, fused_norm=True), ("0.17", "0.18", "0.19")),
    (McoreCase(pp=2, ep=1, tie=True), None),
    (McoreCase(pp=2, vpp=2, ep=1, tie=True, reduce="ddp"), None),
    (McoreCase(pp=2, ep=2), None),  # megapipe's combined 1F1B: Megatron has none without vpp
    (McoreCase(pp=2, vpp=2, ep=2), None),
    (McoreCase(pp=2, vpp=2, ep=2, schedule="zb1p"), None),
    (McoreCase(pp=2, vpp=2, ep=2, schedule="zbv"), None),
    (McoreCase(pp=2, vpp=2, ep=2, schedule="dualpipev", shared_expert=True), None),
    # full recompute node by node; the expert-bias update after megapipe's own reduction
    (McoreCase(pp=2, vpp=2, ep=2, expert_bias=True, recompute="full"), None),
    # 0.19's quantile balancing: its bias updated after megapipe's reduction too, its counts
    # not doubled by full recompute's re-runs
    (McoreCase(pp=2, vpp=2, ep=2, balancing="quantile_balancing", recompute="full"), ("0.19",)),
    # deferred weight gradients in the zero-bubble W action and beside the all-to-all
    (McoreCase(pp=2, vpp=2, ep=2, delay_wgrad=True, shared_expert=True, schedule="zb1p"), None),
    # tensor + sequence parallelism, MTP, selective recompute, shared experts, expert bias
    (McoreCase(pp=1, ep=2, tp=2, reduce="ddp", shared_expert=True, expert_bias=True, mtp=1,
               recompute="selective"), None),
    (McoreCase(pp=2, vpp=2, ep=2, tp=2, reduce="ddp", mtp=1), None),
    (McoreCase(pp=2, vpp=2, ep=2, tp=2, reduce="ddp", mtp=1, recompute="full"), None),
    # tensor + sequence parallelism in the other schedules that overlap
    (McoreCase(pp=2, ep=2, tp=2, reduce="ddp"), None),
    (McoreCase(pp=2, vpp=2, ep=2, tp=2, reduce="ddp", recompute="selective", shared_expert=True,
               schedule="zb1p"), None),
    (McoreCase(pp=2, vpp=2, ep=2, tp=2, reduce="ddp", recompute="full",
               recompute_method="block", schedule="zbv"), None),
    (McoreCase(pp=2, vpp=2, ep=2, tp=2, reduce="ddp", shared_expert=True,
               schedule="dualpipev"), None),
]

# bf16 as a Megatron script runs it: Megatron's DDP reduces (reduce="ddp") in both runs
BF16_CASES = [
    (McoreCase(pp=1, ep=2, shared_expert=True, reduce="ddp"), None),  # its combined 1F1B at pp 1
    (McoreCase(pp=2, vpp=2, ep=2, reduce="ddp"), None),  # and its interleaved combined 1F1B
    (McoreCase(pp=1, ep=2, tp=2, reduce="ddp", shared_expert=True, expert_bias=True, mtp=1,
               recompute="selective"), None),
    (McoreCase(pp=2, vpp=2, ep=2, tp=2, reduce="ddp", mtp=1), None),
]

# Megatron's split, paired as in its combined 1F1B: (comm stream node, compute stream node)
FOUR_PAIRS = [
    (("B", "combine"), ("F", "attn")),
    (("F", "dispatch"), ("B", "mlp")),
    (("B", "dispatch"), ("F", "mlp")),
    (("F", "combine"), ("B", "attn")),
]

_RESULTS: dict = {}


def takes_part(item) -> bool:
    """Whether a collected test runs on its release (module docstring; the negative control
    runs on the newest only). ``tests/megatron/conftest.py`` deselects the others at collection,
    so no combination is generated only to be skipped."""
    params = item.callspec.params
    version = params["release"]
    if "case" not in params:
        return (version == RELEASES[-1] or item.originalname
                != "test_undriven_deferred_weight_gradients_are_missing_under_megatrons_schedule")
    cases = BF16_CASES if "bf16" in item.originalname else CASES
    return params["case"] in cases_on(version, RELEASES[-1], cases)


def test_every_difference_between_releases_names_the_cases_that_reach_it():
    """Each row of mcore_release's table is named in ``mcore_differences.REACHES``, and some
    case reaches it on the newest release (a row no case reaches would run nowhere)."""
    rows = table()
    assert len(rows) >= 10 and all(len(answers) == 4 for answers in rows.values()), rows
    newest = cases_on(RELEASES[-1], RELEASES[-1], CASES)
    for where in rows:
        reaches = row_key(where)  # raises unless exactly one key names the row
        assert any(REACHES[reaches](case) for case in newest), where


@pytest.fixture(scope="module", params=RELEASES)
def release(request, rank_pools):
    """One megatron-core release: its pool of 4 processes, which import it. Cached releases
    are fetched once (tests/support/mcore_releases.py); without a network they skip."""
    version = request.param
    try:
        directory = release_dir(version)
    except ReleaseUnavailable as missing:
        pytest.skip(str(missing))
    spec = (version, str(directory) if directory is not None else None)
    # the installed release runs in the shared pool of 4 (its processes import it anyway), a
    # fetched one in a pool of its own, ended after its tests. Megatron 0.19 compiles its
    # expert-bias update with torch.compile (about 25 s on CPU per process) unless dynamo is
    # off, so it always gets a pool with that set; its __version__ asks git for a hash unless
    # told not to
    shared = directory is None and not version.startswith("0.19")
    tag = None if shared else f"megatron-core-{version}"
    pool = rank_pools(4, tag, env={"TORCHDYNAMO_DISABLE": "1", "NO_VCS_VERSION": "1"})
    run_with_room(pool, mcore_cases.warm_up, spec)
    yield spec, pool
    if tag is not None:
        rank_pools.close(4, tag)
    for key in [k for k in _RESULTS if k[0] == version]:
        del _RESULTS[key]


def _result(release, case: McoreCase, kind: str = "fp32") -> list:
    spec, pool = release
    key = (spec[0], case, kind)
    if key not in _RESULTS:
        fn = mcore_cases.compare_case if kind == "fp32" else mcore_cases.bf16_combined_case
        _RESULTS[key] = run_with_room(pool, fn, spec, case)
    return _RESULTS[key]


def _assert_grads(got: dict, want: dict, exact: bool, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want))[:8])
    for name, ref in want.items():
        if exact:
            assert torch.equal(got[name], ref), (what, name)
        else:
            scale = ref.abs().max().item()
            torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=1e-6 * scale,
                                       msg=lambda m, name=name: f"{what} {name}: {m}")


def _tensors(arrays: dict) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(value) for name, value in arrays.items()}


def _merged(outs: list[dict], run: str, key: str = "grads") -> tuple[dict, dict]:
    """A run's losses per DP rank and tensors per global name, over all ranks; replicas of a
    tensor must agree bitwise."""
    losses, tensors = {}, {}
    for out in outs:
        if out[run]["losses"]:
            losses[out[run]["dp_rank"]] = out[run]["losses"]
        for name, value in _tensors(out[run][key]).items():
            if name in tensors:
                assert torch.equal(tensors[name], value), (run, "replicas differ", name)
            tensors[name] = value
    return losses, tensors


def _weight_used_twice(case: McoreCase) -> bool:
    """A chunk that uses one weight twice (tied embeddings, or MTP's embedding in the chunk
    that embeds the tokens) accumulates per use on the tape and per step in plain autograd."""
    return case.tie or (case.mtp > 0 and case.pp == 1)


@pytest.mark.parametrize("case,needs", CASES, ids=[str(c[0]) for c in CASES])
def test_megapipe_gives_megatrons_numbers(release, case, needs):
    """Losses bitwise (the forward performs Megatron's operations); every gradient within 1e-6
    relative, bitwise where the reduction is Megatron's own (its DDP); every weight has its
    gradient (also with deferred weight gradients: nothing is left pending); the expert biases
    after the step are Megatron's (and moved). The zbv and dualpipev cases place the model in
    a V, so they compare the model's gradients over all ranks."""
    outs = _result(release, case)
    exact = case.reduce == "ddp" and not _weight_used_twice(case)
    ref_losses, ref_grads = _merged(outs, "reference")
    assert len(ref_losses) == case.dp and len(ref_grads) > 20
    for run in ("plain", "overlap"):
        losses, grads = _merged(outs, run)
        assert losses == ref_losses, run
        _assert_grads(grads, ref_grads, exact and run == "plain", run)
        assert all(out[run]["pending_wgrads"] == 0 for out in outs)
        if case.expert_bias or case.balancing != "aux_loss":
            _, ref_bias = _merged(outs, "reference", "expert_bias")
            _, bias = _merged(outs, run, "expert_bias")
            assert ref_bias and all(b.abs().max() > 0 for b in ref_bias.values())
            _assert_grads(bias, ref_bias, exact=True, what=f"{run} expert bias")
    if case.v_placement:
        return
    for rank, out in enumerate(outs):  # same placement: rank by rank
        _assert_grads(_tensors(out["plain"]["grads"]), _tensors(out["reference"]["grads"]),
                      exact, f"rank {rank}")


@pytest.mark.parametrize("case,needs", CASES, ids=[str(c[0]) for c in CASES])
def test_combined_is_bitwise_the_plain_run(release, case, needs):
    for rank, out in enumerate(_result(release, case)):
        plain, overlap = _tensors(out["plain"]["grads"]), _tensors(out["overlap"]["grads"])
        _assert_grads(overlap, plain, exact=not _weight_used_twice(case),
                      what=f"rank {rank} overlap")


@pytest.mark.parametrize("case,needs", CASES, ids=[str(c[0]) for c in CASES])
def test_trace_shows_the_four_pairs_in_every_paired_moe_layer(release, case, needs):
    """Every rank that pairs MoE layers pairs them in Megatron's four pairs (a rank can have
    none: in dualpipev, rank 0 holds the dense first layer and the MoE last one, and pairs each
    one's forward with the other's backward)."""
    outs = _result(release, case)
    assert any(out["overlap"]["pairs"] for out in outs), "no paired slots"
    for rank, out in enumerate(outs):
        pairs = out["overlap"]["pairs"]
        assert len(pairs) % 4 == 0, (rank, pairs)
        for start in range(0, len(pairs), 4):
            assert list(pairs[start:start + 4]) == FOUR_PAIRS, (rank, start, pairs)


_COMBINED_DEFERRED = [c for c in CASES if c[0].delay_wgrad and c[0].schedule is None]


@pytest.mark.parametrize("case,needs", _COMBINED_DEFERRED,
                         ids=[str(c[0]) for c in _COMBINED_DEFERRED])
def test_backward_dw_runs_where_megapipe_puts_its_deferred_weight_gradients(
        release, case, needs):
    """Megatron's backward_dw() calls run as megapipe's W items (Megatron's local layers give
    the queue nothing else): beside a backward dispatch in the combined step, as the trace
    shows. (In zb1p they stay queued for the W action, which the trace of the pairs does not
    show; that case checks that none is left pending and every gradient is Megatron's.)"""
    outs = _result(release, case)
    assert all(out["overlap"]["wgrads"] for out in outs)
    assert any(out["overlap"]["wgrad_beside_dispatch"] for out in outs)


@pytest.mark.parametrize("case,needs", BF16_CASES, ids=[str(c[0]) for c in BF16_CASES])
def test_bf16_combined_step_is_bitwise_megatrons_combined_1f1b(release, case, needs):
    """bf16 as a Megatron script sets it up (config.bf16, Float16Module, DDP with fp32 gradient
    buffers, finalize_model_grads): megapipe's combined step gives bitwise the losses and
    gradients of Megatron's own overlapped schedule (overlap_moe_expert_parallel_comm), with
    tensor and sequence parallelism, MTP and selective recompute where Megatron overlaps them."""
    outs = _result(release, case, "bf16")
    ref_losses, ref_grads = _merged(outs, "reference")
    losses, grads = _merged(outs, "overlap")
    assert len(ref_losses) == case.dp and losses == ref_losses
    _assert_grads(grads, ref_grads, exact=True, what="bf16 overlap")
    if case.expert_bias:
        _assert_grads(_merged(outs, "overlap", "expert_bias")[1],
                      _merged(outs, "reference", "expert_bias")[1], exact=True, what="bias")


def test_undriven_deferred_weight_gradients_are_missing_under_megatrons_schedule(release):
    """The negative control of the deferred-weight-gradient cases: Megatron's own schedule
    without its overlap never calls backward_dw(), so the TE-contract layers end the step with
    no gradient and their work still pending; under megapipe nothing is pending (above)."""
    spec, pool = release
    case = McoreCase(pp=1, ep=2, delay_wgrad=True)
    outs = run_with_room(pool, mcore_cases.undriven_case, spec, case)
    assert all(out["pending_wgrads"] > 0 for out in outs)
    grads = outs[0]["grads"]
    assert not any("linear_qkv" in name for name in grads), "the deferred ones got no gradient"


def test_refusals_name_what_is_not_mirrored(release):
    """Each setting the adapter does not mirror is refused in one line naming it, before any
    collective; every config field of the release is classified or at its default."""
    spec, pool = release
    for checks in run_with_room(pool, mcore_checks.refusal_checks, spec):  # every rank
        for name, (message, expected) in checks.items():
            if expected is None:
                assert message is None, (name, message)
            else:
                assert message is not None and expected in message, (name, message)
                assert "\n" not in message, (name, message)
