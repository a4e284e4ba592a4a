"""The attention options (Megatron's flags): rope, grouped-query attention, QK norm, kv_channels,
tied embeddings; checked against a loop-by-loop reference written independently here."""

import json
import math

import pytest
import torch
from torch import nn

from megapipe.models.attention import CausalSelfAttention
from megapipe.models.config import CONFIG_VERSION, GPTConfig
from megapipe.models.split import build_stage

MODERN = dict(num_heads=4, num_query_groups=2, kv_channels=6, qk_layernorm=True,
              position_embedding_type="rope", rotary_base=500)


def _rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference(attn: CausalSelfAttention, config: GPTConfig, x: torch.Tensor) -> torch.Tensor:
    """Head by head, position by position: q k v from their rows of w_qkv, the per-head RMSNorm,
    rope as a complex rotation of channel pairs (j, j + d/2), query head i reading key/value
    group i // (heads / groups), causal softmax, then the output projection."""
    b, s, _ = x.shape
    heads, groups, d = config.num_heads, config.query_groups, config.head_dim
    w = attn.w_qkv.detach().double()
    xs = x.double()
    q_rows, k_rows = w[: heads * d], w[heads * d: (heads + groups) * d]
    v_rows = w[(heads + groups) * d:]
    half = d // 2
    theta = [config.rotary_base ** (-2 * j / d) for j in range(half)]

    def head(rows, n, norm, pos_x):
        t = pos_x @ rows[n * d:(n + 1) * d].T  # [s, d]
        if norm is not None:
            t = _rms(t, norm.weight.detach().double(), config.norm_eps)
        if config.position_embedding_type == "rope":
            z = torch.complex(t[:, :half], t[:, half:])
            angle = torch.tensor([[p * th for th in theta] for p in range(s)], dtype=torch.float64)
            z = z * torch.polar(torch.ones_like(angle), angle)
            t = torch.cat((z.real, z.imag), dim=-1)
        return t

    out = torch.zeros(b, s, heads * d, dtype=torch.float64)
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(b):
        for n in range(heads):
            g = n // (heads // groups)
            q = head(q_rows, n, attn.q_norm, xs[i])
            k = head(k_rows, g, attn.k_norm, xs[i])
            v = xs[i] @ v_rows[g * d:(g + 1) * d].T
            scores = q @ k.T / math.sqrt(d) + mask
            out[i, :, n * d:(n + 1) * d] = torch.softmax(scores, dim=-1) @ v
    return out @ attn.w_out.detach().double().T


@pytest.mark.parametrize("fields", [
    {}, MODERN, dict(MODERN, qk_layernorm=False),
    dict(MODERN, position_embedding_type="learned_absolute"),
    dict(MODERN, num_query_groups=None), dict(MODERN, num_query_groups=1, kv_channels=None),
], ids=["mha", "modern", "no_qk_norm", "no_rope", "mha_rope", "mqa"])
def test_attention_equals_the_head_by_head_reference(fields):
    config = GPTConfig(hidden_size=16, seq_length=7, **fields)
    attn = CausalSelfAttention(config, layer_index=2)
    if attn.q_norm is not None:  # norm weights away from 1, so each one shows
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
            attn.k_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(attn(x).double(), _reference(attn, config, x), rtol=1e-5, atol=1e-6)


def test_shapes_follow_heads_groups_and_kv_channels():
    config = GPTConfig(hidden_size=16, **MODERN)
    attn = CausalSelfAttention(config, layer_index=0)
    assert attn.w_qkv.shape == ((4 + 2 * 2) * 6, 16)
    assert attn.w_out.shape == (16, 4 * 6)
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (6,)
    assert "rotary_cos" not in attn.state_dict()  # tables are not checkpointed
    stage = build_stage(GPTConfig(**MODERN), 0, 1)
    assert stage.embedding.positions is None  # rope: no learned position table


