"""Tied embeddings (``--no-untie-embeddings-and-output-weights``) in megapipe pretrain: one weight
for the embedding and the output layer, held by the first and the last stage (4 gloo ranks).

Both copies end every step with the sum of their gradients, also when the gradients live in
flat buffers (``--overlap-grad-reduce``: the executor reduces nothing there), and the gradient
norm counts the weight once (the last stage's copy, Megatron's ``shared``, is left out): the
pipelined run's norms and losses are the single-stage run's. What megapipe does not run tied is
refused in one line before any process group.
"""

import pytest

from megapipe.train.config.parse import ArgsError, parse_pretrain_args
from megapipe.train.loop import train
from support.pretrain_flags import TINY

TIED = TINY + ["--no-untie-embeddings-and-output-weights", "--train-iters", "3",
               "--eval-interval", "0"]
ONE_STAGE = ["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size",
             "1", "--no-overlap-moe-expert-parallel-comm", "--nproc", "4"]


def _train(argv):
    return train(parse_pretrain_args(argv, env={}), write=lambda line: None)


def test_tied_copies_are_summed_and_counted_once(rank_pools):
    pool = rank_pools(4)
    combined = pool.run(_train, TIED)[0]  # pp 2 vpp 2: stage 0 on rank 0, stage 3 on rank 1
    assert any("tied embeddings" in line for line in combined.lines), combined.lines
    bucketed = pool.run(_train, TIED + ["--overlap-grad-reduce", "--ddp-bucket-size", "512"])[0]
    assert bucketed.losses == pytest.approx(combined.losses, rel=1e-6, abs=0)
    assert bucketed.grad_norms == pytest.approx(combined.grad_norms, rel=1e-6, abs=0)
    # one stage holds the one weight: its norm counts it once; the pipeline's must agree
    single = pool.run(_train, TIED + ONE_STAGE)[0]
    assert combined.grad_norms == pytest.approx(single.grad_norms, rel=1e-5, abs=0)
    assert combined.losses == pytest.approx(single.losses, rel=1e-5, abs=0)
    assert combined.losses[-1] < combined.losses[0]


@pytest.mark.parametrize("flags,message", [
    (["--pipeline-schedule", "dualpipe", "--global-batch-size", "16"],
     "with --pipeline-schedule dualpipe: each model part has two copies there"),
    (["--use-distributed-optimizer"],
     "with --use-distributed-optimizer: the two copies' gradients are sharded differently"),
    (["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "1"],
     "in a model of one stage with --overlap-moe-expert-parallel-comm"),
])
def test_what_megapipe_does_not_run_tied_is_refused_in_one_line(flags, message):
    with pytest.raises(ArgsError) as err:
        parse_pretrain_args(TIED + flags, env={})
    assert "--no-untie-embeddings-and-output-weights (tied embeddings)" in str(err.value)
    assert message in str(err.value) and "\n" not in str(err.value), err.value
    parse_pretrain_args(TINY + flags, env={})  # untied: accepted
