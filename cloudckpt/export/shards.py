"""Planning a Hugging Face safetensors export before any data is read. Pure (no I/O, no torch).

From the tensors' names, dtypes and shapes (all in the manifest) this computes every output
file, its complete header and where each tensor's bytes go, then cuts each file's data into
read windows of bounded size.

Contract:
- :func:`plan_shards`: tensors keep the order given. A file takes tensors while their data stays
  within ``max_shard_bytes``; a tensor larger than that alone fills a file (as
  ``huggingface_hub`` does). One file is named ``model.safetensors``; ``n > 1`` files are
  ``model-00001-of-0000n.safetensors`` ... and :meth:`ShardPlan.index` is the
  ``model.safetensors.index.json`` document (``metadata.total_size``, ``weight_map``).
- :func:`contiguous_boxes`: boxes of a tensor, in memory order, each a contiguous run of its
  C-order bytes of at most ``max_bytes`` (one element at least), together covering it exactly
  once.
- :func:`plan_windows`: a file's data as consecutive windows; each window's pieces, placed at
  8-byte aligned offsets in a buffer of ``window_bytes``, are the file's bytes in order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from cloudckpt.hf.header import ITEMSIZE, Header, build_header, safetensors_dtype

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SLOT_ALIGN = 8


@dataclass(frozen=True, slots=True)
class ExportTensor:
    """One tensor to write: ``name`` in the file, ``source`` its name in the checkpoint, the
    ``dtype`` (torch name) and shape it is written with."""

    name: str
    source: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[safetensors_dtype(self.dtype)]


@dataclass(frozen=True)
class ShardFile:
    """One output file: its name, tensors (in data order), header bytes and parsed header."""

    name: str
    tensors: tuple[ExportTensor, ...]
    header_bytes: bytes
    header: Header

    @property
    def size(self) -> int:
        return self.header.file_size


@dataclass(frozen=True)
class ShardPlan:
    files: tuple[ShardFile, ...]

    @property
    def total_size(self) -> int:
        """Bytes of tensor data in all files (the index's ``total_size``)."""
        return sum(f.header.data_size for f in self.files)

    def index(self) -> dict:
        """The ``model.safetensors.index.json`` document."""
        return {
            "metadata": {"total_size": self.total_size},
            "weight_map": {t.name: f.name for f in self.files for t in f.tensors},
        }


def plan_shards(
    tensors: Sequence[ExportTensor], max_shard_bytes: int, metadata: Mapping[str, str] | None = None
) -> ShardPlan:
    """The files of an export of ``tensors`` (see module doc). ``ValueError`` for a
    non-positive ``max_shard_bytes``; header errors as :func:`build_header`."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    groups: list[list[ExportTensor]] = []
    used = 0
    for t in tensors:
        n = t.nbytes
        if not groups or (groups[-1] and used + n > max_shard_bytes):
            groups.append([])
            used = 0
        groups[-1].append(t)
        used += n
    count = len(groups)
    files = []
    for i, group in enumerate(groups):
        name = SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        raw, header = build_header([(t.name, t.dtype, t.shape) for t in group], metadata)
        files.append(ShardFile(name, tuple(group), raw, header))
    return ShardPlan(tuple(files))


def contiguous_boxes(
    shape: Sequence[int], itemsize: int, max_bytes: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` boxes of a C-contiguous tensor of ``shape`` (see module doc)."""
    shape = tuple(shape)
    if math.prod(shape) * itemsize <= max_bytes or 0 in shape:
        yield (0,) * len(shape), shape
        return
    # the first dim k whose trailing block fits: dims before k-1 go one index at a time,
    # dim k-1 in runs of as many trailing blocks as fit
    k = len(shape)
    while k > 0 and math.prod(shape[k - 1 :]) * itemsize <= max_bytes:
        k -= 1
    block = math.prod(shape[k:]) * itemsize
    run = max(1, max_bytes // block)
    lead = shape[: k - 1]
    for index in _indices(lead):
        for a in range(0, shape[k - 1], run):
            n = min(run, shape[k - 1] - a)
            yield index + (a,) + (0,) * (len(shape) - k), (1,) * len(lead) + (n,) + shape[k:]


def _indices(dims: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    if not dims:
        yield ()
        return
    for i in range(dims[0]):
        for rest in _indices(dims[1:]):
            yield (i,) + rest


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of one tensor of a file, to read into bytes ``[slot, slot + nbytes)`` of the
    window buffer; ``tensor`` is its position in the file's tensors."""

    tensor: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    slot: int
    nbytes: int


def plan_windows(shard: ShardFile, window_bytes: int) -> Iterator[tuple[Piece, ...]]:
    """A file's data as windows of pieces (see module doc). ``window_bytes`` must hold one
    element of every dtype (16 bytes at least)."""
    if window_bytes < 16:
        raise ValueError(f"window_bytes must be at least 16, got {window_bytes}")
    window: list[Piece] = []
    cursor = 0
    for i, t in enumerate(shard.tensors):
        itemsize = ITEMSIZE[safetensors_dtype(t.dtype)]
        for offsets, sizes in contiguous_boxes(t.shape, itemsize, window_bytes):
            n = math.prod(sizes) * itemsize
            if n == 0:
                continue
            slot = -(-cursor // _SLOT_ALIGN) * _SLOT_ALIGN
            if window and slot + n > window_bytes:
                yield tuple(window)
                window, slot = [], 0
            window.append(Piece(i, offsets, sizes, slot, n))
            cursor = slot + n
    if window:
        yield tuple(window)
