"""The crc32c-verified ranged read every backend's ``read_ranges`` runs: the backend supplies only
how to fetch bytes into destinations; validation, buffers, verification, the re-read and the
``ChecksumError`` are here, so they are the same everywhere.

A range whose bytes fail verification is read once more, alone (a transfer or page-cache
glitch heals); if the second read fails too the object itself is damaged: ``ChecksumError``
naming the key and byte range. Failed ranges are re-read in the order given, so the error names
the first damaged one. A range with ``sinks`` writes them only from a read that verified: a failed
range leaves its sinks untouched, even when the re-read fails too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from cloudckpt.storage.base import ReadRange, check_ranges
from cloudckpt.storage.ranges import HeldRange, bad_crc_ranges, checksum_error, crc_of


class Fetch(Protocol):
    def __call__(
        self,
        offsets: Sequence[int],
        lengths: Sequence[int],
        targets: Sequence[memoryview | HeldRange],
        *,
        reread: bool,
    ) -> Awaitable[None]:
        """Fill ``targets[i]`` with bytes ``[offsets[i], offsets[i] + lengths[i])`` of the object:
        a flat writable view by slice assignment, a ``HeldRange`` by slice assignment or ``add``
        (chunks it may keep until complete). Every target complete on return, or raise (past
        the end of the object: ``InvalidRange``). ``reread``: the call re-reads one range that
        failed verification (the first call reads them all and may coalesce them)."""


async def read_verified(
    key: str,
    ranges: Sequence[ReadRange],
    fetch: Fetch,
    *,
    where: str,
    hold: Callable[[int], contextlib.AbstractAsyncContextManager[None]] | None = None,
) -> list[memoryview]:
    """``ObjectStore.read_ranges`` of object ``key`` of the store at URL ``where``, over
    ``fetch`` (module docstring). ``hold(n)``, when given, is entered around the buffers the read
    allocates itself (``n`` bytes: ranges with neither ``out`` nor ``sinks``), before any
    request. Bad ranges raise ``ConfigError`` before anything is fetched."""
    outs = check_ranges(ranges)
    offsets = [r.offset for r in ranges]
    lengths = [r.length for r in ranges]
    held = [HeldRange(r) if r.sinks else None for r in ranges]
    buffered = sum(r.length for r, o, h in zip(ranges, outs, held) if o is None and h is None)
    async with hold(buffered) if hold is not None else contextlib.nullcontext():
        flat: list[memoryview | None] = []  # the range's view; None: a HeldRange (sinks)
        targets: list[memoryview | HeldRange] = []
        for r, o, h in zip(ranges, outs, held):
            if h is not None:
                flat.append(None)
                targets.append(h)
            else:
                view = o if o is not None else memoryview(bytearray(r.length))
                flat.append(view)
                targets.append(view)
        await fetch(offsets, lengths, targets, reread=False)
        crcs = [None if h is not None else r.crc32c for r, h in zip(ranges, held)]
        bad = await bad_crc_ranges(offsets, crcs, [v or memoryview(b"") for v in flat])
        bad += [i for i, h in enumerate(held) if h is not None and not h.ok]
        for i in sorted(bad):
            wanted = ranges[i].crc32c
            assert wanted is not None  # only a range with a crc32c fails verification
            expected = wanted & 0xFFFFFFFF
            own = flat[i]
            if own is None:
                again = HeldRange(ranges[i])
                await fetch([offsets[i]], [lengths[i]], [again], reread=True)
                actual = again.actual
            else:
                await fetch([offsets[i]], [lengths[i]], [own], reread=True)
                actual = await crc_of(own)
            if actual != expected:
                raise checksum_error(where, key, offsets[i], lengths[i], expected, actual)
        return [v if v is not None else memoryview(b"") for v in flat]
