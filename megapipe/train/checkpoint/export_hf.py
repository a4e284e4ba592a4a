"""``megapipe export-hf --load CKPT --out DIR``: a checkpoint of any layout as a Hugging Face
model directory (``config.json``, safetensors, tokenizer files): Qwen3-MoE, Mixtral or OLMoE,
whichever has the model's attention and router (``hf.export_config.export_architecture``).

Order: find the checkpoint and its config, refuse what that family cannot express (one line,
before reading any tensor), check every tensor the model needs is in the checkpoint with its
shape (and nothing else is), then write the weights shard by shard, each shard's checkpoint
tensors read on their own (``reader.read_tensors``) so the memory held is about one
shard. One shard is ``model.safetensors``; more are ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``. Weights keep the checkpoint's dtype (float32, or bfloat16
from a ``--bf16`` run).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megapipe.hf.export_config import export_architecture, hf_config
from megapipe.hf.tensors import HFTensor, tensor_sources
from megapipe.hf.tokenizer_files import HUGGING_FACE, check_tokenizer, write_tokenizer
from megapipe.train.checkpoint.reader import (
    TOKENIZER_KEY,
    config_of,
    find_checkpoint,
    read_tensors,
    tensor_shapes,
)

DEFAULT_SHARD_BYTES = 5 * 2**30


def _check_sources(sources: list[HFTensor], shapes: dict, path: Path) -> None:
    """Every source key present (and the row blocks inside it); no model key left over."""
    for item in sources:
        if item.source not in shapes:
            raise ValueError(
                f"{path} lacks {item.source}, which its model config needs (for {item.name})"
            )
        rows = shapes[item.source][0][0] if shapes[item.source][0] else 0
        if item.rows is not None and item.rows[1] > rows:
            raise ValueError(
                f"{path}: {item.source} has {rows} rows, its config needs {item.rows[1]}"
            )
    unused = sorted(set(shapes) - {item.source for item in sources})
    if unused:
        raise ValueError(
            f"{path} holds {unused[0]}, which its model config does not have "
            f"({len(unused)} such tensor(s))"
        )


def _nbytes(item: HFTensor, shapes: dict) -> int:
    shape, dtype = shapes[item.source]
    numel = torch.Size(shape).numel()
    if item.rows is not None:
        numel = numel // shape[0] * (item.rows[1] - item.rows[0])
    return numel * torch.empty((), dtype=dtype).element_size()


def _shards(sources: list[HFTensor], shapes: dict, limit: int) -> list[list[HFTensor]]:
    """The listed tensors cut, in order, into shards of at most ``limit`` bytes (a larger tensor
    alone)."""
    shards: list[list[HFTensor]] = [[]]
    size = 0
    for item in sources:
        n = _nbytes(item, shapes)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def _tokenizer_spec(descriptor_model: dict[str, Any], tokenizer_model: str | None) -> dict:
    if tokenizer_model is not None:
        return {"tokenizer_type": HUGGING_FACE, "tokenizer_model": tokenizer_model}
    spec = descriptor_model.get(TOKENIZER_KEY)
    if not isinstance(spec, dict):
        raise ValueError(
            f"the checkpoint names no tokenizer (descriptor model.{TOKENIZER_KEY}); "
            f"pass --tokenizer-model PATH"
        )
    return spec


def export_hf(
    load: str | Path,
    out: str | Path,
    tokenizer_model: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[str]:
    """Write the checkpoint ``load`` as a Hugging Face directory ``out``; returns the log
    lines."""
    from safetensors.torch import save_file

    checkpoint = find_checkpoint(load)
    config = config_of(checkpoint)
    arch = export_architecture(config)
    tokenizer = check_tokenizer(
        _tokenizer_spec(checkpoint.descriptor["model"], tokenizer_model), config.vocab_size
    )
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty directory")
    shapes = tensor_shapes(checkpoint.path)
    listed = tensor_sources(config, arch)
    _check_sources(listed, shapes, checkpoint.path)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, tokenizer)
    shards = _shards(listed, shapes, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map, total = {}, 0
    for shard, name in zip(shards, names):
        sources = read_tensors(checkpoint.path, {item.source for item in shard}, shapes)
        tensors = {item.name: item.make(sources[item.source]) for item in shard}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({item.name: name for item in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    dtype = shapes["model/embedding.tokens"][1]
    hf = hf_config(config, dtype, tokenizer.eos_token_id)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    moe = f"{config.num_experts} experts top-{config.moe_top_k}" if config.num_experts else "dense"
    return [
        f"export-hf: {checkpoint.path} (iteration {checkpoint.iteration}) -> {out}",
        f"  {arch.name}: {config.num_layers} layers, hidden {config.hidden_size}, {moe}, "
        f"{len(listed)} tensors "
        f"({total / 2**20:.2f} MiB, {str(dtype).removeprefix('torch.')}) in {len(shards)} file(s)",
        f"  tokenizer: {tokenizer.describe()}",
    ]
