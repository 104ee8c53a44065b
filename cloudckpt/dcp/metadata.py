"""DCP's ``.metadata`` read safely, and the checksums cloudckpt keeps beside it.

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``. Plain
``pickle.load`` of an untrusted file runs whatever code it names, so :func:`read_metadata` never
hands it to ``pickle``: :mod:`cloudckpt.dcp.unpickle` parses the opcodes into inert nodes,
calling nothing, and :mod:`cloudckpt.dcp.metadata_build` makes the objects from them. Only the
classes such a file holds are admitted: DCP's metadata classes (``Metadata``,
``TensorStorageMetadata``, ``BytesStorageMetadata``, ``ChunkStorageMetadata``,
``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, the memory-format enum),
``filesystem._StorageInfo``, ``torch.Size``, torch dtypes and layouts, ``collections.OrderedDict``
and ``pathlib`` paths (``FileSystemWriter`` records its folder as one), plus plain data. Any
other global (``os.system``, ``builtins.eval``, a class of another package) raises
:class:`~cloudckpt.errors.ManifestError` before anything is built. Each object is made by its
class's constructor from fields checked first (names its dataclass declares, of the declared
types); nothing is set on a class or on an object the reader did not just make. Reading is
bounded before anything exists: the file's size (``MAX_METADATA_BYTES``), nesting
(``MAX_DEPTH``), values counted as a tree (``NODES_PER_BYTE``: a value shared through the memo
counts each time it is used, so hashing a key is bounded too) and memory (``MEMORY_PER_BYTE``).
The result is then checked field by field (:func:`check_metadata`): types, chunk boxes inside
their tensor, file names that stay inside the checkpoint, offsets and lengths that are whole
numbers.

The checksums file (``.metadata.checksums``, or ``__<rank>.metadata.checksums`` beside a
rank-local ``__<rank>.metadata``), written by :class:`cloudckpt.dcp.StorageWriter` before
``.metadata``: DCP's metadata has no place for checksums, and the data files stay byte for byte
what DCP's readers expect, so the crc32c values live in a file of their own. It holds, framed
by its own crc32c: the save id, the checksum block size, the crc32c and size of the
``.metadata`` it goes with, and for every item (file, offset, length) where the tensor's bytes
start and the crc32c of each block of the item. A reader uses it only when the ``.metadata``
it read has exactly that crc32c and size; a checksums file of another save (the prefix was
written again by another writer) is ignored with a warning, and a checkpoint without one (written
by ``FileSystemWriter``, s3torchconnector, fsspec) loads without checksums.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import msgpack

from cloudckpt.checksum import crc32c
from cloudckpt.errors import ConfigError, ManifestError

METADATA_KEY = ".metadata"
CHECKSUMS_SUFFIX = ".checksums"
CHECKSUMS_FORMAT = "cloudckpt.dcp-checksums"
_MAGIC = b"\xc1dcpcrc\n"
_HEAD = struct.Struct("<8sI")
#: The most bytes a ``.metadata`` or checksums file may have; larger ones are refused unread.
MAX_METADATA_BYTES = 512 << 20

#: Decoding a ``.metadata`` may take at most this many bytes of memory per byte of the file (an
#: estimate covering the parse's nodes, stack and memo; a DCP writer's file needs about 23), plus
#: ``_MEMORY_FLOOR``; a file asking for more is refused while it is parsed. The objects built
#: from the nodes then take about what ``pickle.loads`` would (some 13 bytes per byte).
MEMORY_PER_BYTE = 48
_MEMORY_FLOOR = 4 << 20
#: Most values a ``.metadata`` may hold per byte of its size, counted as a tree (a value shared
#: through the pickle's memo counts each time it is used), plus ``_NODES_FLOOR``.
NODES_PER_BYTE = 2
_NODES_FLOOR = 1 << 16
#: Deepest nesting of values in a ``.metadata`` (DCP's own nest about 10 deep).
MAX_DEPTH = 64


def metadata_key(rank: int | None = None) -> str:
    """``.metadata``, or ``__<rank>.metadata`` (a rank-local one, ``use_collectives=False``)."""
    return METADATA_KEY if rank is None else f"__{rank}{METADATA_KEY}"


def checksums_key(rank: int | None = None) -> str:
    return metadata_key(rank) + CHECKSUMS_SUFFIX


def unpickle_metadata(data) -> object:
    """The object a ``.metadata`` pickle holds, parsed by :mod:`cloudckpt.dcp.unpickle` within
    the bounds above and built by :mod:`cloudckpt.dcp.metadata_build` (module doc). A global
    outside the allow-list, a shape DCP's classes do not have, bytes that are not a pickle or
    a file over a bound raise ``ManifestError`` before anything is built."""
    from cloudckpt.dcp.metadata_build import build, resolve
    from cloudckpt.dcp.unpickle import parse

    size = memoryview(data).nbytes
    if size > MAX_METADATA_BYTES:
        raise ManifestError(
            f"is {size} bytes, more than the {MAX_METADATA_BYTES} allowed", path=METADATA_KEY
        )
    nodes = parse(
        data,
        resolve,
        where=METADATA_KEY,
        max_depth=MAX_DEPTH,
        max_nodes=_NODES_FLOOR + NODES_PER_BYTE * size,
        max_cost=_MEMORY_FLOOR + MEMORY_PER_BYTE * size,
    )
    return build(nodes)


def read_metadata(data):
    """Unpickle (restricted) and check a ``.metadata``; returns the ``Metadata``."""
    metadata = unpickle_metadata(data)
    check_metadata(metadata)
    return metadata


_MISSING = object()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_metadata(md) -> None:
    """Raise ``ManifestError`` naming the first field of ``md`` that a DCP ``Metadata`` written
    by a DCP writer would not have (module doc). Safe on any object: one made bare (without
    its fields) is refused, not an ``AttributeError``."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    from cloudckpt.dcp.metadata_build import MAX_NDIM
    from cloudckpt.statedict.torch_private import storage_info_class

    _StorageInfo = storage_info_class()

    def bad(what: str, path: str):
        return ManifestError(what, path=f".metadata {path}".rstrip())

    def get(obj, name: str, where: str):
        value = getattr(obj, name, _MISSING)
        if value is _MISSING:
            raise bad(f"has no field {name!r} (an object made without its fields)", where)
        return value

    def box(v: object) -> TypeGuard[Sequence[int]]:
        return (
            isinstance(v, (torch.Size, tuple, list))
            and len(v) <= MAX_NDIM
            and all(_is_int(x) and x >= 0 for x in v)
        )

    if not isinstance(md, Metadata):
        raise bad(f"holds a {type(md).__name__}, not a DCP Metadata", "")
    entries = get(md, "state_dict_metadata", "")
    if not isinstance(entries, dict):
        raise bad("is not a dict", "state_dict_metadata")
    meta = get(md, "storage_meta", "")
    if meta is not None and not isinstance(meta, StorageMeta):
        raise bad(f"is a {type(meta).__name__}, not a StorageMeta", "storage_meta")
    for fqn, entry in entries.items():
        where = f"state_dict_metadata[{fqn!r:.80}]"
        if not isinstance(fqn, str):
            raise bad("key is not a str", where)
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise bad(f"is a {type(entry).__name__}", where)
        size, chunks = get(entry, "size", where), get(entry, "chunks", where)
        if (
            not isinstance(size, torch.Size)
            or not box(size)
            or not isinstance(chunks, list)
            or not isinstance(getattr(get(entry, "properties", where), "dtype", None), torch.dtype)
        ):
            raise bad("malformed tensor entry (size, chunks, dtype)", where)
        for i, chunk in enumerate(chunks):
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if (
                not box(offsets)
                or not box(sizes)
                or not len(offsets) == len(sizes) == len(size)
                or not all(o + s <= n for o, s, n in zip(offsets, sizes, size))
            ):
                raise bad("chunk box outside the tensor", f"{where}.chunks[{i}]")
    storage_data = get(md, "storage_data", "")
    if not isinstance(storage_data, dict):
        raise bad("is not a dict", "storage_data")
    for index, info in storage_data.items():
        where = f"storage_data[{getattr(index, 'fqn', index)!r:.80}]"
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
            raise bad("key is not a MetadataIndex", where)
        offset = getattr(index, "offset", None)
        if offset is not None and not box(offset):
            raise bad("key's offset is not whole numbers", where)
        if not isinstance(info, _StorageInfo):
            raise bad(f"is a {type(info).__name__}, not a _StorageInfo", where)
        offset, length = get(info, "offset", where), get(info, "length", where)
        if not _is_int(offset) or not _is_int(length) or offset < 0 or length < 0:
            raise bad("offset and length must be whole numbers", where)
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (
            isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
        ):
            raise bad("transform_descriptors must be strings", where)
        check_file_name(get(info, "relative_path", where), where)


