"""msgpack encoding of a :class:`~cloudckpt.manifest.model.Manifest` (format ``cloudckpt`` v1).

Top level: a msgpack map with string keys::

    format              "cloudckpt"
    version             1
    cloudckpt_version   str
    created_at          float (unix time)
    world_size          int
    checksum_block_size int
    metadata            bytes: encode_value(metadata dict), never pickle
    structure           bytes: encode_value(structure mapping), never pickle
    objects             [str]: object keys relative to the checkpoint root
    tensors             {names: [str], dtypes: [str], ndims: col, shapes: col, chunk_counts: col}
    chunks              {offsets: col, sizes: col, object_index: col, byte_offset: col,
                         byte_length: col, crc32c: bytes (little-endian uint32, raw)}
    values              {name: bytes}: encode_value(value) each (pickled ones flagged inside)

``col`` is an integer column (see :mod:`cloudckpt.manifest.columns`). Chunks are grouped by
tensor in tensor order; ``shapes`` concatenates every tensor's shape; ``offsets`` / ``sizes`` hold,
per tensor, its chunks' coordinates dimension-major (all dim-0 offsets of its chunks, then all
dim-1 offsets, ...), delta-encoded across the whole column, which makes regular shardings
compress to almost nothing. ``crc32c`` holds ``max(1, ceil(byte_length / checksum_block_size))``
values per chunk. Unknown top-level keys are ignored (additive fields do not bump the version).
"""

from __future__ import annotations

import msgpack
import numpy as np

from cloudckpt.errors import ManifestError, UnsupportedManifestVersion
from cloudckpt.manifest.columns import ColumnError, decode_int_column, decode_u32, encode_int_column, encode_u32
from cloudckpt.manifest.dtypes import MAX_NDIM
from cloudckpt.manifest.model import FORMAT_NAME, FORMAT_VERSION, Manifest
from cloudckpt.manifest.values import decode_plain, encode_value


def _dim_major_index(counts: np.ndarray, ndims: np.ndarray) -> np.ndarray:
    """For each chunk-major coordinate position, its position in the dimension-major layout."""
    n_tensors = len(counts)
    chunk_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    coord_start = np.concatenate(([0], np.cumsum(counts * ndims))).astype(np.int64)
    nchunks, ncoords = int(chunk_start[-1]), int(coord_start[-1])
    chunk_tensor = np.repeat(np.arange(n_tensors, dtype=np.int64), counts)
    chunk_ndim = ndims[chunk_tensor]
    chunk_local = np.arange(nchunks, dtype=np.int64) - chunk_start[chunk_tensor]
    chunk_base = coord_start[chunk_tensor] + chunk_local * chunk_ndim
    dim = np.arange(ncoords, dtype=np.int64) - np.repeat(chunk_base, chunk_ndim)
    coord_tensor = np.repeat(chunk_tensor, chunk_ndim)
    return coord_start[coord_tensor] + dim * counts[coord_tensor] + np.repeat(chunk_local, chunk_ndim)


def encode_manifest(m: Manifest) -> bytes:
    """Encode a manifest as msgpack bytes (deterministic for a given manifest)."""
    ndims = m._ndims
    counts = np.diff(m._chunk_start)
    perm = _dim_major_index(counts, ndims)
    off_dm = np.empty_like(m._offsets)
    size_dm = np.empty_like(m._sizes)
    off_dm[perm] = m._offsets
    size_dm[perm] = m._sizes
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "cloudckpt_version": m.cloudckpt_version,
        "created_at": m.created_at,
        "world_size": m.world_size,
        "checksum_block_size": m.checksum_block_size,
        "metadata": encode_value(m.metadata, key="metadata", allow_pickle=False),
        "structure": encode_value(m.structure, key="structure", allow_pickle=False),
        "objects": list(m.objects),
        "tensors": {
            "names": list(m._names),
            "dtypes": list(m._dtypes),
            "ndims": encode_int_column(ndims),
            "shapes": encode_int_column([d for s in m._shapes for d in s]),
            "chunk_counts": encode_int_column(counts),
        },
        "chunks": {
            "offsets": encode_int_column(off_dm, delta=True),
            "sizes": encode_int_column(size_dm, delta=True),
            "object_index": encode_int_column(m._object_index, delta=True),
            "byte_offset": encode_int_column(m._byte_offset, delta=True),
            "byte_length": encode_int_column(m._byte_length, delta=True),
            "crc32c": encode_u32(m._crcs),
        },
        "values": dict(m._value_blobs),
    }
    return msgpack.packb(doc, use_bin_type=True)


def _field(doc: dict, key: str, types, path: str | None = None):
    if key not in doc:
        raise ManifestError("missing field", path=path or key)
    value = doc[key]
    if not isinstance(value, types) or type(value) is bool:
        raise ManifestError(f"expected {getattr(types, '__name__', types)}, got {type(value).__name__}",
                            path=path or key)
    return value


