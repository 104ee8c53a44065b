"""The manifest data model: an immutable, validated index of one checkpoint.

Chunk fields live in flat numpy arrays (one entry per chunk, chunks grouped by tensor in tensor
order, coordinates chunk-major); :class:`ChunkRecord` objects are made only when asked for, so a
manifest of millions of chunks costs a few arrays, not millions of Python objects.

Every constructor call validates everything (see :func:`validate_object_key` and
``Manifest.__init__``); a violation raises :class:`~cloudckpt.errors.ManifestError` whose ``path``
says where, like ``tensors["w"].chunks[3]``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar, cast

import numpy as np
from numpy.typing import ArrayLike, NDArray

from cloudckpt.errors import ManifestError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_ELEMENTS
from cloudckpt.manifest.geometry import (
    check_boxes,
    check_no_shared_bytes,
    read_only,
    tensor_columns,
)
from cloudckpt.manifest.lineage import HASH_BYTES, check_lineage
from cloudckpt.manifest.records import (
    ManifestColumns,
    TensorMap,
    TensorRecord,
    shape_of,
)
from cloudckpt.manifest.validation import (
    tensor_path,
    validate_object_key,
    validate_structure,
)
from cloudckpt.manifest.values import AllowPickle, decode_value, value_path

_T = TypeVar("_T")

FORMAT_NAME = "cloudckpt"
#: The newest format version this cloudckpt writes: 3 for a manifest with incremental fields
#: (object homes, base, attempt, legacy 16-byte chunk hashes), 2 for any other, chunk hashes
#: included (so older readers read it).
FORMAT_VERSION = 3
#: Format versions this cloudckpt reads (1: no checksum; 2: framed with a crc32c; 3: 2 plus
#: the fields of incremental checkpoints, see :mod:`cloudckpt.manifest.lineage`).
SUPPORTED_VERSIONS = (1, 2, 3)
DEFAULT_CHECKSUM_BLOCK_SIZE = 4 << 20
MAX_CHECKSUM_BLOCK_SIZE = 1 << 40


def crc_counts(byte_length: NDArray[np.int64], block_size: int) -> NDArray[np.int64]:
    """Number of per-block crcs of chunks of these byte lengths (an empty chunk has one)."""
    counts: NDArray[np.int64] = np.maximum(1, (byte_length + (block_size - 1)) // block_size)
    return counts


class Manifest:
    """An immutable, validated manifest (build with :class:`ManifestBuilder` or this constructor).

    Constructor arguments are columnar: per tensor ``tensor_names``, ``tensor_dtypes``,
    ``tensor_shapes``, ``chunk_counts``; per chunk (tensor order) ``chunk_object_index``,
    ``chunk_byte_offset``, ``chunk_byte_length``; ``chunk_offsets`` / ``chunk_sizes`` flat,
    chunk-major (each chunk contributes its tensor's ndim numbers); ``chunk_crcs`` flat uint32,
    ``max(1, ceil(byte_length / checksum_block_size))`` per chunk. ``value_blobs`` maps names to
    :func:`~cloudckpt.manifest.encode_value` bytes; ``values`` (optional) the same values already
    decoded. Pickled values are decoded only if ``allow_pickle``. With ``tensor_ndims`` (the
    decoder's form), ``tensor_shapes`` is every shape's dims concatenated in one int array: no
    Python tuple is made until a shape is asked for. ``object_homes``, ``chunk_hashes`` (of
    ``chunk_hash_bytes`` bytes each), ``base`` and ``attempt``: see
    :mod:`cloudckpt.manifest.lineage`.

    ``checksums=False`` makes a manifest whose data carries no checksums: an index built in
    memory over a foreign format (safetensors files: :mod:`cloudckpt.hf`), never a cloudckpt
    checkpoint's. It needs ``checksum_block_size=0`` and no ``chunk_crcs``; reads of its data are
    not verified (every chunk's ``crc32c`` is ``()``). The codec never decodes one (stored
    manifests have no such field, and a stored ``checksum_block_size`` of 0 is refused) and
    refuses to encode one, so a checkpoint cannot lose its checksums by going through storage.
    """

    def __init__(
        self,
        *,
        world_size: int,
        created_at: float,
        cloudckpt_version: str,
        metadata: dict[str, Any],
        checksum_block_size: int,
        objects: Sequence[str],
        tensor_names: Sequence[str],
        tensor_dtypes: Sequence[str],
        tensor_shapes: Sequence[Sequence[int]] | NDArray[np.int64],
        chunk_counts: ArrayLike,
        chunk_offsets: ArrayLike,
        chunk_sizes: ArrayLike,
        chunk_object_index: ArrayLike,
        chunk_byte_offset: ArrayLike,
        chunk_byte_length: ArrayLike,
        chunk_crcs: ArrayLike,
        value_blobs: Mapping[str, bytes],
        values: Mapping[str, object] | None = None,
        structure: object = None,
        allow_pickle: AllowPickle = False,
        tensor_ndims: ArrayLike | None = None,
        object_homes: Iterable[str] | None = None,
        chunk_hashes: bytes | NDArray[np.uint8] | None = None,
        chunk_hash_bytes: int = HASH_BYTES,
        base: str = "",
        attempt: str = "",
        checksums: bool = True,
    ):
        if type(world_size) is not int or world_size < 1:
            raise ManifestError(
                f"world_size must be a positive int, got {world_size!r}", path="world_size"
            )
        if type(created_at) not in (int, float) or not math.isfinite(created_at):
            raise ManifestError(
                f"created_at must be a finite number, got {created_at!r}", path="created_at"
            )
        if type(cloudckpt_version) is not str:
            raise ManifestError("cloudckpt_version must be a string", path="cloudckpt_version")
        if type(metadata) is not dict:
            raise ManifestError("metadata must be a dict", path="metadata")
        if type(checksums) is not bool:
            raise ManifestError(
                f"checksums must be a bool, got {checksums!r:.40}", path="checksums"
            )
        if checksums and (
            type(checksum_block_size) is not int
            or not 0 < checksum_block_size <= MAX_CHECKSUM_BLOCK_SIZE
        ):
            raise ManifestError(
                f"bad checksum_block_size {checksum_block_size!r}", path="checksum_block_size"
            )
        if not checksums and (type(checksum_block_size) is not int or checksum_block_size != 0):
            raise ManifestError(
                "a manifest without checksums has checksum_block_size 0", path="checksum_block_size"
            )
        #: False only for an in-memory index of foreign data (see the class docstring)
        self.checksums = checksums
        self.world_size = world_size
        self.created_at = float(created_at)
        self.cloudckpt_version = cloudckpt_version
        self.metadata = metadata
        self.checksum_block_size = checksum_block_size
        self.structure = structure
        self.objects = tuple(objects)
        for i, key in enumerate(self.objects):
            why = validate_object_key(key)
            if why:
                raise ManifestError(why, path=f"objects[{i}]")
        if len(set(self.objects)) != len(self.objects):
            raise ManifestError("duplicate object keys", path="objects")
        g = tensor_columns(tensor_names, tensor_dtypes, tensor_shapes, tensor_ndims, chunk_counts)
        if g.shapes is not None:
            self.__dict__["_shapes"] = g.shapes
        self._geometry = g
        self._names, self._dtypes, self._name_index = g.names, g.dtypes, g.name_index
        self._ndims, self._numel = g.ndims, g.numel
        self._shape_flat, self._shape_start = g.shape_flat, g.shape_start
        self._chunk_start, self._coord_start = g.chunk_start, g.coord_start
        self._init_chunks(
            chunk_offsets,
            chunk_sizes,
            chunk_object_index,
            chunk_byte_offset,
            chunk_byte_length,
            chunk_crcs,
        )
        self._init_values(value_blobs, values, allow_pickle)
        if structure is not None:
            validate_structure(structure, self._name_index, self._value_blobs)
        self.object_homes, self.chunk_hashes, self.base, self.attempt = check_lineage(
            object_homes,
            chunk_hashes,
            base,
            attempt,
            objects=len(self.objects),
            chunks=self.num_chunks,
            hash_bytes=chunk_hash_bytes,
        )
        #: bytes of each chunk hash: 8, or 16 in a manifest of an older cloudckpt (lineage)
        self.chunk_hash_bytes = chunk_hash_bytes
        self.tensors: Mapping[str, TensorRecord] = TensorMap(
            self.columns, self.__dict__.get("_shapes")
        )
        self._derived: dict[str, object] = {}

    # --- construction and validation ------------------------------------------------------

    def _init_chunks(
        self,
        offsets: ArrayLike,
        sizes: ArrayLike,
        object_index: ArrayLike,
        byte_offset: ArrayLike,
        byte_length: ArrayLike,
        crcs: ArrayLike,
    ) -> None:
        nchunks, ncoords = int(self._chunk_start[-1]), int(self._coord_start[-1])
        offsets, sizes = read_only(offsets, np.int64), read_only(sizes, np.int64)
        object_index, byte_offset, byte_length = (
            read_only(a, np.int64) for a in (object_index, byte_offset, byte_length)
        )
        if len(offsets) != ncoords or len(sizes) != ncoords:
            raise ManifestError(
                f"chunk coordinates hold {len(offsets)}/{len(sizes)} numbers, expected {ncoords}",
                path="chunks",
            )
        for arr, field in (
            (object_index, "object_index"),
            (byte_offset, "byte_offset"),
            (byte_length, "byte_length"),
        ):
            if len(arr) != nchunks:
                raise ManifestError(
                    f"{field} holds {len(arr)} values, expected {nchunks}", path="chunks"
                )
        n_tensors = len(self._names)
        chunk_tensor = np.repeat(np.arange(n_tensors, dtype=np.int64), np.diff(self._chunk_start))
        chunk_ndim = self._ndims[chunk_tensor]
        chunk_coord_start = (
            self._coord_start[chunk_tensor]
            + (np.arange(nchunks, dtype=np.int64) - self._chunk_start[chunk_tensor]) * chunk_ndim
        )
        check_boxes(self._geometry, offsets, sizes, chunk_tensor, chunk_ndim, chunk_coord_start)
        numel = np.ones(nchunks, dtype=np.int64)
        has_dims = chunk_ndim > 0
        if has_dims.any():  # no overflow: sizes are inside shapes, whose products fit
            numel[has_dims] = np.multiply.reduceat(sizes, chunk_coord_start[has_dims])
        del chunk_ndim, chunk_coord_start, has_dims
        itemsizes = np.array([DTYPE_ITEMSIZE[d] for d in self._dtypes], dtype=np.int64)
        expected = numel * itemsizes[chunk_tensor]
        for arr, field in ((object_index, "object_index"), (byte_offset, "byte_offset")):
            bad = arr < 0 if field == "byte_offset" else (arr < 0) | (arr >= len(self.objects))
            if bad.any():
                c = int(np.flatnonzero(bad)[0])
                raise ManifestError(
                    f"{field} {int(arr[c])} out of range",
                    path=self._geometry.chunk_path(c, f".{field}"),
                )
        bad = (byte_length != expected) | (byte_offset > MAX_ELEMENTS)
        if bad.any():
            c = int(np.flatnonzero(bad)[0])
            raise ManifestError(
                f"byte_length {int(byte_length[c])} does not match {int(numel[c])} elements of "
                f"{self._dtypes[int(chunk_tensor[c])]} ({int(expected[c])} bytes)",
                path=self._geometry.chunk_path(c, ".byte_length"),
            )
        del bad, expected, chunk_tensor
        total = np.concatenate(([0], np.cumsum(numel)))
        covered = total[self._chunk_start[1:]] - total[self._chunk_start[:-1]]
        tensor_numel = self._numel
        total_f = np.concatenate(
            ([0.0], np.cumsum(numel, dtype=np.float64))
        )  # guards int64 wrap-around
        covered_f = total_f[self._chunk_start[1:]] - total_f[self._chunk_start[:-1]]
        bad = (covered != tensor_numel) | (covered_f > 2.0**61)
        if bad.any():
            t = int(np.flatnonzero(bad)[0])
            raise ManifestError(
                f"chunks hold {int(covered[t])} elements, the tensor has {int(tensor_numel[t])}",
                path=tensor_path(self._names[t]),
            )
        del total, total_f, numel
        check_no_shared_bytes(self._geometry, self.objects, object_index, byte_offset, byte_length)
        ncrc = (
            crc_counts(byte_length, self.checksum_block_size)
            if self.checksums
            else np.zeros(nchunks, dtype=np.int64)
        )
        crc_start = np.concatenate(([0], np.cumsum(ncrc))).astype(np.int64)
        del ncrc
        crcs = np.asarray(crcs)
        if crcs.ndim != 1 or len(crcs) != int(crc_start[-1]):
            raise ManifestError(
                f"{len(crcs)} crc32c values, expected {int(crc_start[-1])} "
                f"(one per {self.checksum_block_size}-byte block of every chunk)",
                path="chunks.crc32c",
            )
        if len(crcs) and (int(crcs.min()) < 0 or int(crcs.max()) >= 1 << 32):
            raise ManifestError("crc32c values must be unsigned 32-bit", path="chunks.crc32c")
        crcs = read_only(crcs, np.uint32)
        crc_start.flags.writeable = False
        self._offsets, self._sizes = offsets, sizes
        self._object_index, self._byte_offset, self._byte_length = (
            object_index,
            byte_offset,
            byte_length,
        )
        self._crcs, self._crc_start = crcs, crc_start

    def _init_values(
        self,
        value_blobs: Mapping[str, bytes],
        values: Mapping[str, object] | None,
        allow_pickle: AllowPickle,
    ) -> None:
        blobs: dict[str, bytes] = {}
        decoded: dict[str, object] = {}
        for name, blob in value_blobs.items():
            if type(name) is not str:
                raise ManifestError("value name must be a string", path="values")
            if name in self._name_index:
                raise ManifestError("name is both a tensor and a value", path=value_path(name))
            if not isinstance(blob, (bytes, bytearray)):
                raise ManifestError("encoded value must be bytes", path=value_path(name))
            blobs[name] = bytes(blob)
            if values is not None and name in values:
                decoded[name] = values[name]
            else:
                decoded[name] = decode_value(blob, key=name, allow_pickle=allow_pickle)
        self._value_blobs = blobs
        self.values: Mapping[str, object] = MappingProxyType(decoded)

    def _shape(self, t: int) -> tuple[int, ...]:
        """Tensor ``t``'s shape."""
        return shape_of(self.columns, self.__dict__.get("_shapes"), t)

    @functools.cached_property
    def _shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every tensor's shape (made on first use when decoded)."""
        return tuple(self._shape(t) for t in range(len(self._names)))

    # --- queries -----------------------------------------------------------------------------

    @functools.cached_property
    def columns(self) -> ManifestColumns:
        """The manifest's columns, read-only (see :class:`ManifestColumns`); no copy is made."""
        return ManifestColumns(
            self._names,
            self._dtypes,
            MappingProxyType(self._name_index),
            self._ndims,
            self._shape_flat,
            self._shape_start,
            self._chunk_start,
            self._coord_start,
            self._offsets,
            self._sizes,
            self._object_index,
            self._byte_offset,
            self._byte_length,
            self._crcs,
            self._crc_start,
            MappingProxyType(self._value_blobs),
        )

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every tensor's shape, in tensor order (made on first use when decoded)."""
        return self._shapes

    def derived(self, key: str, factory: Callable[[Manifest], _T]) -> _T:
        """A value derived from this manifest (immutable, so the value never goes stale):
        ``factory(self)`` on the first call with ``key``, the same object on every later one,
        kept as long as the manifest is (e.g. load planning's chunk index). Not locked: two
        threads asking at once may both call ``factory``; one result is kept."""
        value = self._derived.get(key)
        if value is None:
            value = self._derived.setdefault(key, factory(self))
        return cast(_T, value)  # a key names one factory, so its value is of that type

    @property
    def num_chunks(self) -> int:
        return int(self._chunk_start[-1])

    @property
    def references(self) -> bool:
        """Whether some object lies under another checkpoint's folder (a non-empty home)."""
        return any(self.object_homes)

    def with_object_keys(self, keys: Iterable[str]) -> Manifest:
        """This manifest with ``keys`` (distinct valid keys relative to another store root: the
        run's, see ``cloudckpt.stored``) as its objects and no homes; arrays are shared."""
        import copy

        keys = tuple(keys)
        why = next(filter(None, map(validate_object_key, keys)), None)
        if why or len(keys) != len(self.objects) or len(set(keys)) != len(keys):
            raise ManifestError(why or "one distinct key per object needed", path="objects")
        other = copy.copy(self)
        other.objects, other.object_homes, other._derived = keys, ("",) * len(keys), {}
        other.tensors = TensorMap(other.columns, other.__dict__.get("_shapes"))
        return other

    def total_bytes(self) -> int:
        """Bytes of tensor data referenced by the manifest (sum of chunk byte lengths)."""
        return int(self._byte_length.sum())

    def object_sizes(self) -> dict[str, int]:
        """Bytes referenced per object key (sum of the byte lengths of its chunks)."""
        sums = np.zeros(len(self.objects), dtype=np.int64)
        np.add.at(sums, self._object_index, self._byte_length)
        return dict(zip(self.objects, sums.tolist()))

    def object_extents(self) -> dict[str, int]:
        """Per object key, the end of its last referenced byte: the size it must at least have."""
        ends = np.zeros(len(self.objects), dtype=np.int64)
        np.maximum.at(ends, self._object_index, self._byte_offset + self._byte_length)
        return dict(zip(self.objects, ends.tolist()))

    def __repr__(self) -> str:
        return (
            f"Manifest(world_size={self.world_size}, tensors={len(self._names)}, "
            f"chunks={self.num_chunks}, values={len(self.values)}, objects={len(self.objects)})"
        )
