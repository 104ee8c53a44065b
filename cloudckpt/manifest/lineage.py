"""What a format version 3 manifest adds for incremental checkpoints, and its validation.

- ``object_homes``: per object, ``""`` (the object lies under this checkpoint's own root) or the
  name of a *sibling* folder of the same run (``<run root>/<home>/<key>``): one path segment, not
  ``.`` or ``..``, no control character, no backslash. A key therefore never resolves outside the
  run root. References are flat: a home holds the object itself, never another reference.
- ``chunk_hashes``: per chunk, a content hash of its bytes, or none at all; a later save compares
  against them without reading data. :data:`HASH_BYTES` (8) bytes each, the first 8 bytes of the
  XXH3-128 digest (:func:`cloudckpt.checksum.content_hash`: column ``chunks.hash64``, any format
  version from 2 on) or, read from a manifest of an older cloudckpt, :data:`LEGACY_HASH_BYTES`
  (16) bytes, the whole digest (:data:`LEGACY_HASH_ALGORITHM`, format version 3 only). A save
  compares the first 8 bytes of either (:func:`compared_hashes`).
- ``base``: the folder of the checkpoint this one was made from (``""``: none).
- ``attempt``: the save attempt that wrote it (16 hex digits, ``""`` unknown): the name of its
  pins in the folders it references (see ``cloudckpt.layout.pin_key``).

Pure; every problem is a :class:`~cloudckpt.errors.ManifestError` naming its path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from cloudckpt.errors import ManifestError

#: Bytes of the content hash a save records and compares per chunk: the first 8 bytes of the
#: big-endian XXH3-128 digest (see docs/decisions.md, "Content hashes").
HASH_BYTES = 8
#: The whole 16-byte XXH3-128 digest per chunk, as format version 3 first recorded it
#: (``hash_algorithm``, ``chunks.hash``): still read, and written only for such a manifest.
LEGACY_HASH_ALGORITHM = "xxh3-128"
LEGACY_HASH_BYTES = 16
_ATTEMPT_RE = re.compile(r"^[0-9a-f]{16}$")


def folder_problem(name: object) -> str | None:
    """Why ``name`` is not a folder name a home or base may use (one safe path segment), or
    None."""
    if type(name) is not str:
        return "a folder name must be a string"
    if not name or name in (".", ".."):
        return f"folder name {name!r:.80} is empty, '.' or '..'"
    if "/" in name or "\\" in name:
        return f"folder name {name!r:.80} is not one path segment"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return f"folder name {name!r:.80} contains a control character"
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return f"folder name {name[:40]!r}... is longer than 255 bytes"
    return None


def check_lineage(
    object_homes: Iterable[str] | None,
    chunk_hashes: bytes | bytearray | memoryview | NDArray[np.uint8] | None,
    base: str,
    attempt: str,
    *,
    objects: int,
    chunks: int,
    hash_bytes: int = HASH_BYTES,
) -> tuple[tuple[str, ...], NDArray[np.uint8] | None, str, str]:
    """Validated ``(object_homes, chunk_hashes, base, attempt)``: a tuple of ``objects`` homes,
    a read-only ``(chunks, hash_bytes)`` uint8 array or None, and two strings. ``hash_bytes``:
    :data:`HASH_BYTES` or :data:`LEGACY_HASH_BYTES`."""
    if object_homes is None:
        homes = ("",) * objects
    else:
        homes = tuple(object_homes)
        if len(homes) != objects:
            raise ManifestError(f"{len(homes)} object homes for {objects} objects", path="homes")
        for i, home in enumerate(homes):
            if home != "" or type(home) is not str:
                why = folder_problem(home)
                if why:
                    raise ManifestError(why, path=f"homes[{i}]")
    if type(base) is not str or (base and folder_problem(base)):
        raise ManifestError(folder_problem(base) or "base must be a string", path="base")
    if type(attempt) is not str or (attempt and not _ATTEMPT_RE.match(attempt)):
        raise ManifestError(f"attempt {attempt!r:.40} is not 16 hex digits", path="attempt")
    if hash_bytes not in (HASH_BYTES, LEGACY_HASH_BYTES) or type(hash_bytes) is not int:
        raise ManifestError(
            f"chunk hashes of {hash_bytes!r:.20} bytes: {HASH_BYTES} or {LEGACY_HASH_BYTES}",
            path="chunks.hash",
        )
    hashes: NDArray[np.uint8] | None = None
    if chunk_hashes is not None:
        raw = chunk_hashes.tobytes() if isinstance(chunk_hashes, np.ndarray) else chunk_hashes
        if (
            not isinstance(raw, (bytes, bytearray, memoryview))
            or memoryview(raw).nbytes != hash_bytes * chunks
        ):
            size = memoryview(raw).nbytes if isinstance(raw, (bytes, bytearray, memoryview)) else 0
            raise ManifestError(
                f"chunk hashes must be {hash_bytes} bytes for each of the {chunks} chunks, "
                f"not {size} bytes",
                path="chunks.hash64" if hash_bytes == HASH_BYTES else "chunks.hash",
            )
        hashes = np.frombuffer(bytes(raw), dtype=np.uint8).reshape(chunks, hash_bytes)
    return homes, hashes, base, attempt


def compared_hashes(chunk_hashes: NDArray[np.uint8]) -> NDArray[np.uint8]:
    """The ``(chunks, HASH_BYTES)`` hashes a save compares and records, of a manifest's
    ``chunk_hashes`` of either width (a view: the leading bytes of a legacy digest are exactly
    :func:`cloudckpt.checksum.content_hash`)."""
    return chunk_hashes[:, :HASH_BYTES]


def _typed(section: dict[str, Any], key: str, kind: type, path: str) -> Any:
    if key not in section:
        raise ManifestError("missing field", path=path)
    value = section[key]
    if type(value) is not kind:
        raise ManifestError(f"expected {kind.__name__}, got {type(value).__name__}", path=path)
    return value


def read_lineage(doc: dict[str, Any], chunks: dict[str, Any], version: int) -> dict[str, Any]:
    """The chunk hashes (``chunks.hash64``, version 2 on) and the version 3 fields of a decoded
    manifest document (``chunks``: its ``chunks`` map) as ``Manifest`` keyword arguments (their
    sizes are checked there by :func:`check_lineage`)."""
    out: dict[str, Any] = {}
    if version >= 2 and "hash64" in chunks:
        out.update(chunk_hashes=_typed(chunks, "hash64", bytes, "chunks.hash64"))
    if version < 3:
        return out
    algorithm = _typed(doc, "hash_algorithm", str, "hash_algorithm")
    legacy = _typed(chunks, "hash", bytes, "chunks.hash")
    if algorithm not in ("", LEGACY_HASH_ALGORITHM) or bool(algorithm) != bool(legacy):
        raise ManifestError(
            f"chunk hashes {algorithm!r:.40} ({len(legacy)} bytes) are not "
            f"{LEGACY_HASH_ALGORITHM!r} hashes",
            path="hash_algorithm",
        )
    if algorithm and out:
        raise ManifestError(
            f"chunks carry both {LEGACY_HASH_BYTES}-byte (chunks.hash) and {HASH_BYTES}-byte "
            "hashes (chunks.hash64)",
            path="chunks.hash64",
        )
    if algorithm:
        out.update(chunk_hashes=legacy, chunk_hash_bytes=LEGACY_HASH_BYTES)
    out.update(
        object_homes=_typed(doc, "homes", list, "homes"),
        base=_typed(doc, "base", str, "base"),
        attempt=_typed(doc, "attempt", str, "attempt"),
    )
    return out
