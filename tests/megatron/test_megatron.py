"""get_forward_backward_func: Megatron's call, megapipe's executor, the reference's numbers."""

from __future__ import annotations

import pytest
import torch

from megapipe import get_forward_backward_func
from megapipe.schedule import ScheduleError
from megapipe.schedule.registry import default_schedule_name
from support.megatron_cases import megatron_run
from support.pipeline_cases import Case

CASES = [
    (Case("1f1b", 1), 2),
    (Case("1f1b", 2), 2),
    (Case("interleaved-1f1b", 2, vpp=2, ep=2, dp=2), 3),
    (Case("zbv", 2, vpp=2, overlap=True), 2),
]


def test_default_schedule_follows_pp_and_vpp():
    assert default_schedule_name(4, 2) == "interleaved-1f1b"
    assert default_schedule_name(4, 1) == "1f1b"
    assert default_schedule_name(1, 1) == "1f1b"  # pp=1: one stage, no pipelining
    assert get_forward_backward_func(pp=2, vpp=2).schedule_name == "interleaved-1f1b"
    assert get_forward_backward_func(pp=2, vpp=2, schedule="zbv").schedule_name == "zbv"
    with pytest.raises(ValueError, match="vpp=0"):
        get_forward_backward_func(pp=2, vpp=0)


def test_schedule_options_reach_the_schedule_and_unknown_ones_are_refused_at_once():
    func = get_forward_backward_func(pp=4, vpp=2, microbatch_group_size_per_vp_stage=3)
    with pytest.raises(ScheduleError, match="microbatch_group_size_per_vp_stage must be an "
                                           "integer >= pp=4, got 3"):
        func(forward_step_func=None, data_iterator=None, model=torch.nn.Linear(1, 1),
             num_microbatches=8, seq_length=4, micro_batch_size=1)
    with pytest.raises(TypeError, match="chunks"):
        get_forward_backward_func(pp=2, chunks=2)


@pytest.mark.parametrize("case,form", CASES, ids=lambda v: str(v))
def test_front_end_equals_reference(rank_pools, case, form):
    results = [r for r in rank_pools(8).run(megatron_run, case, form) if r is not None]
    ref_losses, ref_grads = results[0]["reference"]
    exact = form == 2 and case.dp == 1 and case.ep == 1
    last = [r for r in results if r["losses"]]
    assert sum(len(r["losses"]) for r in last) == case.dp * case.microbatches
    for r in last:
        want = ref_losses[r["dp_rank"] * case.microbatches : (r["dp_rank"] + 1) * case.microbatches]
        if exact:
            assert r["losses"] == want
        else:
            assert r["losses"] == pytest.approx(want, rel=1e-6)
    for r in results:
        for (stage, name), grad in r["grads"].items():
            want = ref_grads[name]
            if grad.shape != want.shape:  # this EP rank's experts: a slice of the reference's
                local = grad.shape[0]
                want = want[r["ep_rank"] * local : (r["ep_rank"] + 1) * local]
            if exact:
                assert torch.equal(grad, want), (case, stage, name)
            else:
                torch.testing.assert_close(
                    grad, want, rtol=1e-6, atol=1e-6 * want.abs().max().item()
                )


def test_forward_only_keeps_no_gradients(rank_pools):
    case = Case("interleaved-1f1b", 2, vpp=2)
    results = [r for r in rank_pools(8).run(megatron_run, case, 2, True) if r is not None]
    ref_losses, _ = results[0]["reference"]
    last = [r for r in results if r["losses"]]
    assert [x for r in last for x in r["losses"]] == ref_losses
    assert all(g is None for r in results for g in r["grads"].values())


def test_microbatch_count_the_schedule_cannot_take_is_named():
    from megapipe.models.config import GPTConfig
    from megapipe.models.split import build_stage
    from megapipe.schedule import ScheduleError

    chunks = [build_stage(GPTConfig(), j, 4) for j in (0, 2)]
    func = get_forward_backward_func(pp=2, vpp=2)
    with pytest.raises(ScheduleError, match="3"):
        func(forward_step_func=None, data_iterator=None, model=chunks, num_microbatches=3,
             seq_length=16, micro_batch_size=1)


