"""``--load-hf DIR``: a Qwen3-MoE, Mixtral or OLMoE directory (as transformers' ``save_pretrained``
or ``export-hf`` writes it, one ``model.safetensors`` or an index and its shards) back into a
``GPTConfig`` and the single-process state dict, which ``models.split.copy_into_stage`` copies
into the stages of any layout.

``hf_model_config`` reads ``config.json`` (the run checks it against its flags before any
process starts), ``check_hf_weights`` the weight files' headers; ``load_hf`` reads the weights
too, and with ``keep`` only the parameters one rank's stages hold (each tensor read from its
file when it is needed, so a rank never holds the whole model)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from megapipe.hf.architectures import Architecture, architecture_of, gpt_config_from_hf
from megapipe.hf.tensors import check_names, state_from_hf
from megapipe.models.config import GPTConfig


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as err:
            raise ValueError(
                f"--load-hf {directory}: {index.name} is not an index of weight "
                f"files ({type(err).__name__}: {err})"
            ) from None
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            raise ValueError(
                f"--load-hf {directory}: its index names {missing[0]}, which is not there"
            )
        return [directory / name for name in names]
    single = directory / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"--load-hf {directory}: no model.safetensors or its index")
    return [single]


def hf_model_config(directory: str | Path, seq_length: int | None = None) -> GPTConfig:
    """The ``GPTConfig`` of the directory's ``config.json``, after checking that its weight
    files are there; a ValueError (one line) for what megapipe cannot read or mirror.
    ``seq_length``: the training sequence length (default: its max_position_embeddings)."""
    return _read(Path(directory), seq_length)[0]


def check_hf_weights(directory: str | Path, seq_length: int | None = None) -> None:
    """A ValueError (one line) unless the weight files hold the tensors of the directory's model
    and no other (their headers only are read)."""
    _tensors(Path(directory), *_read(Path(directory), seq_length))


def _read(directory: Path, seq_length: int | None) -> tuple[GPTConfig, Architecture, list[Path]]:
    """``hf_model_config``'s config, its family and the weight files it found."""
    if not directory.is_dir():
        raise ValueError(f"--load-hf {directory} is not a directory")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--load-hf {directory}: no config.json")
    try:
        fields = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--load-hf {directory}: config.json is not JSON ({err})") from None
    try:
        config = gpt_config_from_hf(fields, seq_length)
    except KeyError as err:
        raise ValueError(f"--load-hf {directory}: config.json has no {err}") from None
    except ValueError as err:
        raise ValueError(f"--load-hf {directory}: {err}") from None
    return config, architecture_of(fields), _weight_files(directory)


def _tensors(
    directory: Path, config: GPTConfig, arch: Architecture, files: list[Path]
) -> _LazyTensors:
    """The files' tensors (headers read), checked to be the model's (``tensors.check_names``)."""
    try:
        tensors = _LazyTensors(files)
        check_names(config, arch, set(tensors))
    except ValueError as err:
        raise ValueError(f"--load-hf {directory}: {err}") from None
    return tensors


class _LazyTensors(Mapping[str, torch.Tensor]):
    """The directory's tensors by Hugging Face name, each read from its file when asked for."""

    def __init__(self, files: list[Path]) -> None:
        from safetensors import SafetensorError, safe_open

        handles = []
        for path in files:
            try:
                handles.append(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError) as err:
                raise ValueError(f"{path.name} is not a safetensors file ({err})") from None
        self._where = {name: handle for handle in handles for name in handle.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf(
    directory: str | Path, seq_length: int | None = None, keep: Callable[[str], bool] | None = None
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The config and single-process state dict (experts stacked) of a directory; with ``keep``
    only the parameters whose global names it keeps (a rank's stages), each read from its file
    when needed."""
    config, arch, files = _read(Path(directory), seq_length)
    tensors = _tensors(Path(directory), config, arch, files)
    return config, state_from_hf(config, arch, tensors, keep)
