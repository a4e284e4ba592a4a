"""The Megatron-Core releases the adapter supports, and every difference between them it mirrors.

This module is the one place that knows release differences: the adapter asks ``release()`` for
the installed ``McoreRelease`` and calls its methods wherever the code it mirrors differs
between releases. ``SUPPORTED_RELEASES`` names the newest patch of each supported line; a local
version suffix (``0.19.2+<git hash>``, what a source checkout reports) is accepted, any other
version is refused in one line naming both.

Differences, by release (what ``McoreRelease`` answers):

| where | 0.16 | 0.17 | 0.18 | 0.19 |
|---|---|---|---|---|
| pre-MLP norm: ``(output, residual)`` from a fused residual norm | no | yes | yes | yes |
| ``fp32_residual_connection`` casts the MLP residual | no | yes | yes | yes |
| MoE input unflattened for packed sequences (``tokens_per_sample``) | no | no | no | yes |
| ``GPTModel._postprocess`` takes ``padding_mask``, ``output_processor`` | no | no | yes | yes |
| the MTP layer's inner layer | ``transformer_layer`` | ``mtp_model_layer`` | same | same |
| ``MultiTokenPredictionLayer._get_embeddings`` returns ``padding_mask`` | no | no | yes | yes |
| the MoE metrics tracker | dict in ``moe_utils`` | same | ``MoEMetricsTracker`` | same |
| ``_update_router_expert_bias`` takes the TPxDPxCP group | no | no | yes | yes |
| quantile-balancing routing (its bias updated at the step's end) | no | no | no | yes |
| MTP with full recompute runs in Megatron itself | yes | yes | no (refused) | yes |
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_RELEASES = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\+[0-9A-Za-z.]+)?$")


def parse_version(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a release version (``+local`` suffix allowed), else None."""
    match = _VERSION.match(version.strip())
    if match is None:
        return None
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def check_version(version: str) -> tuple[int, int, int]:
    """The release of ``version``; one clear error when it is not a supported release."""
    parsed = parse_version(version)
    if parsed is None or ".".join(map(str, parsed)) not in SUPPORTED_RELEASES:
        raise RuntimeError(
            f"megatron-core {version} is not supported by megapipe's adapter (it mirrors Megatron "
            f"internals release by release); supported: {', '.join(SUPPORTED_RELEASES)} (a local "
            "suffix such as +<git hash> is fine; pip install 'megapipe[megatron]' gets 0.16.1)"
        )
    return parsed


def release() -> McoreRelease:
    """The installed megatron-core as an ``McoreRelease`` (refused when unsupported)."""
    import megatron.core

    return McoreRelease(check_version(getattr(megatron.core, "__version__", "unknown")))


