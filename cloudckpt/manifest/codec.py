"""msgpack encoding of a :class:`~cloudckpt.manifest.model.Manifest` (format ``cloudckpt``).

Stored bytes: format versions 2 and 3 frame the msgpack document with a header carrying the
crc32c of the whole manifest, checked before anything is decoded
(:mod:`cloudckpt.manifest.framing`); version 1 (still read) is the document alone. The document
is a msgpack map with string keys::

    format              "cloudckpt"
    version             3 or 2 (1 in a version 1 manifest: always the version of the frame)
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

Version 2 and 3 may add (additive: older cloudckpt versions ignore it)::

    chunks.hash64       bytes: 8 per chunk, its content hash (the first 8 bytes of its
                        XXH3-128 digest); absent when chunks carry no hash

Version 3 adds (see :mod:`cloudckpt.manifest.lineage`; a manifest without any of them is written
as version 2, so that older cloudckpt versions read it)::

    homes               [str]: per object, "" or the sibling folder holding it
    base                str: folder of the checkpoint it was made from ("" none)
    attempt             str: the save attempt that wrote it ("" unknown)
    hash_algorithm      str: "xxh3-128" (16-byte hashes in chunks.hash, as older cloudckpt
                        versions wrote them), or ""
    chunks.hash         bytes: 16 per chunk with "xxh3-128", else empty

A manifest carries either ``chunks.hash64`` or 16-byte ``chunks.hash`` values, never both. A
version 2 or 1 document's fields of the version 3 names are ignored (never followed); a version 1
document's ``chunks.hash64`` too (version 1 is written without hashes).

``col`` is an integer column (see :mod:`cloudckpt.manifest.columns`). Chunks are grouped by
tensor in tensor order; ``shapes`` concatenates every tensor's shape; ``offsets`` / ``sizes`` hold,
per tensor, its chunks' coordinates dimension-major (all dim-0 offsets of its chunks, then all
dim-1 offsets, ...), delta-encoded across the whole column, which makes regular shardings
compress to almost nothing. ``crc32c`` holds ``max(1, ceil(byte_length / checksum_block_size))``
values per chunk. Unknown top-level keys are skipped without being decoded (additive fields do
not bump the version).

Decoding costs memory in proportion to the manifest's size: a manifest may declare at most
:data:`DIMS_PER_BYTE` chunk coordinates (the ``ndim`` of every chunk) per byte of its own size,
a shape dimension counting as two (it is held as an int64 and in a Python tuple), checked before
those columns are inflated; the coordinates are inflated block by block straight into their
final layout. The encoder stores these columns uncompressed whenever compression would break
that rule (uncompressed, a dimension takes at least one byte and a coordinate two, its offset
and its size), so every manifest it writes is within it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

import msgpack
import numpy as np
from numpy.typing import NDArray

from cloudckpt.errors import ManifestError, UnsupportedManifestVersion
from cloudckpt.manifest.columns import (
    ColumnError,
    decode_int_column,
    decode_u32,
    encode_int_column,
    encode_u32,
    iter_int_column,
)
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_NDIM
from cloudckpt.manifest.framing import frame, unframe
from cloudckpt.manifest.lineage import LEGACY_HASH_ALGORITHM, LEGACY_HASH_BYTES, read_lineage
from cloudckpt.manifest.model import FORMAT_NAME, Manifest
from cloudckpt.manifest.values import AllowPickle, decode_plain, encode_value

#: Largest manifest read or decoded (bytes); a larger one is refused before it is read.
MAX_MANIFEST_BYTES = 1 << 31
#: Most chunk coordinates a manifest may declare per byte of its size, a shape dimension
#: counting as two (a coordinate costs 16 bytes once decoded: its offset and its size).
DIMS_PER_BYTE = 2
_FIELDS = frozenset(
    {
        "format",
        "version",
        "cloudckpt_version",
        "created_at",
        "world_size",
        "checksum_block_size",
        "metadata",
        "structure",
        "objects",
        "tensors",
        "chunks",
        "values",
        "homes",
        "base",
        "attempt",
        "hash_algorithm",
    }
)
_DTYPE_NAMES = {name: name for name in DTYPE_ITEMSIZE}  # one str object per dtype name


def _dim_major_index(counts: NDArray[np.int64], ndims: NDArray[np.int64]) -> NDArray[np.int64]:
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
    index: NDArray[np.int64] = (
        coord_start[coord_tensor] + dim * counts[coord_tensor] + np.repeat(chunk_local, chunk_ndim)
    )
    return index


def needed_version(m: Manifest) -> int:
    """The format version ``m`` is written in: 3 when it has any field of incremental
    checkpoints (homes, base, attempt, 16-byte chunk hashes), else 2 (8-byte chunk hashes
    included: ``chunks.hash64`` is additive)."""
    legacy = m.chunk_hashes is not None and m.chunk_hash_bytes == LEGACY_HASH_BYTES
    return 3 if m.references or legacy or m.base or m.attempt else 2


def encode_manifest(m: Manifest, *, format_version: int | None = None) -> bytes:
    """Encode a manifest as its stored bytes (deterministic for a given manifest).

    ``format_version`` defaults to :func:`needed_version`; ``1`` writes the old unchecksummed
    layout (tests, tools for old readers). A manifest with incremental fields cannot be written
    in a version before 3 (``ValueError``). A manifest without data checksums
    (``checksums=False``, an in-memory index of foreign files) is refused: a stored manifest
    always carries its data's crc32c values.
    """
    if not m.checksums:
        raise ManifestError(
            "a manifest without data checksums (an index of foreign files) cannot be stored",
            path="checksums",
        )
    needed = needed_version(m)
    format_version = needed if format_version is None else format_version
    if needed == 3 and format_version < 3:
        raise ValueError(f"this manifest needs format version {needed}, not {format_version}")
    cols = m.columns
    ndims = cols.ndims
    counts = np.diff(cols.chunk_start)
    perm = _dim_major_index(counts, ndims)
    off_dm = np.empty_like(cols.offsets)
    size_dm = np.empty_like(cols.sizes)
    off_dm[perm] = cols.offsets
    size_dm[perm] = cols.sizes
    flat_shapes = cols.shape_flat
    declared = 2 * len(flat_shapes) + len(off_dm)

    def document(compress: bool) -> bytes:
        chunks: dict[str, object] = {
            "offsets": encode_int_column(off_dm, delta=True, compress=compress),
            "sizes": encode_int_column(size_dm, delta=True, compress=compress),
            "object_index": encode_int_column(cols.object_index, delta=True),
            "byte_offset": encode_int_column(cols.byte_offset, delta=True),
            "byte_length": encode_int_column(cols.byte_length, delta=True),
            "crc32c": encode_u32(cols.crcs),
        }
        doc: dict[str, object] = {
            "format": FORMAT_NAME,
            "version": format_version,
            "cloudckpt_version": m.cloudckpt_version,
            "created_at": m.created_at,
            "world_size": m.world_size,
            "checksum_block_size": m.checksum_block_size,
            "metadata": encode_value(m.metadata, key="metadata", allow_pickle=False),
            "structure": encode_value(m.structure, key="structure", allow_pickle=False),
            "objects": list(m.objects),
            "tensors": {
                "names": list(cols.names),
                "dtypes": list(cols.dtypes),
                "ndims": encode_int_column(ndims),
                "shapes": encode_int_column(flat_shapes, compress=compress),
                "chunk_counts": encode_int_column(counts),
            },
            "chunks": chunks,
            "values": dict(cols.value_blobs),
        }
        hashes = m.chunk_hashes
        legacy = hashes is not None and m.chunk_hash_bytes == LEGACY_HASH_BYTES
        if hashes is not None and not legacy and format_version >= 2:
            chunks["hash64"] = hashes.tobytes()
        if format_version >= 3:
            chunks["hash"] = hashes.tobytes() if legacy and hashes is not None else b""
            doc.update(
                homes=list(m.object_homes),
                base=m.base,
                attempt=m.attempt,
                hash_algorithm=LEGACY_HASH_ALGORITHM if legacy else "",
            )
        return msgpack.packb(doc, use_bin_type=True)

    data = frame(document(True), format_version)
    if declared > DIMS_PER_BYTE * len(data):  # stay decodable: uncompressed, >= 1 byte each
        data = frame(document(False), format_version)
    return data


@dataclass(frozen=True, eq=False)
class ManifestDocument:
    """The checked top level of stored manifest bytes (see :func:`read_document`)."""

    version: int  # format version of the stored bytes: 1 (no checksum) or 2
    size: int  # bytes stored
    fields: dict[str, Any]  # the known top-level fields, decoded by msgpack, not validated yet


def _refuse_ext(code: int, data: bytes) -> NoReturn:
    raise ValueError(f"msgpack extension type {code} is not allowed at the manifest top level")


def read_document(
    data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_MANIFEST_BYTES
) -> ManifestDocument:
    """Check the frame (size, checksum) of stored manifest bytes and decode their top-level map.

    Unknown top-level fields are skipped without building them; a duplicated known field,
    a non-string key and bytes after the map are refused. Raises
    :class:`~cloudckpt.errors.ManifestError` (or :class:`UnsupportedManifestVersion`).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError("manifest must be bytes")
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise ManifestError(f"manifest is {size} bytes, more than max_bytes={max_bytes}")
    version, payload = unframe(data)
    length = len(payload)
    unpacker = msgpack.Unpacker(
        raw=False, strict_map_key=True, ext_hook=_refuse_ext, max_buffer_size=max(1, length)
    )
    fields: dict[str, Any] = {}
    try:
        unpacker.feed(payload)
        del payload
        try:
            entries = unpacker.read_map_header()
        except ValueError as exc:
            raise ManifestError("manifest is not a msgpack map") from exc
        for _ in range(entries):
            key = unpacker.unpack()
            if type(key) is not str:
                raise ManifestError(f"top-level key of type {type(key).__name__}, not str")
            if key not in _FIELDS:
                unpacker.skip()
            elif key in fields:
                raise ManifestError("field appears twice", path=key)
            else:
                fields[key] = unpacker.unpack()
        rest = length - unpacker.tell()
        if rest:
            raise ManifestError(f"{rest} bytes after the manifest's msgpack map")
    except ManifestError:
        raise
    except Exception as exc:  # noqa: BLE001 - malformed input raises many kinds
        raise ManifestError(f"not a msgpack manifest ({type(exc).__name__}: {exc})") from exc
    return ManifestDocument(version, size, fields)