def check_file_name(name, where: str) -> None:
    """A data file name must stay inside the checkpoint: relative, no ``..``, no empty part."""
    from cloudckpt.storage.base import check_key

    try:
        if not isinstance(name, str):
            raise ConfigError("not a str")
        check_key(name)
    except ConfigError as exc:
        raise ManifestError(
            f"data file name {name!r:.80} leaves the checkpoint or is malformed",
            path=f".metadata {where}",
        ) from exc


# -- the checksums file ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ItemChecksums:
    """What the checksums file says about one item: its length, where the tensor's bytes start
    in it (``data_offset``; for a non-tensor item, 0) and one crc32c per block of the item."""

    length: int
    data_offset: int
    crcs: tuple[int, ...]


@dataclass(frozen=True)
class Checksums:
    """The checksums file: save id, block size, the ``.metadata`` it belongs to, and the items
    by ``(file, offset)``."""

    save_id: str
    block_size: int
    metadata_crc32c: int
    metadata_size: int
    items: dict

    def matches(self, metadata_bytes) -> bool:
        return (
            len(metadata_bytes) == self.metadata_size
            and crc32c(metadata_bytes) == self.metadata_crc32c
        )


def encode_checksums(c: Checksums) -> bytes:
    items = [
        [path, offset, it.length, it.data_offset, struct.pack(f"<{len(it.crcs)}I", *it.crcs)]
        for (path, offset), it in c.items.items()
    ]
    payload = msgpack.packb(
        {
            "format": CHECKSUMS_FORMAT,
            "version": 1,
            "save_id": c.save_id,
            "block_size": c.block_size,
            "metadata_crc32c": c.metadata_crc32c,
            "metadata_size": c.metadata_size,
            "items": items,
        },
        use_bin_type=True,
    )
    return _HEAD.pack(_MAGIC, crc32c(payload)) + payload