def _column(section: dict, key: str, path: str, **kw) -> np.ndarray:
    if key not in section:
        raise ManifestError("missing column", path=f"{path}.{key}")
    try:
        return decode_int_column(section[key], **kw)
    except ColumnError as exc:
        raise ManifestError(str(exc), path=f"{path}.{key}") from exc


def _refuse_ext(code, data):
    raise ValueError(f"msgpack extension type {code} is not allowed at the manifest top level")


def decode_manifest(data: bytes, *, allow_pickle: bool | str = False,
                    max_bytes: int = 1 << 31) -> Manifest:
    """Decode and fully validate manifest bytes from an untrusted source.

    Raises :class:`~cloudckpt.errors.UnsupportedManifestVersion` for another format or version,
    :class:`~cloudckpt.errors.PickleNotAllowed` for pickled values unless ``allow_pickle``
    (``allow_pickle="inspect"`` decodes them to opaque markers, never unpickling), and
    :class:`~cloudckpt.errors.ManifestError` (with ``path``) for anything else malformed.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError("manifest must be bytes")
    if len(data) > max_bytes:
        raise ManifestError(f"manifest is {len(data)} bytes, more than max_bytes={max_bytes}")
    try:
        doc = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except Exception as exc:  # noqa: BLE001 - malformed input raises many kinds
        raise ManifestError(f"not a msgpack manifest ({type(exc).__name__}: {exc})") from exc
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a msgpack map")
    if doc.get("format") != FORMAT_NAME:
        raise UnsupportedManifestVersion(f"format {doc.get('format')!r} is not {FORMAT_NAME!r}", path="format")
    version = doc.get("version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise UnsupportedManifestVersion(
            f"manifest version {version!r} is not supported (this cloudckpt reads version {FORMAT_VERSION})",
            path="version")
    world_size = _field(doc, "world_size", int)
    created_at = _field(doc, "created_at", (int, float))
    cloudckpt_version = _field(doc, "cloudckpt_version", str)
    block = _field(doc, "checksum_block_size", int)
    metadata = decode_plain(_field(doc, "metadata", bytes), path="metadata")
    structure = decode_plain(_field(doc, "structure", bytes), path="structure")
    objects = _field(doc, "objects", list)
    tensors = _field(doc, "tensors", dict)
    chunks = _field(doc, "chunks", dict)
    values = _field(doc, "values", dict)
    names = _field(tensors, "names", list, "tensors.names")
    dtypes = _field(tensors, "dtypes", list, "tensors.dtypes")
    n_tensors = len(names)
    crc_bytes = _field(chunks, "crc32c", bytes, "chunks.crc32c")
    try:
        crcs = decode_u32(crc_bytes)
    except ColumnError as exc:
        raise ManifestError(str(exc), path="chunks.crc32c") from exc
    ndims = _column(tensors, "ndims", "tensors", expected=n_tensors)
    if n_tensors and (ndims.min() < 0 or ndims.max() > MAX_NDIM):
        raise ManifestError(f"tensor ndims must be in 0..{MAX_NDIM}", path="tensors.ndims")
    flat_shapes = _column(tensors, "shapes", "tensors", expected=int(ndims.sum()))
    counts = _column(tensors, "chunk_counts", "tensors", expected=n_tensors)
    if n_tensors and counts.min() < 0:
        raise ManifestError("negative chunk count", path="tensors.chunk_counts")
    nchunks = int(counts.sum())
    if nchunks > len(crcs):  # every chunk carries at least one crc: bounds what follows
        raise ManifestError(f"{nchunks} chunks but only {len(crcs)} crc32c values", path="chunks")
    ncoords = int((counts * ndims).sum())
    off_dm = _column(chunks, "offsets", "chunks", expected=ncoords)
    size_dm = _column(chunks, "sizes", "chunks", expected=ncoords)
    perm = _dim_major_index(counts, ndims)
    shape_start = np.concatenate(([0], np.cumsum(ndims))).astype(np.int64)
    shapes = [tuple(flat_shapes[shape_start[i]:shape_start[i + 1]].tolist()) for i in range(n_tensors)]
    blobs = {}
    for name, blob in values.items():
        if type(blob) is not bytes:
            raise ManifestError("encoded value must be bytes", path=f"values[{name!r}]")
        blobs[name] = blob
    return Manifest(
        world_size=world_size, created_at=created_at, cloudckpt_version=cloudckpt_version,
        metadata=metadata, checksum_block_size=block, objects=objects, tensor_names=names,
        tensor_dtypes=dtypes, tensor_shapes=shapes, chunk_counts=counts,
        chunk_offsets=off_dm[perm], chunk_sizes=size_dm[perm],
        chunk_object_index=_column(chunks, "object_index", "chunks", expected=nchunks),
        chunk_byte_offset=_column(chunks, "byte_offset", "chunks", expected=nchunks),
        chunk_byte_length=_column(chunks, "byte_length", "chunks", expected=nchunks),
        chunk_crcs=crcs, value_blobs=blobs, structure=structure, allow_pickle=allow_pickle,
    )