def _field(
    doc: dict[str, Any], key: str, types: type | tuple[type, ...], path: str | None = None
) -> Any:
    if key not in doc:
        raise ManifestError("missing field", path=path or key)
    value = doc[key]
    if not isinstance(value, types) or type(value) is bool:
        raise ManifestError(
            f"expected {getattr(types, '__name__', types)}, got {type(value).__name__}",
            path=path or key,
        )
    return value


def _column(section: dict[str, Any], key: str, path: str, *, expected: int) -> NDArray[np.int64]:
    if key not in section:
        raise ManifestError("missing column", path=f"{path}.{key}")
    try:
        return decode_int_column(section[key], expected=expected)
    except ColumnError as exc:
        raise ManifestError(str(exc), path=f"{path}.{key}") from exc


def _chunk_major(
    section: dict[str, Any],
    key: str,
    counts: NDArray[np.int64],
    ndims: NDArray[np.int64],
    ncoords: int,
) -> NDArray[np.int64]:
    """Decode a dimension-major coordinate column straight into chunk-major order, block by
    block (no permutation array, no second copy of the column)."""
    if key not in section:
        raise ManifestError("missing column", path=f"chunks.{key}")
    coord_start = np.concatenate(([0], np.cumsum(counts * ndims))).astype(np.int64)
    out = np.empty(ncoords, dtype=np.int64)
    try:
        for start, values in iter_int_column(section[key], expected=ncoords):
            pos = np.arange(start, start + len(values), dtype=np.int64)
            t = np.searchsorted(coord_start, pos, side="right") - 1  # tensor of each coordinate
            within = pos - coord_start[t]
            count = counts[t]
            dim = within // count
            out[coord_start[t] + (within - dim * count) * ndims[t] + dim] = values
    except ColumnError as exc:
        raise ManifestError(str(exc), path=f"chunks.{key}") from exc
    out.flags.writeable = False
    return out


