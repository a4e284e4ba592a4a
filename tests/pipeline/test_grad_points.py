"""Where a step's gradients become final (``pipeline.grad_points``), and the executor's calls."""

import pytest
import torch

from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.pipeline.grad_points import GradPoints
from megapipe.schedule import Kind, build_schedule
from megapipe.schedule.rank_views import checked_lowering

SCHEDULES = [
    ("1f1b", 1, {}), ("1f1b", 2, {}), ("interleaved-1f1b", 2, {"vpp": 2}),
    ("interleaved-1f1b", 2, {"vpp": 2, "overlap": True}), ("zb1p", 2, {}), ("zbv", 2, {}),
    ("dualpipev", 2, {"overlap": True}), ("gpipe", 2, {}), ("looped-bfs", 2, {"vpp": 2}),
]


@pytest.mark.parametrize("name,pp,options", SCHEDULES, ids=lambda v: str(v))
def test_points_are_each_stages_first_forward_last_backward_and_last_gradient(name, pp, options):
    schedule = checked_lowering(build_schedule(name, pp, 4, **options))
    for rank, actions in enumerate(schedule.actions):
        points = GradPoints.of(actions)
        comps = [(i, c) for i, a in enumerate(actions) if a.is_compute for c in a.computations()]
        for stage in schedule.stages_of_rank(rank):
            mine = [(i, c.kind) for i, c in comps if c.stage == stage]
            first_f = min(i for i, k in mine if k is Kind.F)
            last_b = max(i for i, k in mine if k in (Kind.B, Kind.I))
            final = max(i for i, k in mine if k in (Kind.B, Kind.I, Kind.W))
            assert stage in points.first_forward[first_f]
            assert stage in points.last_backward[last_b]
            assert stage in points.grads_final[final]
            assert final >= last_b
        firsts = [min(i for i, c in comps if c.stage == s and c.kind is Kind.F)
                  for s in points.forward_stages]
        assert firsts == sorted(firsts)
        assert sorted(points.forward_stages) == sorted(schedule.stages_of_rank(rank))


def test_dualpipe_stages_become_final_only_after_the_mirrored_sum():
    schedule = checked_lowering(build_schedule("dualpipe", 2, 4))
    points = GradPoints.of(schedule.actions[0], bidirectional=True)
    assert not points.last_backward and not points.grads_final
    assert sorted(points.at_end) == schedule.stages_of_rank(0)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def test_the_executor_calls_the_hooks_in_order_and_refuses_a_double_reduction():
    torch.manual_seed(0)
    schedule = build_schedule("1f1b", 1, 3)
    stage = torch.nn.Linear(4, 4)
    loss = lambda out, target: (out - target).square().mean()  # noqa: E731
    data = [torch.randn(2, 4) for _ in range(3)]
    hooks = _Recorder()
    options = ExecutorOptions(loss_fn=loss, grad_reduction="none")
    with PipelineExecutor(schedule, {0: stage}, options) as ex:
        ex.step(data, data, grad_hooks=hooks)
        assert hooks.calls == [
            ("step_started", (0,)), ("before_first_forward", 0),
            ("before_last_backward", 0), ("after_last_backward", 0),
            ("stage_grads_final", 0), ("step_finished",),
        ]
        hooks.calls.clear()
        ex.step(data, data, forward_only=True, grad_hooks=hooks)
        assert hooks.calls == []  # forward-only steps tell it nothing
    with PipelineExecutor(schedule, {0: stage}, ExecutorOptions(loss_fn=loss)) as ex:
        with pytest.raises(ValueError, match="grad_reduction='dp' would reduce them again"):
            ex.step(data, data, grad_hooks=hooks)