def test_collect_non_loss_data_single_process():
    """pp=1 needs no process group; forward-only with collect_non_loss_data stores what
    loss_func(output, non_loss_data=True) returns, one entry per microbatch, in order."""
    from megapipe.models.config import GPTConfig
    from megapipe.models.split import build_stage

    config = GPTConfig(num_layers=2)
    model = build_stage(config, 0, 1)

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)

        def loss_func(output, non_loss_data=False):
            return output.argmax(-1) if non_loss_data else (output.sum(), {})

        return chunk(tokens), loss_func

    tokens = [torch.randint(0, config.vocab_size, (1, 8)) for _ in range(3)]
    data = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(tokens), model=[model],
        num_microbatches=3, seq_length=8, micro_batch_size=1, forward_only=True,
        collect_non_loss_data=True,
    )
    assert [d.shape for d in data] == [(1, 8)] * 3
    with torch.no_grad():
        assert torch.equal(data[1], model(tokens[1]).argmax(-1))
    assert all(p.grad is None for p in model.parameters())


def test_each_call_hands_back_the_aux_losses_and_empties_the_logs(monkeypatch):
    """A Megatron-style loop never pops megapipe's auxiliary-loss logs: the front end takes them
    after each call, so they do not grow, summing nothing; ``aux_losses()`` gives each MoE
    layer's mean over the last call's forwards (the values the layer recorded, read
    independently here)."""
    from megapipe.models.config import GPTConfig
    from megapipe.models.gpt import gpt_loss
    from megapipe.models.split import build_stage
    from megapipe.moe.aux_loss import AuxLossLog

    recorded = []
    real_record = AuxLossLog.record

    def record(log, value):
        recorded.append(value.value() if hasattr(value, "value") else value.detach())
        real_record(log, value)

    monkeypatch.setattr(AuxLossLog, "record", record)
    config = GPTConfig(num_layers=3)  # layer 0 dense, layers 1 and 2 MoE
    model = build_stage(config, 0, 1)
    layers = list(model.moe_layers())
    assert len(layers) == 2

    def forward_step(data_iterator, chunk):
        tokens, labels = next(data_iterator)
        return chunk(tokens), lambda output: (gpt_loss(output, labels), {})

    func = get_forward_backward_func()
    for call in range(2):
        recorded.clear()
        g = torch.Generator().manual_seed(call)
        ids = [torch.randint(0, config.vocab_size, (1, 9), generator=g) for _ in range(3)]
        batches = iter([(t[:, :-1], t[:, 1:]) for t in ids])
        func(forward_step_func=forward_step, data_iterator=batches, model=model,
             num_microbatches=3, seq_length=8, micro_batch_size=1)
        assert all(len(layer.aux_loss_log) == 0 for layer in layers)
        assert len(recorded) == 6  # 3 microbatches x 2 layers, in forward order
        expected = [torch.stack(recorded[i::2]).mean() for i in range(2)]
        got = func.aux_losses()
        assert len(got) == 2
        for mean, want in zip(got, expected):
            assert torch.equal(mean, want)


def test_overlap_auto_keeps_the_faster_mode_with_the_fixed_modes_numbers(rank_pools):
    from support.auto_cases import auto_calls

    case = Case("interleaved-1f1b", 2, vpp=2)
    pool = rank_pools(8)
    fixed = pool.run(auto_calls, case, False, 7)
    # rank 1 alone would keep combined; the slowest rank's times decide for both: plain
    seconds = [{False: 1.0, True: 1.5}, {False: 0.8, True: 0.5}] + [None] * 6
    auto = pool.run(auto_calls, case, "auto", 7, seconds)
    for a, f in zip(auto[:2], fixed[:2]):
        assert a["losses"] == f["losses"]
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], f["weights"]))
        assert a["lines"] == ["overlap auto: off (combined 1.5 s vs plain 1 s per step, "
                              "slowest rank, steps 1-6; no further check)"]
    with pytest.raises(ValueError, match="'auto' with delay_wgrad_compute=True"):
        get_forward_backward_func(pp=2, overlap_moe_expert_parallel_comm="auto",
                                  delay_wgrad_compute=True)
    with pytest.raises(ValueError, match="overlap_moe_expert_parallel_comm='yes' must be"):
        get_forward_backward_func(pp=2, overlap_moe_expert_parallel_comm="yes")