def decode_checksums(data) -> Checksums:
    """Check the frame and every field; ``ManifestError`` naming the checksums file otherwise."""
    where = METADATA_KEY + CHECKSUMS_SUFFIX
    mv = memoryview(data).cast("B")
    if len(mv) < _HEAD.size or bytes(mv[:8]) != _MAGIC:
        raise ManifestError("not a cloudckpt DCP checksums file", path=where)
    _, stored = _HEAD.unpack_from(mv)
    payload = mv[_HEAD.size :]
    if crc32c(payload) != stored:
        raise ManifestError("checksum mismatch: the file is damaged", path=where)
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if (
            not isinstance(doc, dict)
            or doc.get("format") != CHECKSUMS_FORMAT
            or doc.get("version") != 1
        ):
            raise ValueError("unknown format or version")
        block = doc["block_size"]
        if not _is_int(block) or block <= 0:
            raise ValueError("bad block size")
        items = {}
        for path, offset, length, data_offset, raw in doc["items"]:
            if (
                not all(_is_int(v) and v >= 0 for v in (offset, length, data_offset))
                or not isinstance(path, str)
                or not isinstance(raw, bytes)
                or len(raw) != 4 * max(1, math.ceil(length / block))
                or data_offset > length
            ):
                raise ValueError(f"bad item entry for {path!r:.80}")
            items[(path, offset)] = ItemChecksums(
                length, data_offset, struct.unpack(f"<{len(raw) // 4}I", raw)
            )
        return Checksums(
            save_id=str(doc["save_id"]),
            block_size=block,
            metadata_crc32c=int(doc["metadata_crc32c"]),
            metadata_size=int(doc["metadata_size"]),
            items=items,
        )
    except (KeyError, TypeError, ValueError) as exc:  # msgpack errors are ValueErrors
        raise ManifestError(f"malformed ({exc})", path=where) from exc
