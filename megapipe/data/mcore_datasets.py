"""Megatron-Core's data pipeline, imported once where it is needed, or one clear error.

megapipe writes and reads Megatron's indexed datasets with megatron-core's own classes
(``IndexedDatasetBuilder``, ``IndexedDataset``, ``GPTDataset``, ``BlendedMegatronDatasetBuilder``)
rather than a second implementation of the format. Where megatron-core is not installed, the
commands and functions that need it raise ``DataError`` saying so (exit status 2 on the command
line). Its import warns that TransformerEngine and Apex are absent, which says nothing about
the data pipeline, so those warnings are silenced.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

from megapipe.data.errors import DataError


def mcore_datasets(needed_by: str) -> SimpleNamespace:
    """The classes of ``megatron.core.datasets`` megapipe uses; ``needed_by`` names the caller
    in the error raised where megatron-core is missing."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
            from megatron.core.datasets.blended_megatron_dataset_builder import (
                BlendedMegatronDatasetBuilder,
            )
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
            from megatron.core.datasets.indexed_dataset import (
                DType,
                IndexedDataset,
                IndexedDatasetBuilder,
            )
    except ImportError as err:
        raise DataError(
            f"{needed_by} needs megatron-core's data pipeline, which is not installed "
            f"({err}; pip install -e '.[megatron]')"
        ) from None
    return SimpleNamespace(
        BlendedMegatronDatasetBuilder=BlendedMegatronDatasetBuilder,
        GPTDataset=GPTDataset,
        GPTDatasetConfig=GPTDatasetConfig,
        DType=DType,
        IndexedDataset=IndexedDataset,
        IndexedDatasetBuilder=IndexedDatasetBuilder,
    )
