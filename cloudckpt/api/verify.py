"""``cloudckpt.verify``: read every byte a checkpoint refers to and check every checksum.

``verify`` agrees with ``load``: whatever makes ``load_full`` refuse a checkpoint whose manifest
decodes makes the report not ``ok``: chunks that leave a gap in or overlap a tensor, chunk
layouts too irregular to check, dtypes this torch cannot hold (the planner's own checks), data
objects missing or shorter than their chunks, corrupted bytes. Pickled values are never
unpickled, so one that would not unpickle is not seen.

Contract: one process, no collective. Each data object the chunks use (and only those: nothing
is listed) is checked for existence and size (one ``head``), then every non-empty chunk is read
in full with each checksum block verified, a fixed number of chunks at a time, through windows of
whole blocks in reused buffers (memory stays under about 128 MiB whatever the chunk sizes).
Problems are collected (not raised) so one run names every damaged object; the report is ``ok``
only when there are none. A missing or invalid manifest raises (there is nothing to
verify against); a manifest's own checksum (format version 2) is checked before it is decoded,
and a manifest without one (version 1, written by an older cloudckpt) is reported in ``notes``
(a warning, not a problem: the data is verified all the same).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import torch

from cloudckpt.dataplane.buffers import BufferPool
from cloudckpt.dataplane.reader import read_windows
from cloudckpt.errors import CloudCkptError
from cloudckpt.manifest.framing import stored_version
from cloudckpt.planning.load.chunk_index import coverage_errors
from cloudckpt.planning.load.plan import Region
from cloudckpt.planning.load.windows import plan_windows
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.statedict.dtypes import torch_dtype
from cloudckpt.stored import decode_manifest_without_pickle, read_manifest_bytes, reading_view

#: bytes read and checked at once per request; at most ``_IN_FLIGHT`` chunks in progress.
_WINDOW = 16 << 20
_IN_FLIGHT = 8


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of :func:`verify`: ``problems`` names each damaged object and what is wrong."""

    url: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    objects_checked: int = 0
    bytes_checked: int = 0
    notes: list[str] = field(default_factory=list)  # warnings that do not make it fail


#: The note of a manifest without a checksum of its own.
UNCHECKSUMMED = (
    "the manifest has no checksum of its own (format version 1, written by an "
    "older cloudckpt): damage to it cannot be detected; the data was verified"
)


def verify(url: str, *, storage=None, progress=None) -> VerifyReport:
    """Verify the checkpoint at ``url``. ``progress(nbytes)`` is called as bytes are checked."""
    store = shared_store(url, storage)
    raw = read_manifest_bytes(url, store=store)
    manifest, _ = decode_manifest_without_pickle(raw)
    notes = [UNCHECKSUMMED] if stored_version(raw) == 1 else []
    del raw
    store, manifest = reading_view(url, storage, manifest, store=store)
    return run_coroutine(_verify(url, store, manifest, progress, notes))


def layout_problems(manifest) -> list[str]:
    """What load planning would refuse in the manifest itself: coverage and dtypes."""
    problems = [f"{type(exc).__name__}: {exc}" for exc in coverage_errors(manifest)]
    for dtype in sorted({manifest.tensors[name].dtype for name in manifest.tensors}):
        try:
            torch_dtype(dtype)
        except CloudCkptError as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
    return problems


async def _verify(url, store, manifest, progress, notes) -> VerifyReport:
    problems: list[str] = []
    expected = {k: end for k, end in manifest.object_extents().items() if end > 0}  # used objects
    bad_objects: set[str] = set()
    problems += layout_problems(manifest)

    async def check_object(key: str, size: int) -> None:
        try:
            info = await store.head(key)
        except CloudCkptError as exc:
            problems.append(f"{key}: {type(exc).__name__}: {exc}")
            bad_objects.add(key)
            return
        if info.size < size:
            problems.append(f"{key}: truncated: {info.size} bytes stored, at least {size} expected")
            bad_objects.add(key)

    await asyncio.gather(*(check_object(k, n) for k, n in expected.items()))

    checked = 0
    pool = BufferPool(_WINDOW + 64)

    async def check_chunk(name: str, index: int, chunk) -> None:
        nonlocal checked
        key = manifest.objects[chunk.object_index]
        if key in bad_objects:
            return
        region = Region(name, index, (0,) * len(chunk.sizes), tuple(chunk.sizes), chunk.byte_length)
        try:
            windows = plan_windows(manifest, region, _WINDOW)
        except CloudCkptError as exc:
            problems.append(f"{key}: tensor {name!r} chunk {index}: {type(exc).__name__}: {exc}")
            return
        for window in windows:
            buf = pool.take() if window.length <= pool.size else None
            try:
                await read_windows(
                    store,
                    [window],
                    buf if buf is not None else torch.empty(window.length, dtype=torch.uint8),
                )
            except CloudCkptError as exc:
                problems.append(
                    f"{key}: tensor {name!r} chunk {index}: {type(exc).__name__}: {exc}"
                )
                return
            finally:
                if buf is not None:
                    pool.give(buf)
            checked += window.length
            if progress is not None:
                progress(window.length)

    chunks = _nonempty_chunks(manifest)

    async def worker() -> None:  # a fixed number of chunks in progress, however many there are
        for name, index in chunks:
            await check_chunk(name, index, manifest.tensors[name].chunks[index])

    await asyncio.gather(*(worker() for _ in range(_IN_FLIGHT)))
    return VerifyReport(
        url=url,
        ok=not problems,
        problems=sorted(problems),
        objects_checked=len(expected),
        bytes_checked=checked,
        notes=notes,
    )


def _nonempty_chunks(manifest):
    """(tensor name, chunk index) of every chunk holding bytes (empty chunks are never read)."""
    for name in manifest.tensors:
        lengths = manifest.tensors[name].chunks.byte_length
        for index in np.flatnonzero(np.asarray(lengths) > 0).tolist():
            yield name, index