def test_default_model_keeps_its_parameter_names():
    names = [n for n, _ in build_stage(GPTConfig(num_layers=2), 0, 1).named_parameters()]
    assert names[:2] == ["embedding.tokens", "embedding.positions"]
    assert names[-2:] == ["head.weight", "head.norm.weight"]
    assert not any("q_norm" in n or "k_norm" in n for n in names)


def test_tied_embeddings_share_one_weight_and_mark_the_copies():
    config = GPTConfig(num_layers=2, untie_embeddings_and_output_weights=False)
    single = build_stage(config, 0, 1)
    assert "head.weight" not in dict(single.named_parameters())
    ids = torch.randint(0, config.vocab_size, (2, 5))
    hidden = single.layers["1"](single.layers["0"](single.embedding(ids)))
    expected = torch.nn.functional.linear(single.head.norm(hidden), single.embedding.tokens)
    assert torch.equal(single(ids), expected)
    assert not hasattr(single.embedding.tokens, "shared_embedding")
    first, last = build_stage(config, 0, 2), build_stage(config, 1, 2)
    assert torch.equal(first.embedding.tokens, last.embedding.tokens)
    assert first.embedding.tokens.shared_embedding and last.embedding.tokens.shared_embedding
    assert last.embedding.tokens.shared and not hasattr(first.embedding.tokens, "shared")
    assert [n for n, _ in last.named_parameters()][0] == "embedding.tokens"  # layout-free key
    assert last.embedding.positions is None  # the last stage holds the token table only


@pytest.mark.parametrize("fields,message", [
    (dict(num_heads=4, num_query_groups=3), "num_query_groups=3 must divide num_heads=4"),
    (dict(num_query_groups=0), "num_query_groups must be a positive int or None, got 0"),
    (dict(kv_channels=-2), "kv_channels must be a positive int or None, got -2"),
    (dict(position_embedding_type="alibi"), "position_embedding_type='alibi' must be one of"),
    (dict(position_embedding_type="rope", kv_channels=5), "even head dim"),
    (dict(position_embedding_type="rope", rotary_base=0), "rotary_base must be > 0, got 0"),
])
def test_bad_attention_configs_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as caught:
        GPTConfig(**fields)
    assert "\n" not in str(caught.value)


def test_kv_channels_lifts_the_divisibility_rule():
    assert GPTConfig(hidden_size=30, num_heads=4, kv_channels=8).head_dim == 8


def test_config_dict_round_trips_through_json():
    from megapipe.moe.link import EmulatedLink

    config = GPTConfig(recompute_modules=("core_attn",), moe_link=EmulatedLink(1e9, 1e-3),
                       untie_embeddings_and_output_weights=False, **MODERN)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["version"] == CONFIG_VERSION and data["num_query_groups"] == 2
    assert GPTConfig.from_dict(data) == config
    older = {k: v for k, v in GPTConfig().to_dict().items() if k != "qk_layernorm"}
    assert GPTConfig.from_dict(older) == GPTConfig()  # a field not yet saved: its default
    with pytest.raises(ValueError, match="version 0; this megapipe reads version"):
        GPTConfig.from_dict(dict(data, version=0))
    with pytest.raises(ValueError, match="unknown field"):
        GPTConfig.from_dict(dict(data, heads=3))


def test_rotary_tables_follow_the_model_dtype():
    stage = build_stage(GPTConfig(num_layers=1, **MODERN), 0, 1)
    stage.to(torch.bfloat16)
    attn = stage.layers["0"].attention
    assert attn.rotary_cos.dtype == torch.bfloat16
    assert stage(torch.randint(0, 256, (1, 8))).dtype == torch.bfloat16
    assert isinstance(attn.q_norm, nn.RMSNorm)


def test_core_attention_recompute_is_bitwise_with_grouped_queries():
    """--recompute-modules core_attn re-runs the grouped core in backward: the same bits."""
    outs = []
    for modules in ((), ("core_attn",)):
        stage = build_stage(GPTConfig(num_layers=2, recompute_modules=modules, **MODERN), 0, 1)
        ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
        stage(ids[:, :-1]).logsumexp(-1).mean().backward()
        outs.append([p.grad for p in stage.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
