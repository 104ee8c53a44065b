"""The bytes of one DCP item, as ``FileSystemWriter`` lays them out, without copying tensors.

DCP's ``FileSystemWriter`` stores each tensor item as the output of ``torch.save(tensor)`` (a
zip archive: a small pickle, then the tensor's storage bytes as one record aligned to 64 bytes,
then the zip directory) and each non-tensor item as the bytes its planner produced (a
``torch.save`` of the value). Items follow each other in a data file; ``_StorageInfo`` says
where (offset, length).

Contract:
- :func:`tensor_item` gives the item of a tensor as three segments: the archive up to the
  storage record, the tensor's own memory (no copy for a contiguous CPU tensor that owns its
  whole storage; any other tensor is first copied into one that does), and the rest of the
  archive. ``torch.load(weights_only=True)`` of their concatenation gives the tensor back: the
  archive is the one ``torch.save`` writes (made by ``torch.save`` itself, under
  ``torch.serialization.skip_data``), except that the zip's CRC-32 field of the storage record
  is 0, as with ``torch.serialization.set_crc32_options(False)`` (torch does not check it;
  integrity comes from cloudckpt's crc32c blocks). ``data_offset`` says where the tensor's
  bytes start.
- :func:`block_crcs_of` is the crc32c of each ``block`` bytes of an item, counted from the
  item's first byte (the last block may be shorter; an empty item has one block, crc 0).
- :func:`region_span` maps a box of a stored chunk to the byte span holding it.
- :func:`load_tensor` reads an item's bytes back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cloudckpt.checksum import crc32c
from cloudckpt.errors import IntegrityError


@dataclass(frozen=True)
class Item:
    """The bytes of one item as segments (concatenated they are the item), where the tensor's
    own bytes start inside it, and the object keeping the segments' memory alive."""

    segments: tuple[memoryview, ...]
    data_offset: int
    data_length: int
    keep: object = None

    @property
    def length(self) -> int:
        return sum(len(s) for s in self.segments)


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor's memory (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray(0))
    flat = t.detach().as_strided((t.numel(),), (1,))
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy().data.cast("B")


def owns_its_storage(t: torch.Tensor) -> bool:
    """Whether ``torch.save(t)`` would write exactly ``t``'s values in row-major order: a dense
    contiguous CPU tensor, no lazy conjugate or negative bit, alone in its whole storage."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it owns its storage (see :func:`owns_its_storage`), otherwise a CPU copy
    that does."""
    t = t.detach()
    if owns_its_storage(t):
        return t
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
    out.copy_(t.resolve_conj().resolve_neg())
    return out


class _SplitWriter(io.RawIOBase):
    """A write-only stream that keeps what ``torch.save`` writes under ``skip_data`` and records
    where it skips (seeks forward over) the storage bytes."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.holes: list[tuple[int, int]] = []  # (position, length)
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b) -> int:
        data = bytes(b)
        self.parts.append(data)
        self.pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = offset if whence == io.SEEK_SET else self.pos + offset
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or target < self.pos:
            raise io.UnsupportedOperation("only forward seeks")
        if target > self.pos:
            self.holes.append((self.pos, target - self.pos))
            self.parts.append(b"")  # marks the hole's place among the parts
        self.pos = target
        return self.pos


def tensor_item(t: torch.Tensor) -> Item:
    """The item of tensor ``t`` (module doc). ``t`` may be any tensor: one that does not own its
    storage, or is not on the CPU, is copied first (the caller bounds how many such copies live
    at once)."""
    t = compact(t)
    nbytes = t.numel() * t.element_size()
    data = byte_view(t)
    split = _SplitWriter()
    skip = getattr(torch.serialization, "skip_data", None)
    if skip is not None:
        with skip():
            # torch.save takes any writable, seekable binary file; its stub says IO[bytes]
            torch.save(t, split)  # type: ignore[arg-type]
    if (
        skip is None
        or len(split.holes) > 1
        or (split.holes and split.holes[0][1] != nbytes)
        or (nbytes and not split.holes)
    ):
        # an archive layout this code does not know: let torch.save copy the bytes
        buf = io.BytesIO()
        torch.save(t, buf)
        return Item(segments=(buf.getbuffer(),), data_offset=0, data_length=0, keep=buf)
    if not split.holes:  # an empty tensor: no storage bytes to skip
        blob = b"".join(split.parts)
        return Item(segments=(memoryview(blob),), data_offset=len(blob), data_length=0, keep=t)
    at = split.parts.index(b"")
    head = b"".join(split.parts[:at])
    tail = b"".join(split.parts[at + 1 :])
    return Item(
        segments=(memoryview(head), data, memoryview(tail)),
        data_offset=len(head),
        data_length=nbytes,
        keep=t,
    )


def bytes_item(buf: io.BytesIO | bytes | bytearray | memoryview) -> Item:
    """The item of a non-tensor value: the bytes the planner serialized, as they are."""
    view = buf.getbuffer() if isinstance(buf, io.BytesIO) else memoryview(buf)
    return Item(segments=(view.cast("B"),), data_offset=0, data_length=0, keep=buf)


def block_crcs_of(segments: Sequence[memoryview], block: int) -> list[int]:
    """crc32c of each ``block`` bytes of the concatenation of ``segments`` (no copy)."""
    total = sum(len(s) for s in segments)
    if total == 0:
        return [0]
    crcs: list[int] = []
    value, filled = 0, 0
    for seg in segments:
        pos = 0
        while pos < len(seg):
            take = min(block - filled, len(seg) - pos)
            value = crc32c(seg[pos : pos + take], value)
            filled += take
            pos += take
            if filled == block:
                crcs.append(value)
                value, filled = 0, 0
    if filled:
        crcs.append(value)
    return crcs


def region_span(
    sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], itemsize: int
) -> tuple[int, int, bool]:
    """``(start, end, contiguous)``: the bytes of a row-major chunk of ``sizes`` that hold the
    box at ``offsets`` of ``lengths`` lie in ``[start, end)``; ``contiguous`` when they are
    exactly the box's bytes in row-major order. An empty box gives ``(0, 0, True)``."""
    if any(n == 0 for n in lengths):
        return 0, 0, True
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(sizes[d + 1])
    first = sum(int(o) * s for o, s in zip(offsets, strides))
    last = sum((int(o) + int(n) - 1) * s for o, n, s in zip(offsets, lengths, strides))
    count = math.prod(int(n) for n in lengths)
    return first * itemsize, (last + 1) * itemsize, last + 1 - first == count


def load_tensor(data, what: str) -> torch.Tensor:
    """The tensor an item's bytes hold (``torch.load(weights_only=True)``, on the CPU); anything
    else raises :class:`~cloudckpt.errors.IntegrityError` naming ``what``."""
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise IntegrityError(
            f"{what}: its bytes are not a tensor torch.load can read "
            f"({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc
    if not isinstance(value, torch.Tensor):
        raise IntegrityError(f"{what}: holds a {type(value).__name__}, not a tensor")
    return value
