"""The bytes around a manifest's msgpack document: a header that carries its checksum.

Format versions 2 and 3 (what this cloudckpt writes; 3 adds fields of incremental checkpoints
to the document, the frame is the same)::

    offset  size  field
    0       8     magic b"\\xc1ckpt\\r\\n\\x1a"  (0xc1 is a byte msgpack never uses)
    8       4     format version, little-endian uint32: 2 or 3
    12      4     crc32c of bytes 0..11 followed by the payload, little-endian uint32
    16      ...   payload: the msgpack document (see :mod:`cloudckpt.manifest.codec`)

Format version 1 (earlier cloudckpt): the msgpack document alone, without a checksum. It is
still read; its first byte is always a msgpack map marker.

Contract of :func:`unframe`: the checksum is checked before a byte of the payload is decoded, and
every single-bit change anywhere in a framed manifest (magic, version, checksum or payload)
raises :class:`~cloudckpt.errors.ManifestError` (crc32c detects every error of up to 3 bits and
every burst of up to 32 bits; a changed magic byte is not a msgpack map marker, so it is not read
as version 1 either). A version field other than 2 or 3 raises
:class:`~cloudckpt.errors.UnsupportedManifestVersion`.
"""

from __future__ import annotations

import struct

from cloudckpt.checksum import crc32c
from cloudckpt.errors import ManifestError, UnsupportedManifestVersion

MAGIC = b"\xc1ckpt\r\n\x1a"
HEADER = struct.Struct("<8sII")
FRAMED_VERSION = 2
FRAMED_VERSIONS = (2, 3)
SUPPORTED_VERSIONS = (1, 2, 3)
#: First bytes of a msgpack map (fixmap, map 16, map 32): how a version 1 manifest starts.
_MAP_MARKERS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def frame(payload: bytes, version: int = FRAMED_VERSION) -> bytes:
    """The stored bytes of a manifest whose msgpack document is ``payload``.

    ``version=1`` returns ``payload`` unchanged (the unchecksummed layout of format version 1,
    for tests and for tools that must write for old readers).
    """
    if version == 1:
        return bytes(payload)
    if version not in FRAMED_VERSIONS:
        raise ValueError(f"cannot write manifest format version {version!r}")
    head = MAGIC + struct.pack("<I", version)
    return head + struct.pack("<I", crc32c(payload, crc32c(head))) + bytes(payload)


def stored_version(data: bytes | bytearray | memoryview) -> int:
    """The format version the stored bytes ``data`` claim (1, or the framed version 2 or 3),
    without checking them.

    Raises :class:`~cloudckpt.errors.ManifestError` when they are neither.
    """
    mv = memoryview(data).cast("B")
    if bytes(mv[: len(MAGIC)]) == MAGIC:
        if len(mv) >= HEADER.size:
            declared: int = HEADER.unpack_from(mv)[1]
            if declared in FRAMED_VERSIONS:
                return declared
        return FRAMED_VERSION
    if len(mv) and mv[0] in _MAP_MARKERS:
        return 1
    if not len(mv):
        raise ManifestError("manifest is empty")
    if len(mv) < len(MAGIC) and bytes(mv) == MAGIC[: len(mv)]:
        raise ManifestError(f"manifest header truncated ({len(mv)} bytes)")
    raise ManifestError(
        "not a cloudckpt manifest: it starts with neither the manifest header "
        "nor a msgpack map (damaged, or another file)"
    )


def unframe(data: bytes | bytearray | memoryview) -> tuple[int, memoryview]:
    """Check the frame of stored manifest bytes; return (format version, payload view).

    Versions 2 and 3: header complete, version supported, crc32c matching, all before anything
    is decoded. Version 1: the payload is ``data`` itself (nothing to check).
    """
    mv = memoryview(data).cast("B")
    version = stored_version(mv)
    if version == 1:
        return 1, mv
    if len(mv) < HEADER.size:
        raise ManifestError(f"manifest header truncated ({len(mv)} of {HEADER.size} bytes)")
    _, declared, stored = HEADER.unpack_from(mv)
    if declared not in FRAMED_VERSIONS:
        raise UnsupportedManifestVersion(
            f"manifest format version {declared} is not supported (this cloudckpt reads versions "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}; or the header is damaged)",
            path="version",
        )
    payload = mv[HEADER.size :]
    actual = crc32c(payload, crc32c(mv[: HEADER.size - 4]))
    if actual != stored:
        raise ManifestError(
            f"manifest checksum mismatch (stored crc32c {stored:08x}, computed "
            f"{actual:08x}): its {len(mv)} bytes are damaged"
        )
    return declared, payload
