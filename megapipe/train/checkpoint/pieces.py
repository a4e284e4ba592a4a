"""A tensor of which this rank holds only element ranges, as torch.distributed.checkpoint sees it.

The distributed optimizer keeps, per parameter, the Adam moments (and bf16 main weights) of the
elements inside its shards: a range ``lo..hi`` of the parameter *flattened*, which rarely is a
rectangular block of its shape. DCP stores and reshards rectangular chunks, so a range is cut
into the few row-major boxes that tile it (``flat_boxes``: a partial first row, whole rows, a
partial last row, recursively), each a view of the range's memory. ``PieceTensor`` hands those
boxes to DCP under the parameter's layout-free key, with the parameter's full shape: a
checkpoint written by a sharded optimizer is the same checkpoint an unsharded one writes, and
loads into any other dp size, sharded or not.

``PieceTensor`` implements DCP's checkpoint-object protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``; torch's own ``DTensor`` and
``LocalShardsWrapper`` implement the same three methods). torch's ``ShardedTensor`` would do as
well but is deprecated and needs every rank's chunks up front; a ``DTensor`` shards a dimension
evenly, not arbitrary ranges.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[Box]:
    """The row-major boxes that tile elements ``lo..hi`` of a tensor of ``shape`` flattened, in
    order; each box is contiguous in memory."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return [
            ((first, *off), (1, *size))
            for off, size in flat_boxes(shape[1:], lo - first * inner, hi - first * inner)
        ]
    whole_lo, whole_hi = -(-lo // inner), hi // inner
    out = flat_boxes(shape, lo, whole_lo * inner) if lo % inner else []
    if whole_hi > whole_lo:
        out.append(((whole_lo, *(0,) * (len(shape) - 1)), (whole_hi - whole_lo, *shape[1:])))
    if hi % inner:
        out += flat_boxes(shape, whole_hi * inner, hi)
    return out


def _flat_offset(shape: Sequence[int], offsets: Sequence[int]) -> int:
    offset, stride = 0, 1
    for size, at in zip(reversed(shape), reversed(offsets)):
        offset += at * stride
        stride *= size
    return offset


class PieceTensor(torch.Tensor):
    """Elements ``lo..hi`` (flattened) of a tensor of ``shape``, held in the 1-D ``values``
    (a view: loading writes into it); see the module docstring."""

    _boxes: list[tuple[torch.Size, torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], lo: int, hi: int, values: torch.Tensor) -> PieceTensor:
        if values.dim() != 1 or values.numel() != hi - lo:
            raise ValueError(
                f"values must be 1-D with {hi - lo} elements, got {tuple(values.shape)}"
            )
        out = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=values.dtype, device=values.device
        )
        out._boxes = []
        for offsets, sizes in flat_boxes(shape, lo, hi):
            start = _flat_offset(shape, offsets) - lo
            view = values[start : start + math.prod(sizes)].view(sizes)
            out._boxes.append((torch.Size(offsets), view))
        return out

    @classmethod
    # torch's stub types Tensor's as a plain function; a subclass defines it as this classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ):
        raise NotImplementedError(
            f"PieceTensor is a checkpoint entry only; {func} is not defined on it"
        )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self._boxes[0][1])
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.size()),
                    properties=properties,
                    size=self.size(),
                ),
            )
            for offsets, view in self._boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=offsets, sizes=view.size())
            for offsets, view in self._boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self._boxes:
            if offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: this rank holds no chunk at {index.offset}")

    def copy_pieces_from(self, other: PieceTensor) -> None:
        """Copy ``other``'s boxes (the same ranges) into this one's memory."""
        for (offsets, view), (their_offsets, theirs) in zip(self._boxes, other._boxes):
            if offsets != their_offsets:
                raise ValueError("two copies of a checkpoint entry hold different ranges")
            view.copy_(theirs)

    # the default would run ops on the wrapper; Tensor's tensor_contents= has none to show here
    def __repr__(self) -> str:  # type: ignore[override]
        return f"PieceTensor(shape={tuple(self.shape)}, boxes={len(self._boxes)})"