def decode_manifest(
    data: bytes | bytearray | memoryview,
    *,
    allow_pickle: AllowPickle = False,
    max_bytes: int = MAX_MANIFEST_BYTES,
    structure: bool = True,
) -> Manifest:
    """Decode and fully validate manifest bytes from an untrusted source.

    Raises :class:`~cloudckpt.errors.UnsupportedManifestVersion` for another format or version,
    :class:`~cloudckpt.errors.PickleNotAllowed` for pickled values unless ``allow_pickle``
    (``allow_pickle="inspect"`` decodes them to opaque markers, never unpickling), and
    :class:`~cloudckpt.errors.ManifestError` (with ``path``) for anything else malformed: a
    checksum mismatch, a manifest over ``max_bytes``, chunks whose bytes overlap, ...

    ``structure=False`` leaves the saved nesting out (``Manifest.structure`` is None; it is
    neither decoded nor checked): for a reader that fills its own state dict and was handed
    bytes another decode has validated whole (the ranks of a load other than the coordinator).
    """
    return manifest_from_document(
        read_document(data, max_bytes=max_bytes), allow_pickle=allow_pickle, structure=structure
    )


def manifest_from_document(
    document: ManifestDocument, *, allow_pickle: AllowPickle = False, structure: bool = True
) -> Manifest:
    """Validate the fields of a :class:`ManifestDocument` into a :class:`Manifest` (see
    :func:`decode_manifest`). Does not modify the document."""
    doc = document.fields
    if doc.get("format") != FORMAT_NAME:
        raise UnsupportedManifestVersion(
            f"format {doc.get('format')!r:.80} is not {FORMAT_NAME!r}", path="format"
        )
    version = doc.get("version")
    if type(version) is not int or version != document.version:
        raise UnsupportedManifestVersion(
            f"manifest version {version!r:.40} is not supported here (a "
            f"{'framed' if document.version > 1 else 'header-less'} manifest is version "
            f"{document.version})",
            path="version",
        )
    world_size = _field(doc, "world_size", int)
    created_at = _field(doc, "created_at", (int, float))
    cloudckpt_version = _field(doc, "cloudckpt_version", str)
    block = _field(doc, "checksum_block_size", int)
    metadata = decode_plain(_field(doc, "metadata", bytes), path="metadata")
    nesting = decode_plain(_field(doc, "structure", bytes), path="structure") if structure else None
    objects = _field(doc, "objects", list)
    tensors = _field(doc, "tensors", dict)
    chunks = _field(doc, "chunks", dict)
    values = _field(doc, "values", dict)
    names = _field(tensors, "names", list, "tensors.names")
    dtypes = [
        _DTYPE_NAMES.get(d, d) if type(d) is str else d
        for d in _field(tensors, "dtypes", list, "tensors.dtypes")
    ]
    n_tensors = len(names)
    crc_bytes = _field(chunks, "crc32c", bytes, "chunks.crc32c")
    try:
        crcs = decode_u32(crc_bytes)
    except ColumnError as exc:
        raise ManifestError(str(exc), path="chunks.crc32c") from exc
    ndims = _column(tensors, "ndims", "tensors", expected=n_tensors)
    if n_tensors and (ndims.min() < 0 or ndims.max() > MAX_NDIM):
        raise ManifestError(f"tensor ndims must be in 0..{MAX_NDIM}", path="tensors.ndims")
    counts = _column(tensors, "chunk_counts", "tensors", expected=n_tensors)
    if n_tensors and counts.min() < 0:
        raise ManifestError("negative chunk count", path="tensors.chunk_counts")
    # every chunk carries at least one crc: bounds what follows (each count first: no overflow)
    if n_tensors and (counts.max() > len(crcs) or int(counts.sum()) > len(crcs)):
        raise ManifestError(
            f"{int(counts.astype(np.float64).sum()):.0f} chunks but only {len(crcs)} crc32c values",
            path="chunks",
        )
    nchunks, nshape = int(counts.sum()), int(ndims.sum())
    ncoords = int((counts * ndims).sum())
    if 2 * nshape + ncoords > DIMS_PER_BYTE * document.size:
        raise ManifestError(
            f"declares {nshape} shape dimensions and {ncoords} chunk coordinates, more than "
            f"{DIMS_PER_BYTE} per byte of its {document.size} bytes",
            path="tensors",
        )
    shapes = _column(tensors, "shapes", "tensors", expected=nshape)
    offsets = _chunk_major(chunks, "offsets", counts, ndims, ncoords)
    sizes = _chunk_major(chunks, "sizes", counts, ndims, ncoords)
    lineage = read_lineage(doc, chunks, document.version)
    blobs: dict[str, bytes] = {}
    for name, blob in values.items():
        if type(blob) is not bytes:
            raise ManifestError("encoded value must be bytes", path=f"values[{name!r:.80}]")
        blobs[name] = blob
    return Manifest(
        world_size=world_size,
        created_at=created_at,
        cloudckpt_version=cloudckpt_version,
        metadata=metadata,
        checksum_block_size=block,
        objects=objects,
        tensor_names=names,
        tensor_dtypes=dtypes,
        tensor_shapes=shapes,
        tensor_ndims=ndims,
        chunk_counts=counts,
        chunk_offsets=offsets,
        chunk_sizes=sizes,
        chunk_object_index=_column(chunks, "object_index", "chunks", expected=nchunks),
        chunk_byte_offset=_column(chunks, "byte_offset", "chunks", expected=nchunks),
        chunk_byte_length=_column(chunks, "byte_length", "chunks", expected=nchunks),
        chunk_crcs=crcs,
        value_blobs=blobs,
        structure=nesting,
        allow_pickle=allow_pickle,
        **lineage,
    )
