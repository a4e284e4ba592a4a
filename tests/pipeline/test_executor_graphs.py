"""The executor's CUDA-graph settings: what it refuses, what it reports, what it says on CPU.

The bitwise runs of graphs in pipelined schedules are in ``test_combined_step.py``
(``graph_cases``); the capture rules in ``tests/graphs/test_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch

from megapipe import get_forward_backward_func
from megapipe.megatron.mcore_support import check_cuda_graphs
from megapipe.models import GPTConfig, build_stage
from megapipe.models.gpt import gpt_loss
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.schedule import build_schedule
from megapipe.train.config.declare import ArgsError
from megapipe.train.config.parse import parse_pretrain_args
from support.fake_graphs import FakeGraphApi

CONFIG = GPTConfig(hidden_size=16, num_layers=2, num_heads=2, seq_length=8, ffn_hidden_size=32,
                   num_experts=2, moe_top_k=1, moe_ffn_hidden_size=16, first_k_dense_layers=1)


def _executor(schedule: str = "1f1b", overlap: bool = True, **graphs) -> PipelineExecutor:
    return PipelineExecutor(build_schedule(schedule, 1, 2, overlap=overlap),
                            {0: build_stage(CONFIG, 0, 1)},
                            ExecutorOptions(loss_fn=gpt_loss, **graphs))


def test_the_step_reports_the_graphs_and_their_bytes() -> None:
    ids = torch.randint(0, 256, (2, 1, 9), generator=torch.Generator().manual_seed(0))
    with _executor(cuda_graph_impl="local", cuda_graph_modules=("attn", "moe_router", "mlp"),
                   graph_api=FakeGraphApi()) as executor:
        assert executor.cuda_graph_note == ("CUDA graphs: local, modules attn mlp moe_preprocess "
                                            "moe_router")
        result = executor.step([i[:, :-1] for i in ids], [i[:, 1:] for i in ids])
    # combined 1f1b at pp 1: microbatch 1's forward beside microbatch 0's backward, so two
    # instances of each captured node (the dense layer, the MoE attention node)
    assert result.graph_instances == 4 and result.graph_bytes > 0


def test_on_cpu_the_graphs_are_off_and_the_executor_says_so() -> None:
    with _executor(cuda_graph_impl="local",
                   cuda_graph_modules=("attn", "moe_router", "mlp")) as executor:
        assert executor.cuda_graphs is None
        assert "CUDA graphs need CUDA; this run is on cpu" in executor.cuda_graph_note
    with _executor() as executor:
        assert executor.cuda_graphs is None and executor.cuda_graph_note is None


def test_partial_nodes_and_a_plain_iw_split_are_refused() -> None:
    with pytest.raises(ValueError, match="node holding attn also holds mlp"):
        _executor(cuda_graph_impl="local", cuda_graph_modules=("attn", "moe_router"),
                  graph_api=FakeGraphApi())
    with pytest.raises(ValueError, match="'zb1p' without the overlap: its plain I/W split"):
        _executor("zb1p", overlap=False, cuda_graph_impl="local",
                  cuda_graph_modules=("attn", "moe_router", "mlp"), graph_api=FakeGraphApi())
    with pytest.raises(ValueError, match="megapipe does not use TransformerEngine"):
        _executor(cuda_graph_impl="transformer_engine", cuda_graph_modules=("attn",))


def test_the_front_end_takes_megatrons_keywords_and_refuses_megatron_chunks() -> None:
    func = get_forward_backward_func(cuda_graph_impl="local",
                                     cuda_graph_modules=["attn", "moe_router"])
    assert func.options.cuda_graph_modules == ("attn", "moe_router")
    with pytest.raises(ValueError, match="shared_experts: not captured"):
        get_forward_backward_func(cuda_graph_impl="local", cuda_graph_modules=["shared_experts"])
    check_cuda_graphs("none")
    with pytest.raises(NotImplementedError, match="cuda_graph_impl='local' with Megatron-Core"):
        check_cuda_graphs("local")


def test_pretrain_flags_land_in_their_part_and_the_old_name_is_an_alias() -> None:
    base = ["--nproc", "4"]
    config = parse_pretrain_args(base + ["--cuda-graph-impl", "local", "--cuda-graph-modules",
                                         "attn", "moe_router"], env={})
    assert (config.graphs.impl, config.graphs.modules) == ("local", ("attn", "moe_router"))
    old = parse_pretrain_args(base + ["--cuda-graph-impl", "local", "--cuda-graph-scope",
                                      "attn", "moe_preprocess"], env={})
    assert old.graphs.modules == ("attn", "moe_preprocess")
    assert parse_pretrain_args(base, env={}).graphs.impl == "none"
    for argv, message in (
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn",
          "--cuda-graph-scope", "attn"], "give one of them"),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "shared_experts"],
         "--cuda-graph-modules shared_experts: not captured"),
        (["--cuda-graph-impl", "local", "--cuda-graph-scope", "mamba"],
         "--cuda-graph-scope mamba: not captured"),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe"],
         ("moe: a dropless MoE layer's expert shapes follow its routing; give "
          "--moe-expert-rank-capacity-factor")),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router", "mlp"],
         "the model has no dense layer"),
        (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn", "moe_router",
          "--recompute-granularity", "full", "--recompute-method", "uniform"],
         "a recomputed node runs its forward again"),
    ):
        with pytest.raises(ArgsError, match=message.replace("-", r"\-")):
            parse_pretrain_args(base + argv, env={})


def test_moe_layers_graphed_whole_give_the_plain_and_eager_bits() -> None:
    from megapipe.precision.main_grad import accumulated_grad

    ids = torch.randint(0, 256, (4, 1, 9), generator=torch.Generator().manual_seed(2))
    config = GPTConfig(**{**CONFIG.__dict__, "num_experts": 4, "moe_top_k": 2,
                          "moe_expert_rank_capacity_factor": 2.0})
    runs = []
    for overlap, graphs in ((False, False), (True, False), (True, True), (False, True)):
        stage = build_stage(config, 0, 1)
        options = dict(cuda_graph_impl="local", graph_api=FakeGraphApi(),
                       cuda_graph_modules=("attn", "moe", "mlp")) if graphs else {}
        with PipelineExecutor(build_schedule("1f1b", 1, 4, overlap=overlap), {0: stage},
                              ExecutorOptions(loss_fn=gpt_loss, delay_wgrad_compute=overlap,
                                              **options)) as executor:
            result = executor.step([i[:, :-1] for i in ids], [i[:, 1:] for i in ids])
            assert not graphs or (executor.cuda_graphs.captured > 0
                                  and executor.cuda_graphs.stats.eager == {})
        runs.append([result.losses[m] for m in sorted(result.losses)]
                    + [accumulated_grad(p) for p in stage.parameters()])
    assert all(all(torch.equal(a, b) for a, b in zip(runs[0], run)) for run in runs[1:])
    # the last (plain) run: one instance each of the dense node and the MoE layer's attention,
    # experts and finish (every backward runs before the next forward at pp 1)
    assert result.graph_instances == 4


def test_chunked_all_to_alls_capture_the_chunked_attention_node_with_the_same_bits() -> None:
    from megapipe.precision.main_grad import accumulated_grad

    ids = torch.randint(0, 256, (4, 1, 9), generator=torch.Generator().manual_seed(1))
    config = GPTConfig(**{**CONFIG.__dict__, "num_experts": 4})
    runs = []
    for graphs in ({}, dict(cuda_graph_impl="local", graph_api=FakeGraphApi(),
                            cuda_graph_modules=("attn", "moe_router", "mlp"))):
        stage = build_stage(config, 0, 1)
        with PipelineExecutor(build_schedule("1f1b", 1, 4, overlap=True), {0: stage},
                              ExecutorOptions(loss_fn=gpt_loss, moe_a2a_waves=2,
                                              **graphs)) as executor:
            result = executor.step([i[:, :-1] for i in ids], [i[:, 1:] for i in ids])
        runs.append(([result.losses[m] for m in sorted(result.losses)],
                     [accumulated_grad(p) for p in stage.parameters()], result))
    (losses, grads, _), (g_losses, g_grads, graphed) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses + grads, g_losses + g_grads))
    assert graphed.graph_instances == 4  # the dense and attention nodes (in waves), x2
