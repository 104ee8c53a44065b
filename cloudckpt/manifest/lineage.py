"""What a format version 3 manifest adds for incremental checkpoints, and its validation.

- ``object_homes``: per object, ``""`` (the object lies under this checkpoint's own root) or the
  name of a *sibling* folder of the same run (``<run root>/<home>/<key>``): one path segment, not
  ``.`` or ``..``, no control character, no backslash. A key therefore never resolves outside the
  run root. References are flat: a home holds the object itself, never another reference.
- ``chunk_hashes``: per chunk, a 16-byte content hash (:data:`HASH_ALGORITHM`) of its bytes, or
  none at all; a later save compares against them without reading data.
- ``base``: the folder of the checkpoint this one was made from (``""``: none).
- ``attempt``: the save attempt that wrote it (16 hex digits, ``""`` unknown): the name of its
  pins in the folders it references (see ``cloudckpt.layout.pin_key``).

Pure; every problem is a :class:`~cloudckpt.errors.ManifestError` naming its path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray

from cloudckpt.errors import ManifestError

#: The content hash of a chunk's bytes (xxhash's XXH3, 128 bits; see docs/decisions.md).
HASH_ALGORITHM = "xxh3-128"
HASH_BYTES = 16
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
) -> tuple[tuple[str, ...], NDArray[np.uint8] | None, str, str]:
    """Validated ``(object_homes, chunk_hashes, base, attempt)``: a tuple of ``objects`` homes,
    a read-only ``(chunks, 16)`` uint8 array or None, and two strings."""
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
    hashes: NDArray[np.uint8] | None = None
    if chunk_hashes is not None:
        raw = chunk_hashes.tobytes() if isinstance(chunk_hashes, np.ndarray) else chunk_hashes
        if (
            not isinstance(raw, (bytes, bytearray, memoryview))
            or memoryview(raw).nbytes != HASH_BYTES * chunks
        ):
            raise ManifestError(
                f"chunk hashes must be {HASH_BYTES} bytes for each of the {chunks} chunks",
                path="chunks.hash",
            )
        hashes = np.frombuffer(bytes(raw), dtype=np.uint8).reshape(chunks, HASH_BYTES)
    return homes, hashes, base, attempt
