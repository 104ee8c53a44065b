"""Incremental construction of a :class:`~cloudckpt.manifest.model.Manifest`.

For a handful of tensors use :class:`ManifestBuilder`; for millions of chunks build the columns
directly (see ``cloudckpt.planning.save.assemble.assemble_manifest``) and call the ``Manifest``
constructor.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cloudckpt.errors import PlanningError
from cloudckpt.manifest.model import DEFAULT_CHECKSUM_BLOCK_SIZE, Manifest
from cloudckpt.manifest.values import encode_value

#: A chunk as :meth:`ManifestBuilder.add_chunk` keeps it: offsets, sizes, object index, byte
#: offset, byte length, crcs.
_Chunk = tuple[tuple[int, ...], tuple[int, ...], int, int, int, tuple[int, ...]]


def _version() -> str:
    from cloudckpt.version import __version__

    return __version__


class ManifestBuilder:
    """Collects tensors, chunks and values, then :meth:`build` validates and freezes them.

    Chunks keep the order they were added in. ``metadata`` and ``structure`` must be
    exact-msgpack values (no pickle). Misuse (unknown tensor, duplicate name) raises
    :class:`~cloudckpt.errors.PlanningError`; :meth:`build` raises
    :class:`~cloudckpt.errors.ManifestError` for anything the manifest validation refuses.
    """

    def __init__(
        self,
        *,
        world_size: int,
        metadata: Mapping[str, Any] | None = None,
        checksum_block_size: int = DEFAULT_CHECKSUM_BLOCK_SIZE,
        structure: object = None,
        created_at: float | None = None,
        cloudckpt_version: str | None = None,
    ):
        self.world_size = world_size
        self.metadata = dict(metadata or {})
        self.checksum_block_size = checksum_block_size
        self.structure = structure
        self.created_at = time.time() if created_at is None else created_at
        self.cloudckpt_version = _version() if cloudckpt_version is None else cloudckpt_version
        self._tensors: dict[str, tuple[str, tuple[int, ...], list[_Chunk]]] = {}
        self._objects: dict[str, int] = {}
        self._values: dict[str, object] = {}
        self._blobs: dict[str, bytes] = {}

    def add_tensor(self, name: str, dtype: str, shape: Sequence[int]) -> None:
        if name in self._tensors or name in self._blobs:
            raise PlanningError(f"manifest already holds {name!r}")
        self._tensors[name] = (dtype, tuple(int(s) for s in shape), [])

    def object_index(self, object_key: str) -> int:
        """Index of ``object_key`` in the object table (added on first use)."""
        return self._objects.setdefault(object_key, len(self._objects))

    def add_chunk(
        self,
        name: str,
        offsets: Sequence[int],
        sizes: Sequence[int],
        object_key: str,
        byte_offset: int,
        byte_length: int,
        crcs: Sequence[int],
    ) -> None:
        if name not in self._tensors:
            raise PlanningError(f"add_chunk for unknown tensor {name!r}: call add_tensor first")
        ndim = len(self._tensors[name][1])
        if len(offsets) != ndim or len(sizes) != ndim:
            raise PlanningError(f"chunk of {name!r} needs {ndim} offsets and sizes")
        self._tensors[name][2].append(
            (
                tuple(offsets),
                tuple(sizes),
                self.object_index(object_key),
                int(byte_offset),
                int(byte_length),
                tuple(crcs),
            )
        )

    def set_value(self, name: str, value: object, *, allow_pickle: bool = False) -> None:
        if name in self._tensors:
            raise PlanningError(f"manifest already holds tensor {name!r}")
        self._blobs[name] = encode_value(value, key=name, allow_pickle=allow_pickle)
        self._values[name] = value

    def build(self) -> Manifest:
        encode_value(self.metadata, key="metadata", allow_pickle=False)
        encode_value(self.structure, key="structure", allow_pickle=False)
        names: list[str] = []
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        counts: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        obj: list[int] = []
        boff: list[int] = []
        blen: list[int] = []
        crcs: list[int] = []
        for name, (dtype, shape, chunks) in self._tensors.items():
            names.append(name)
            dtypes.append(dtype)
            shapes.append(shape)
            counts.append(len(chunks))
            for o, s, oi, bo, bl, cr in chunks:
                offsets.extend(o)
                sizes.extend(s)
                obj.append(oi)
                boff.append(bo)
                blen.append(bl)
                crcs.extend(cr)
        return Manifest(
            world_size=self.world_size,
            created_at=self.created_at,
            cloudckpt_version=self.cloudckpt_version,
            metadata=self.metadata,
            checksum_block_size=self.checksum_block_size,
            objects=list(self._objects),
            tensor_names=names,
            tensor_dtypes=dtypes,
            tensor_shapes=shapes,
            chunk_counts=counts,
            chunk_offsets=np.array(offsets, dtype=np.int64),
            chunk_sizes=np.array(sizes, dtype=np.int64),
            chunk_object_index=obj,
            chunk_byte_offset=boff,
            chunk_byte_length=blen,
            chunk_crcs=np.array(crcs, dtype=np.int64),
            value_blobs=self._blobs,
            values=self._values,
            structure=self.structure,
            allow_pickle=True,
        )


def expected_crc_count(byte_length: int, block_size: int) -> int:
    """How many per-block crcs a chunk of ``byte_length`` bytes carries."""
    return max(1, math.ceil(byte_length / block_size))