@dataclass(frozen=True)
class McoreRelease:
    """One supported release: the answers where the code the adapter mirrors differs."""

    version: tuple[int, int, int]

    def __str__(self) -> str:
        return ".".join(map(str, self.version))

    def at_least(self, minor: int) -> bool:
        return self.version >= (0, minor, 0)

    def config_problem(self, config: Any) -> str | None:
        """A configuration this release's own Megatron cannot run (so there are no Megatron
        numbers to mirror), as one line; None otherwise."""
        if (
            self.version[:2] == (0, 18)
            and config.mtp_num_layers
            and config.recompute_granularity == "full"
        ):
            return (
                f"megatron-core {self} cannot run MTP layers under full recompute (its "
                "MultiTokenPredictionLayer passes padding_mask to a _checkpointed_forward "
                "that does not take it); use another release or recompute_granularity="
                "'selective'"
            )
        return None

    # ---------------------------------------------------------------- TransformerLayer
    def pre_mlp(self, layer: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``TransformerLayer._forward_mlp`` up to the MLP: (the MLP's input, the residual)."""
        output = layer._forward_pre_mlp_layernorm(hidden)
        if not self.at_least(17):
            return output, hidden
        residual = hidden
        if isinstance(output, tuple):  # a fused residual norm returns (output, residual)
            if len(output) != 2:
                raise ValueError(
                    f"the pre-MLP norm returned a tuple of {len(output)}; Megatron expects "
                    "(output, residual)"
                )
            output, residual = output
        if layer.config.fp32_residual_connection:
            residual = residual.float()
        return output, residual

    def unflatten_for_moe(
        self, layer: Any, hidden: torch.Tensor, padding_mask: Any, packed_seq_params: Any
    ) -> tuple[torch.Tensor, Any, int | None]:
        """0.19 restores the batch dimension of packed sequences before the MoE layer."""
        if not self.at_least(19):
            return hidden, padding_mask, None
        return layer._maybe_unflatten_for_moe(hidden, padding_mask, packed_seq_params)

    def reflatten_from_moe(
        self, layer: Any, output: torch.Tensor, packed_seq_params: Any, mbs: int | None
    ) -> torch.Tensor:
        return (
            output
            if mbs is None
            else layer._maybe_reflatten_from_moe(output, packed_seq_params, mbs)
        )

    # ---------------------------------------------------------------- GPTModel
    def postprocess_kwargs(
        self, padding_mask: Any, output_processor: Any, output_processor_context: Any
    ) -> dict[str, Any]:
        """The keyword arguments ``GPTModel.forward`` gives ``_postprocess`` beyond 0.16's."""
        if not self.at_least(18):
            return {}
        return dict(
            padding_mask=padding_mask,
            output_processor=output_processor,
            output_processor_context=output_processor_context,
        )

    # ---------------------------------------------------------------- multi-token prediction
    def mtp_inner_layer(self, mtp_layer: Any) -> Any:
        """The transformer layer inside an MTP layer."""
        return mtp_layer.mtp_model_layer if self.at_least(17) else mtp_layer.transformer_layer

    def mtp_embeddings(
        self,
        mtp_layer: Any,
        input_ids: Any,
        position_ids: Any,
        embedding: Any,
        hidden: torch.Tensor,
        packed_seq_params: Any,
        padding_mask: Any,
    ) -> tuple[Any, Any, Any, torch.Tensor, torch.Tensor]:
        """``_get_embeddings``: (input ids, position ids, padding mask, decoder input, hidden),
        the ids (and, from 0.18, the mask) rolled one token on; before 0.18 the MTP layer's
        transformer layer gets no padding mask."""
        if not self.at_least(18):
            ids, positions, decoder_input, hidden = mtp_layer._get_embeddings(
                input_ids=input_ids,
                position_ids=position_ids,
                embedding=embedding,
                hidden_states=hidden,
                packed_seq_params=packed_seq_params,
            )
            return ids, positions, None, decoder_input, hidden  # no mask reaches the layer
        return mtp_layer._get_embeddings(
            input_ids=input_ids,
            position_ids=position_ids,
            embedding=embedding,
            hidden_states=hidden,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )

    # ---------------------------------------------------------------- MoE bookkeeping
    def moe_metric_values(self) -> dict[str, torch.Tensor]:
        """The per-layer value tensors of the MoE metrics (aux losses) logged so far."""
        if self.at_least(18):
            from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

            return {name: entry.values for name, entry in get_moe_metrics_tracker().metrics.items()}
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        return {name: entry["values"] for name, entry in tracker.items()}

    def update_expert_bias(self, chunks: list[Any], config: Any) -> None:
        """What ``finalize_model_grads`` does for the router after the gradients are reduced:
        the expert-bias update (all-reduce of the token counts over TPxDPxCP), 0.19's
        quantile-balancing bias update (over DPxCP) and the reset of the per-step counters
        (token counts, global aux-loss counts, quantile sums)."""
        import importlib

        # the module, not the function of the same name the package re-exports
        finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

        from megatron.core import parallel_state

        if config.moe_router_enable_expert_bias:
            if self.at_least(18):
                group = parallel_state.get_tensor_and_data_parallel_group(
                    with_context_parallel=True
                )
                finalize._update_router_expert_bias(chunks, config, tp_dp_cp_group=group)
            else:
                finalize._update_router_expert_bias(chunks, config)
        if config.moe_router_load_balancing_type == "quantile_balancing":  # 0.19's own bias
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            finalize._update_router_qb_beta(chunks, config, dp_cp_group=group)
        finalize.reset_model_temporary_tensors(config, chunks)
