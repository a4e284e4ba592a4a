"""Rank-side code for the executor tests: run a pipeline configuration and its reference.

Every function here runs inside the ranks of a ``RankPool`` (module-level, so it can be sent to
them). A configuration with ``pp * dp`` ranks uses ranks ``[0, pp*dp)`` of the pool and process
groups over those ranks only (``prepare_groups``), so many configurations run in one pool of 8
processes without restarting torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.models.config import GPTConfig
from megapipe.models.gpt import gpt_loss
from megapipe.models.split import build_stage
from megapipe.parallel.config import ParallelConfig
from megapipe.parallel.groups import GROUP_NAMES, ProcessGroups, assemble_groups, rank_grid
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.executor_options import ExecutorOptions
from megapipe.pipeline.p2p import TensorSpec
from megapipe.precision.main_grad import accumulated_grad, zero_grads
from megapipe.schedule import Kind, build_schedule
from megapipe.schedule.rank_views import in_flight_limit
from megapipe.train.optim.mixed_precision import cast_to_bf16

MICRO_BATCH = 2
CONFIG = GPTConfig(
    vocab_size=64,
    hidden_size=16,
    num_layers=6,
    num_heads=2,
    seq_length=8,
    ffn_hidden_size=32,
    num_experts=4,
    moe_top_k=2,
    moe_ffn_hidden_size=16,
    first_k_dense_layers=1,
)
LR = 0.5
# The modern model (issue 31): rope, grouped-query attention (2 groups of 2 heads), QK norm,
# kv_channels 8 (heads x kv_channels = 32, twice the hidden size), tied embeddings (summed
# across stages by the executor's grad sync); "modern_untied" for DualPipe, which refuses
# weights tied across its mirrored stages, and for a model of one stage in the combined-step
# matrix (test_combined_step.py says why). Same vocabulary and sequence length as CONFIG.
MODERN_CONFIG = dataclasses.replace(
    CONFIG, num_heads=4, num_query_groups=2, kv_channels=8, qk_layernorm=True,
    position_embedding_type="rope", untie_embeddings_and_output_weights=False,
)
MODELS = {
    "reference": CONFIG,
    "modern": MODERN_CONFIG,
    "modern_untied": dataclasses.replace(MODERN_CONFIG, untie_embeddings_and_output_weights=True),
    # sync-free lanes (static shapes): MoE layers that CUDA graphs capture whole
    "rank_capacity": dataclasses.replace(CONFIG, moe_expert_rank_capacity_factor=2.0),
}


@dataclass(frozen=True)
class Case:
    """One pipeline configuration of the test matrix."""

    schedule: str
    pp: int
    vpp: int = 1
    ep: int = 1
    dp: int = 1
    microbatches: int = 4
    overlap: bool = False
    variable_seq: bool = False  # microbatch i has its own sequence length (declared per microbatch)
    bf16: bool = False  # bf16 parameters and activations, float32 main weights and gradients
    model: str = "reference"  # a key of MODELS

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def config(self):
        """The model ``GPTConfig`` of this case."""
        return MODELS[self.model]

    def __str__(self) -> str:
        flag = ("+overlap" if self.overlap else "") + ("+varseq" if self.variable_seq else "")
        flag += "+bf16" if self.bf16 else ""
        flag += "" if self.model == "reference" else f"+{self.model}"
        return (
            f"{self.schedule}{flag}(pp={self.pp},vpp={self.vpp},ep={self.ep},dp={self.dp},"
            f"M={self.microbatches})"
        )


# A pool process keeps its groups for its whole life, one per rank set: every rank of the pool
# creates every group (torch's rule for new_group), in the same order, before any case runs.
_GROUPS_BY_RANKS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def prepare_groups(configs: list[ParallelConfig]) -> None:
    """Create (once per pool process) the groups of every config, over ranks [0, world)."""
    needed = sorted(
        {
            tuple(ranks)
            for config in configs
            for kind in GROUP_NAMES
            for ranks in getattr(rank_grid(config), f"{kind}_groups")
        }
    )
    for ranks in needed:
        if ranks not in _GROUPS_BY_RANKS:
            _GROUPS_BY_RANKS[ranks] = dist.new_group(list(ranks))


def subworld_groups(config: ParallelConfig) -> ProcessGroups:
    """``create_groups`` for the first ``config.world_size`` ranks of a larger pool."""
    prepare_groups([config])
    return assemble_groups(
        rank_grid(config), dist.get_rank(), lambda name, ranks: _GROUPS_BY_RANKS[ranks]
    )


def seq_length(index: int, variable: bool) -> int:
    """Microbatch ``index``'s sequence length: the model's, or (variable) shorter by index % 3."""
    return CONFIG.seq_length - (index % 3 if variable else 0)


def microbatch(
    dp_rank: int, index: int, step: int, variable_seq: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels of one microbatch, a pure function of where and when it runs."""
    g = torch.Generator().manual_seed(1000 * step + 100 * dp_rank + index)
    length = seq_length(index, variable_seq) + 1
    ids = torch.randint(0, CONFIG.vocab_size, (MICRO_BATCH, length), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _sgd(params) -> None:
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad
            p.grad = None


def make_sgd(modules, bf16: bool) -> Callable[[], None]:
    """Plain SGD on ``modules``' parameters (``bf16``: modules cast by ``cast_to_bf16``; step
    float32 main weights with the float32 main gradients)."""
    params = list(dict.fromkeys(p for m in modules for p in m.parameters()))
    if not bf16:
        return lambda: _sgd(params)
    mains = [p.detach().float() for p in params]

    @torch.no_grad()
    def step() -> None:
        for p, main in zip(params, mains):
            main -= LR * p.main_grad
            p.copy_(main)
        zero_grads(params)

    return step


def grads_of(modules: dict) -> dict:
    """{(stage, name): accumulated gradient (float32 main gradient under bf16)}."""
    return {(s, n): accumulated_grad(p).clone() for s, m in modules.items()
            for n, p in m.named_parameters()}


def reference_run(case: Case, steps: int) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """The unsplit model on one process over every DP rank's microbatches: per step, the losses
    (in (dp_rank, microbatch) order) and every parameter's gradient."""
    model = build_stage(case.config, 0, 1)
    if case.bf16:
        cast_to_bf16([model], list(model.parameters()))
    sgd = make_sgd([model], case.bf16)
    total = case.dp * case.microbatches
    for layer in model.moe_layers():
        layer.aux_loss_scale = 1.0 / total
    out = []
    for step in range(steps):
        losses = []
        for d in range(case.dp):
            for i in range(case.microbatches):
                tokens, labels = microbatch(d, i, step, case.variable_seq)
                loss = gpt_loss(model(tokens), labels)
                (loss / total).backward()
                losses.append(loss.item())
        out.append((losses, {n: g.clone() for (_, n), g in grads_of({0: model}).items()}))
        sgd()
    return out


def bitwise_expected(case: Case) -> bool:
    """Same summation order as the reference: one DP rank, no EP, no mirrored halves, and every
    stage accumulates weight gradients (in B, I or W) in increasing microbatch order."""
    if case.dp != 1 or case.ep != 1 or case.schedule == "dualpipe":
        return False
    schedule = build_schedule(case.schedule, case.pp, case.microbatches, vpp=case.vpp)
    orders: dict[tuple[int, Kind], list[int]] = {}
    for row in schedule.actions:
        for action in row:
            for comp in action.computations():
                if comp.kind is not Kind.F:
                    orders.setdefault((comp.stage, comp.kind), []).append(comp.microbatch)
    return all(order == sorted(order) for order in orders.values())


def expected_grad(case: Case, result: dict, name: str, stage_key, reference) -> torch.Tensor:
    """The reference gradient of ``name`` as this rank holds it (its EP shard of an expert)."""
    grad = reference[name]
    if result["experts"][stage_key] and case.ep > 1:
        local = grad.shape[0] // case.ep
        grad = grad[result["ep_rank"] * local : (result["ep_rank"] + 1) * local]
    return grad


def build_pipeline(case: Case, timeout: float = 20.0):
    """This rank's schedule, stages and executor for ``case``."""
    config = ParallelConfig(pp=case.pp, dp=case.dp, ep=case.ep)
    groups = subworld_groups(config)
    schedule = build_schedule(
        case.schedule, case.pp, case.microbatches, vpp=case.vpp, overlap=case.overlap
    )
    ep_group = groups.ep if case.ep > 1 else None
    stages = {
        s: build_stage(case.config, schedule.model_part(s), schedule.stages_per_pipeline,
                       ep_group)
        for s in schedule.stages_of_rank(groups.pp_rank)
    }
    if case.bf16:
        cast_to_bf16(stages.values(), [p for m in stages.values() for p in m.parameters()])
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    executor = PipelineExecutor(
        schedule,
        stages,
        ExecutorOptions(
            # a declaration per microbatch: sequence lengths may differ between microbatches
            spec=lambda stage, i: TensorSpec(
                (MICRO_BATCH, seq_length(i, case.variable_seq), CONFIG.hidden_size), dtype
            ),
            loss_fn=gpt_loss,
            groups=groups,
            timeout=timeout,
        ),
    )
    return groups, schedule, stages, executor


def pipeline_run(case: Case, steps: int) -> dict | None:
    """Train ``steps`` steps of ``case``; per step the losses and this rank's gradients."""
    if dist.get_rank() >= case.world:
        return None
    groups, schedule, stages, executor = build_pipeline(case)
    sgd = make_sgd([stages[s] for s in sorted(stages)], case.bf16)
    per_step = []
    peak = 0
    for step in range(steps):
        data = [
            microbatch(groups.dp_rank, i, step, case.variable_seq)
            for i in range(case.microbatches)
        ]
        result = executor.step([d[0] for d in data], [d[1] for d in data])
        peak = max(peak, result.peak_live_activations)
        per_step.append(({i: v.item() for i, v in result.losses.items()}, grads_of(stages)))
        sgd()
    experts = {
        (s, n): bool(getattr(p, "expert_parallel", False))
        for s, m in stages.items()
        for n, p in m.named_parameters()
    }
    return {
        "dp_rank": groups.dp_rank,
        "ep_rank": groups.ep_rank,
        "steps": per_step,
        "experts": experts,
        "peak": peak,
        "limit": in_flight_limit(executor.rank_actions.lowered, groups.pp_rank),
    }


def run_cases(cases: list[Case], steps: int = 2) -> list[dict | None]:
    """Run every case (its pipeline on its ranks; its reference on rank 0), in one task.

    The reference depends only on (dp, microbatches), so rank 0 computes each one once.
    """
    prepare_groups([ParallelConfig(c.pp, c.dp, c.ep) for c in cases])
    references: dict[tuple[int, int], list] = {}
    out = []
    for case in cases:
        result = pipeline_run(case, steps)
        if dist.get_rank() == 0:
            assert result is not None
            key = (case.dp, case.microbatches, case.variable_seq, case.bf16, case.model)
            if key not in references:
                references[key] = reference_run(case, steps)
            result["reference"] = references[key]
        out.append(result)
        dist.barrier()
    return out


def forward_only_run(case: Case) -> dict | None:
    """Forward-only evaluation, then a training step on the same data: losses, graph, grads."""
    prepare_groups([ParallelConfig(case.pp, case.dp, case.ep)])
    if dist.get_rank() >= case.world:
        return None
    groups, schedule, stages, executor = build_pipeline(case)
    data = [microbatch(groups.dp_rank, i, 0) for i in range(case.microbatches)]
    inputs, labels = [d[0] for d in data], [d[1] for d in data]
    evaluation = executor.step(inputs, labels, forward_only=True)
    untouched = all(p.grad is None for m in stages.values() for p in m.parameters())
    training = executor.step(inputs, labels)
    return {
        "eval": {i: v.item() for i, v in evaluation.losses.items()},
        "train": {i: v.item() for i, v in training.losses.items()},
        "eval_requires_grad": any(v.requires_grad for v in evaluation.losses.values()),
        "eval_peak": evaluation.peak_live_activations,
        "train_peak": training.peak_live_activations,
        "grads_untouched_by_eval": untouched,
    }


def timeout_run(timeout: float) -> str | None:
    """Rank 1 runs the last stage of a 2-rank 1F1B whose first stage (rank 0) never starts.

    A dedicated group carries the stuck receive, so the pool's other groups stay usable; it is
    destroyed afterwards. Returns rank 1's error message.
    """
    group = dist.new_group([0, 1])  # every pool rank takes part in creating it
    message = None
    if dist.get_rank() == 1:
        from megapipe.pipeline.p2p import P2PTimeoutError

        schedule = build_schedule("1f1b", 2, 2)
        stage = build_stage(CONFIG, 1, 2)
        executor = PipelineExecutor(
            schedule,
            {1: stage},
            ExecutorOptions(
                spec=TensorSpec((MICRO_BATCH, CONFIG.seq_length, CONFIG.hidden_size)),
                loss_fn=gpt_loss,
                pp_group=group,
                timeout=timeout,
            ),
        )
        labels = [microbatch(0, i, 0)[1] for i in range(2)]
        try:
            executor.step(targets=labels)
        except P2PTimeoutError as err:
            message = str(err)
    if dist.get_rank() in (0, 1):
        dist.destroy_process_group(group)
    dist.barrier()
    return message


def misuse_errors() -> dict[str, str] | None:
    """The executor's errors for wrong stages, chunk counts, microbatch counts and shapes."""
    prepare_groups([ParallelConfig(2, 1, 1)])
    if dist.get_rank() >= 2:
        return None
    groups = subworld_groups(ParallelConfig(2, 1, 1))
    spec = TensorSpec((MICRO_BATCH, CONFIG.seq_length, CONFIG.hidden_size))
    schedule = build_schedule("interleaved-1f1b", 2, 4, vpp=2)
    mine = schedule.stages_of_rank(groups.pp_rank)
    errors = {}

    def capture(name, fn):
        try:
            fn()
        except (ValueError, TypeError) as err:
            errors[name] = str(err)

    def make(stage_ids, sched=schedule, spec=spec):
        stages = {s: build_stage(CONFIG, s, sched.stages_per_pipeline) for s in stage_ids}
        return PipelineExecutor(sched, stages,
                                ExecutorOptions(spec=spec, loss_fn=gpt_loss, groups=groups))

    capture("chunks", lambda: make(mine[:1]))
    capture("placement", lambda: make(schedule.stages_of_rank(1 - groups.pp_rank)))
    data = [microbatch(0, i, 0) for i in range(3)]
    capture(
        "microbatches", lambda: make(mine).step([d[0] for d in data], [d[1] for d in data])
    )
    wrong = TensorSpec((MICRO_BATCH, CONFIG.seq_length + 1, CONFIG.hidden_size))
    if groups.pp_rank == 0:  # the sender checks its tensor against the declaration
        data = [microbatch(0, i, 0) for i in range(4)]
        capture(
            "spec",
            lambda: make(mine, spec=wrong).step([d[0] for d in data], [d[1] for d in data]),
        )
    return errors
