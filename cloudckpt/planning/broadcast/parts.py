"""Broadcast parts: how each broadcast region of a load is cut for the wire.

A region several ranks need (a :class:`~cloudckpt.planning.broadcast.readers.Broadcast`) travels
as parts:

- a :class:`RunPart` when the region is at least ``run_min_bytes`` and its elements are one
  contiguous run of its chunk: a :class:`~cloudckpt.planning.load.windows.RunWindow` of about
  ``window_bytes``, which the source reads straight into its destination and every receiver
  takes straight into its own (one broadcast each);
- a :class:`WindowPart` otherwise: a checksum-aligned
  :class:`~cloudckpt.planning.load.windows.Window`, batched with others through a shared buffer in
  which every window starts at a multiple of :data:`~cloudckpt.planning.batching.WINDOW_ALIGN`
  (see :func:`~cloudckpt.planning.load.windows.layout_windows`).

The window size follows the load (:func:`part_window_bytes`): small enough that every source
sends its share in several rounds (fetching the next window while the previous one is exchanged)
and that an exchange buffer stays within the read budget.

Pure (ints and tuples, no I/O, no torch): every rank computes the same parts from the same
broadcasts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cloudckpt.manifest.model import Manifest
from cloudckpt.planning.batching import aligned
from cloudckpt.planning.broadcast.readers import Broadcast
from cloudckpt.planning.load.windows import RunWindow, Window, plan_run_windows
from cloudckpt.planning.load.windows_many import plan_windows_many

#: windows are not made smaller than this to get more rounds (each round costs collectives).
MIN_PART_WINDOW = 1 << 20
#: a source's share is cut in about this many windows, so fetching overlaps exchanging.
ROUNDS_PER_SOURCE = 4


def part_window_bytes(total_bytes: int, ranks: int, cap: int, max_read_bytes: int) -> int:
    """Window bytes for parts of a load that moves ``total_bytes`` among ``ranks`` ranks: at
    most ``cap``; at most a share ``total_bytes / ranks`` cut in :data:`ROUNDS_PER_SOURCE`
    (fetching round ``k + 1`` overlaps exchanging round ``k``, so only the last round's
    exchange waits) and at most ``max_read_bytes / (4 ranks)`` (an exchange buffer holds one
    window per rank); not below ``MIN_PART_WINDOW`` for the sake of more rounds alone."""
    ranks = max(1, ranks)
    share = -(-total_bytes // (ranks * ROUNDS_PER_SOURCE))
    memory = max_read_bytes // (4 * ranks)
    return max(min(cap, share, memory), min(cap, MIN_PART_WINDOW, memory), 1)


@dataclass(frozen=True, slots=True)
class WindowPart:
    """Window ``window`` of broadcast ``broadcast``'s region, carried in a batch buffer;
    ``nbytes``: the bytes it takes in a batch buffer and on the wire (aligned)."""

    broadcast: int
    window: Window
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", aligned(self.window.length))

    @property
    def fetch_bytes(self) -> int:
        """Bytes the source reads from the store for this part."""
        return self.window.length

    @property
    def payload_bytes(self) -> int:
        """Stored bytes this part carries to a receiver."""
        return self.window.length


@dataclass(frozen=True, slots=True)
class RunPart:
    """Run window ``run`` of broadcast ``broadcast``'s region: its own broadcast, straight
    between destinations."""

    broadcast: int
    run: RunWindow

    @property
    def nbytes(self) -> int:
        """Bytes this part takes on the wire: the region's bytes ``[run.lo, run.hi)``."""
        return self.run.hi - self.run.lo

    @property
    def fetch_bytes(self) -> int:
        """Bytes the source reads from the store (whole checksum blocks)."""
        return sum(b.length for b in self.run.blocks)

    @property
    def payload_bytes(self) -> int:
        """Region bytes this part carries to a receiver."""
        return self.run.hi - self.run.lo


Part = WindowPart | RunPart


def plan_parts(
    manifest: Manifest,
    broadcasts: Sequence[Broadcast],
    indices: Sequence[int],
    window_bytes: int,
    run_min_bytes: int,
) -> list[Part]:
    """The parts of broadcasts ``indices`` (in that order): run parts for a region of at least
    ``run_min_bytes`` stored as one run, window parts otherwise; each region's parts in byte
    order. Raises :class:`~cloudckpt.errors.ManifestError` for a region past its chunk's bytes.
    """
    runs = {
        i: plan_run_windows(manifest, broadcasts[i].region, window_bytes)
        for i in indices
        if broadcasts[i].region.nbytes >= run_min_bytes
    }
    rest = [i for i in indices if runs.get(i) is None]
    windows = dict(
        zip(rest, plan_windows_many(manifest, [broadcasts[i].region for i in rest], window_bytes))
    )
    parts: list[Part] = []
    for i in indices:
        run_windows = runs.get(i)
        if run_windows is not None:
            parts.extend(RunPart(i, r) for r in run_windows)
        else:
            parts.extend(WindowPart(i, w) for w in windows[i])
    return parts
