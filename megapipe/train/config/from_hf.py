"""``--load-hf DIR``: the model flags the command line did not give are the directory's.

A published checkpoint's ``config.json`` already states the model, so a user continuing from it
gives only what differs from megapipe's defaults elsewhere (data, parallelism, schedule). The
flags the command line gave are kept: ``checkpoint.resume.check_hf_model`` then refuses, in one
line naming the flag and both values, any that describe another model. The model's vocabulary is
the directory's ``vocab_size`` (the tokenizer must fit in it), not the tokenizer's padded size.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from megapipe.train.config.declare import ArgsError
from megapipe.train.config.flags import PretrainFlags

if TYPE_CHECKING:
    from megapipe.models.config import GPTConfig


def model_flags(model: GPTConfig) -> dict[str, Any]:
    """The model flags (``PretrainFlags`` fields) that give ``model``."""
    if model.first_k_dense_layers == 0 or model.num_experts == 0:
        layer_freq = str(model.moe_layer_freq)
    else:
        pattern = ",".join("1" if model.is_moe_layer(i) else "0" for i in range(model.num_layers))
        layer_freq = f"[{pattern}]"
    values: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        num_experts=model.num_experts,
        moe_layer_freq=layer_freq,
        position_embedding_type=model.position_embedding_type,
        rotary_base=model.rotary_base,
        group_query_attention=True,
        num_query_groups=model.query_groups,
        qk_layernorm=model.qk_layernorm,
        qk_layernorm_scope=model.qk_layernorm_scope,
        kv_channels=model.head_dim,
        norm_epsilon=model.norm_eps,
        untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
    )
    if model.num_experts:
        values.update(
            moe_router_topk=model.moe_top_k, moe_ffn_hidden_size=model.moe_ffn_hidden_size
        )
    return values


def flags_from_hf(
    flags: PretrainFlags, given: frozenset[str] | None
) -> tuple[PretrainFlags, GPTConfig]:
    """``flags`` with the model flags not ``given`` (None: all were) taken from ``--load-hf``'s
    ``config.json``, and that model; ArgsError (one line) for a directory megapipe cannot
    read or mirror."""
    from megapipe.hf.load_hf import hf_model_config  # torch: the ranks have not started yet

    assert flags.load_hf is not None
    try:
        model = hf_model_config(flags.load_hf, flags.seq_length)
    except ValueError as err:
        raise ArgsError(str(err)) from None
    if given is None:
        return flags, model
    taken = {name: value for name, value in model_flags(model).items() if name not in given}
    return dataclasses.replace(flags, **taken), model
