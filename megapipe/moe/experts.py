"""Expert MLPs: the SwiGLU feed-forward, grouped over the experts held by this rank.

``GroupedExperts`` stores the local experts' weights stacked ([L, h, F], [L, h, F], [L, F, h]),
each expert drawn from its own generator keyed by (seed, layer index, global expert index), so
any EP size builds the same experts. Forward runs one SwiGLU per local expert on its contiguous
slice of expert-major tokens: each of its three matmuls is one grouped GEMM over all local
experts where torch has one (given the device offsets the dispatcher makes), else a
deterministic loop (``moe.grouped_gemm``), and the activation ``silu(gate) * up`` is one fused
operator each way (``megapipe.kernels.swiglu``). Every expert runs, even on zero tokens, so every
expert weight always gets a gradient, zeros when idle. A layer in waves (``moe.waves``) runs
one group of the local experts at a time (``group_first``), with bitwise the same results.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megapipe.kernels import swiglu as fused_swiglu
from megapipe.moe.grouped_gemm import grouped_matmul, use_grouped_mm
from megapipe.moe.seeding import seeded_normal
from megapipe.overlap.plan import LayerState
from megapipe.recompute.function import recompute


def swiglu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """``(silu(x @ w_gate) * (x @ w_up)) @ w_down`` with weights [h, F], [h, F], [F, h] (the
    activation one fused operator each way)."""
    return fused_swiglu(x @ w_gate, x @ w_up, [x.shape[0]]) @ w_down


class SwiGLUMLP(nn.Module):
    """A dense SwiGLU MLP (the shared expert), initialised from (seed, *keys)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        seed: int,
        *keys: int | str,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(
            seeded_normal((hidden_size, ffn_hidden_size), init_std, seed, *keys, "gate")
        )
        self.w_up = nn.Parameter(
            seeded_normal((hidden_size, ffn_hidden_size), init_std, seed, *keys, "up")
        )
        self.w_down = nn.Parameter(
            seeded_normal((ffn_hidden_size, hidden_size), init_std, seed, *keys, "down")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w_gate, self.w_up, self.w_down)


class GroupedExperts(nn.Module):
    """The experts ``first_expert .. first_expert + num_local_experts - 1`` of one MoE layer."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_local_experts: int,
        first_expert: int,
        seed: int = 0,
        layer_index: int = 0,
        init_std: float = 0.02,
        recompute_activation: bool = False,
    ) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        # Megatron's --recompute-modules moe_act: the SwiGLU activation re-runs in backward
        self.recompute_activation = recompute_activation
        self.first_expert = first_expert
        experts = range(first_expert, first_expert + num_local_experts)

        def stacked(shape: tuple[int, int], name: str) -> nn.Parameter:
            weights = [
                seeded_normal(shape, init_std, seed, "expert", layer_index, e, name)
                for e in experts
            ]
            param = nn.Parameter(torch.stack(weights))
            # reduced over the expert-data-parallel group; a tag torch's stubs do not declare
            param.expert_parallel = True  # type: ignore[attr-defined]
            return param

        self.w_gate = stacked((hidden_size, ffn_hidden_size), "gate")
        self.w_up = stacked((hidden_size, ffn_hidden_size), "up")
        self.w_down = stacked((ffn_hidden_size, hidden_size), "down")

    def forward(
        self,
        tokens: torch.Tensor,
        tokens_per_expert: Sequence[int] | None,
        state: LayerState | None = None,
        offsets: torch.Tensor | None = None,
        group_first: int | None = None,
    ) -> torch.Tensor:
        """``tokens [n, h]`` expert-major with ``tokens_per_expert[i]`` rows for local expert i.

        ``state`` (the layer's ``LayerState``) lets the overlap engine defer the expert weight
        gradients into its ``wgrad_queue`` (megapipe.overlap.wgrad); None computes them at once.
        ``offsets`` (int32 on the tokens' device, each expert's end row) enable the one-kernel
        grouped GEMM. ``group_first``: run only the local experts ``group_first ..`` (one per
        entry of ``tokens_per_expert``): one expert group of a layer in waves.
        ``tokens_per_expert=None``: the counts live on the device only (``moe.rank_capacity``):
        ``offsets`` end the experts' rows, the rows after the last are padding, and the grouped
        kernel must apply (it reads no counts); the activation runs over all rows at once.
        """
        if tokens_per_expert is None:
            return self._device_counts(tokens, state, offsets)
        first = 0 if group_first is None else group_first
        expected = self.num_local_experts - first if group_first is None else len(tokens_per_expert)
        if len(tokens_per_expert) != expected or first + expected > self.num_local_experts:
            raise ValueError(
                f"tokens_per_expert has {len(tokens_per_expert)} entries, expected one per local "
                f"expert ({self.num_local_experts}) from expert {first}"
            )
        if sum(tokens_per_expert) != tokens.shape[0]:
            raise ValueError(
                f"tokens_per_expert sums to {sum(tokens_per_expert)} "
                f"but there are {tokens.shape[0]} rows"
            )
        if group_first is not None:
            offsets = None  # the grouped kernel's offsets describe all local experts
        counts = [int(c) for c in tokens_per_expert]
        # grouped_matmul = cat_i(block_i @ w[first + i]); its backward can defer the weight
        # gradients into the WeightGradQueue that ``state.wgrad_queue`` holds at backward time
        gate = grouped_matmul(tokens, counts, self.w_gate, state, offsets, first)
        up = grouped_matmul(tokens, counts, self.w_up, state, offsets, first)

        def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            # one operator each way (megapipe.kernels.swiglu); on CPU it runs per expert, since
            # CPU kernels compute a tensor's last elements in a scalar tail, so an expert's
            # activations would otherwise depend on the other experts' rows and a layer in waves
            # (a group of experts at a time) would differ
            return fused_swiglu(gate, up, counts)

        if self.recompute_activation:  # keep gate and up only; silu(gate) is made again
            hidden = recompute(activation, gate, up)
        else:
            hidden = activation(gate, up)
        return grouped_matmul(hidden, counts, self.w_down, state, offsets, first)

    def _device_counts(
        self, tokens: torch.Tensor, state: LayerState | None, offsets: torch.Tensor | None
    ) -> torch.Tensor:
        """The experts with their row counts on the device only (``forward``)."""
        if offsets is None or not all(
            use_grouped_mm(tokens, w, offsets) for w in (self.w_gate, self.w_down)
        ):
            raise NotImplementedError(
                f"experts with device-only row counts need torch's grouped GEMM for "
                f"{tokens.dtype} on {tokens.device.type} (CUDA: bf16 on compute capability 9.x "
                "or 10.x; CPU: float32, bf16 or float16 with 16-byte aligned rows)"
            )
        # the kernel reads only ``offsets``; ``whole`` satisfies the host-side shape checks
        whole = (tokens.shape[0],) + (0,) * (self.num_local_experts - 1)
        gate = grouped_matmul(tokens, whole, self.w_gate, state, offsets)
        up = grouped_matmul(tokens, whole, self.w_up, state, offsets)

        def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return fused_swiglu(gate, up, [gate.shape[0]])

        hidden = (
            recompute(activation, gate, up) if self.recompute_activation else activation(gate, up)
        )
        return grouped_matmul(hidden, whole, self.w_down, state, offsets)
