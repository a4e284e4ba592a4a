"""No reference cycles on the hot path (issue 41): after a step, the cyclic garbage collector
finds no megapipe object and no tensor, so everything a step made is freed by reference
counting the moment it is last used, never at a collection thousands of steps later.

One process, pp = 1 (the pipelined pretrain step is in ``tests/train/test_long_runs.py``):
the combined step (with the node trace, with deferred weight gradients, with I/W halves), the
tape path, and the Megatron front end.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megapipe import get_forward_backward_func
from megapipe.models import GPTConfig, build_stage
from megapipe.models.gpt import gpt_loss
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.schedule import build_schedule
from support.cyclic_garbage import cyclic_garbage

CONFIG = GPTConfig(hidden_size=16, num_layers=2, num_heads=2, seq_length=8, ffn_hidden_size=32,
                   num_experts=2, moe_top_k=1, moe_ffn_hidden_size=16, first_k_dense_layers=1)
MICROBATCHES = 4


def _batches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ids = torch.randint(0, 256, (MICROBATCHES, 1, 9), generator=torch.Generator().manual_seed(0))
    return [i[:, :-1] for i in ids], [i[:, 1:] for i in ids]


# (schedule, overlap, executor options): the combined step in its settings, then the tape path
SETTINGS = {
    "combined": ("1f1b", True, {}),
    "combined, node trace": ("1f1b", True, {"record_trace": True}),
    "combined, deferred weight gradients": ("1f1b", True, {"delay_wgrad_compute": True}),
    "combined, I and W halves": ("zb1p", True, {}),
    "tape": ("1f1b", False, {"use_tape": True}),
    "tape, I and W": ("zb1p", False, {"use_tape": True}),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_a_step_leaves_no_cyclic_garbage(name: str) -> None:
    schedule, overlap, options = SETTINGS[name]
    inputs, targets = _batches()
    with PipelineExecutor(build_schedule(schedule, 1, MICROBATCHES, overlap=overlap),
                          {0: build_stage(CONFIG, 0, 1)},
                          ExecutorOptions(loss_fn=gpt_loss, **options)) as executor:
        assert cyclic_garbage(lambda: executor.step(inputs, targets)) == {}, name


def test_the_probe_finds_a_cycle_that_holds_a_tensor() -> None:
    def work() -> None:
        held = {"tensor": torch.zeros(3)}
        # a dict that holds itself: the cycle under test
        held["itself"] = held  # type: ignore[assignment]

    assert cyclic_garbage(work) == {"torch.Tensor": 1}


def _forward_step(labels, data_iterator, model):
    tokens = next(data_iterator)
    return model(tokens), partial(_loss, labels[tokens.data_ptr()])


def _loss(labels, output):
    loss = gpt_loss(output, labels)
    return loss, {"lm loss": loss.detach()}


def test_the_megatron_front_end_leaves_no_cyclic_garbage() -> None:
    inputs, targets = _batches()
    labels = {t.data_ptr(): y for t, y in zip(inputs, targets)}
    chunk = build_stage(CONFIG, 0, 1)
    func = get_forward_backward_func(pp=1, overlap_moe_expert_parallel_comm=True,
                                     delay_wgrad_compute=True, record_trace=True)

    def call() -> None:
        func(forward_step_func=partial(_forward_step, labels), data_iterator=iter(inputs),
             model=chunk, num_microbatches=MICROBATCHES, seq_length=8, micro_batch_size=1)

    try:
        assert cyclic_garbage(call) == {}
    finally:
        func.close()
