"""Forward-only evaluation, the timeout error and the checks made before a step runs."""

from __future__ import annotations

import pytest

from support.pipeline_cases import Case, forward_only_run, misuse_errors, timeout_run

EVAL_CASES = [
    Case("1f1b", 2),
    Case("interleaved-1f1b", 2, vpp=2, ep=2, dp=2),
    Case("zbv", 2, vpp=2),
    Case("dualpipe", 2, vpp=2, overlap=True),
]


@pytest.mark.parametrize("case", EVAL_CASES, ids=str)
def test_forward_only_returns_training_losses_and_keeps_no_graph(rank_pools, case):
    results = [r for r in rank_pools(8).run(forward_only_run, case) if r is not None]
    assert sum(len(r["eval"]) for r in results) == case.dp * case.microbatches
    for r in results:
        assert r["eval"] == r["train"]
        assert not r["eval_requires_grad"]
        assert r["eval_peak"] == 0 < r["train_peak"]
        assert r["grads_untouched_by_eval"]


def test_timeout_names_rank_action_and_peer(rank_pools):
    messages = rank_pools(8).run(timeout_run, 1.0)
    message = messages[1]
    assert message is not None, "rank 1 should have timed out waiting for rank 0"
    assert "rank 1:" in message
    assert "1RECV_F0" in message and "receive from rank 0" in message
    assert "within 1s" in message


def test_misuse_is_named_before_anything_runs(rank_pools):
    errors = rank_pools(8).run(misuse_errors)
    for pp_rank in (0, 1):
        e = errors[pp_rank]
        assert "places 2 chunk(s) on this rank" in e["chunks"] and "got 1" in e["chunks"]
        assert "do not match the placement" in e["placement"]
        assert "got 3 " in e["microbatches"]
        assert "num_microbatches=4" in e["microbatches"]
    assert "does not match the declared TensorSpec" in errors[0]["spec"]


def test_broken_schedule_is_named_before_anything_runs():
    """A hand-written schedule that runs a backward before its forward fails at construction."""
    from torch import nn

    from megapipe import ExecutorOptions, PipelineExecutor
    from megapipe.schedule import Action, Kind, Schedule, ScheduleError

    actions = (
        (Action(0, Kind.F, 0), Action(0, Kind.B, 1), Action(0, Kind.F, 1), Action(0, Kind.B, 0)),
    )
    broken = Schedule(actions, num_stages=1, num_microbatches=2, stage_to_rank=(0,), name="mine")
    with pytest.raises(ScheduleError, match="rank 0"):
        PipelineExecutor(broken, {0: nn.Linear(2, 2)},
                         ExecutorOptions(loss_fn=lambda out, target: out.sum()))


def test_a_chunk_with_layer_plans_but_not_the_whole_protocol_is_refused_naming_what_it_lacks():
    """The earlier contract (layer_plans() and an aux_loss_scale attribute the executor set)
    would now run as a plain module with num_microbatches times larger auxiliary-loss
    gradients: refused at construction instead, naming the missing members."""
    import torch
    from torch import nn

    from megapipe import ExecutorOptions, PipelineExecutor
    from megapipe.overlap.plan import Node, NodeKind
    from megapipe.schedule import build_schedule

    class EarlierChunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.aux_loss_scale = 1.0  # what the earlier README said the executor sets

        def layer_plans(self):
            return [[Node("linear", NodeKind.COMPUTE, lambda state, t: (self.linear(t[0]),))]]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x)

    for overlap in (False, True):
        with pytest.raises(TypeError) as caught:
            PipelineExecutor(build_schedule("1f1b", 1, 2, overlap=overlap), {0: EarlierChunk()},
                             ExecutorOptions(loss_fn=lambda out, target: out.sum()))
        message = str(caught.value)
        assert "stage 0: EarlierChunk has layer_plans() but is not a whole StageModule" in message
        assert "it lacks node_runner, set_input_tensor, set_aux_loss_scale" in message


def test_the_options_are_one_frozen_record_refused_when_made():
    """``ExecutorOptions`` refuses a value no schedule can use when it is made (one line naming
    the value), cannot be changed afterwards, and its defaults run a plain schedule."""
    import dataclasses

    import torch
    from torch import nn

    from megapipe import ExecutorOptions, PipelineExecutor
    from megapipe.schedule import build_schedule

    for bad, words in ((dict(grad_reduction="ddp"), "grad_reduction='ddp' must be one of dp"),
                       (dict(timeout=0.0), "timeout=0.0 must be a positive number")):
        with pytest.raises(ValueError) as caught:
            ExecutorOptions(**bad)
        assert words in str(caught.value) and "\n" not in str(caught.value)
    options = ExecutorOptions(loss_fn=lambda out, target: out.sum())
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.timeout = 1.0  # type: ignore[misc]  # the assignment that must fail
    with PipelineExecutor(build_schedule("1f1b", 1, 2), {0: nn.Linear(2, 2)}) as executor:
        assert executor.options == ExecutorOptions()
        result = executor.step([torch.ones(1, 2)] * 2, forward_only=True)
    assert sorted(result.outputs) == [0, 1]
