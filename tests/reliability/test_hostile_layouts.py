"""Hostile chunk layouts cost bounded work and memory to plan, measured (never timed):

- the reported manifest, a ``(24000, 24000)`` tensor whose columns are split at different rows
  (48,000 chunks; its exact-cover check took 160 s): the check keeps at most 4 signed boxes in
  flight per chunk, planning a one-element load tests a few chunks, not 48,000, and stays under
  a memory bound; the same for its transpose;
- many zero-element chunks: planning indexes only the non-empty ones;
- a one-element load from a real column-split checkpoint reads one chunk.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

import cloudckpt
from cloudckpt.manifest.codec import DIMS_PER_BYTE, decode_manifest
from cloudckpt.planning import cover_sweep
from cloudckpt.planning.load.chunk_index import LEAF_CHUNKS, manifest_index
from cloudckpt.planning.load.plan import plan_local_load
from cloudckpt.planning.pieces import PieceSpec
from tests.reliability import hostile_layouts as hl

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20


def _traced(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("layout", ["columns", "rows"])
def test_the_24000_column_split_plans_one_element_in_bounded_work(layout, figures):
    shape, off, size = (hl.column_split if layout == "columns" else hl.row_split)(24_000)
    data = hl.layout_manifest_bytes({"w": (shape, off, size)})
    assert len(data) < 1 << 20
    stats: dict = {}
    assert cover_sweep.find_defect(shape, off, size, stats=stats) is None
    assert stats["rows"] == len(off) + 1 and stats["max_entries"] <= 4 * stats["rows"], stats
    manifest = decode_manifest(data)
    request = [PieceSpec("w", "uint8", shape, (12_345, 23_456), (1, 1))]
    plan, peak = _traced(lambda: plan_local_load(manifest, request, rank=0))
    (read,) = plan.reads
    box = off[read.chunk_index], off[read.chunk_index] + size[read.chunk_index]
    assert (box[0] <= (12_345, 23_456)).all() and ((12_345, 23_456) < box[1]).all()
    index = manifest_index(manifest).general(0)
    assert index.tested <= 4 * LEAF_CHUNKS, index.tested  # of 48,000 chunks
    # the index and the check together: a few times the chunk table (48,000 x 2 x 2 int64 = 1.5 MiB)
    assert peak < 48 * MiB, f"planning peak {peak / MiB:.0f} MiB"
    figures.add("hostile layouts (planned)")


@pytest.mark.parametrize("ndim", [8, 64])
def test_empty_chunks_cost_planning_nothing(ndim, figures):
    """100,000 zero-element chunks beside one real chunk: the planner's index holds one row.
    Where the decoder refuses that many coordinates for the manifest's size (its own bound:
    tests/manifest), the same chunks padded to a size it accepts are planned instead."""
    try:
        manifest = decode_manifest(hl.empty_chunks(400_000, ndim))
    except cloudckpt.errors.ManifestError as exc:
        assert "per byte" in str(exc), exc
        pad = (400_000 // 4 + 1) * ndim // DIMS_PER_BYTE + 4096
        manifest = decode_manifest(hl.empty_chunks(400_000, ndim, pad=pad))
    shape = manifest.tensors["w"].shape
    request = [PieceSpec("w", "uint8", shape, (2,) + (0,) * (ndim - 1), (1,) * ndim)]
    plan, peak = _traced(lambda: plan_local_load(manifest, request, rank=0))
    assert len(plan.reads) == 1 and len(manifest_index(manifest).order) == 1
    assert peak < 8 * MiB, f"planning peak {peak / MiB:.1f} MiB for {manifest.num_chunks} chunks"
    figures.add("hostile layouts (planned)")


def test_one_element_load_from_a_column_split_checkpoint(tmp_path):
    """End to end on LocalStore: one element of a (2000, 2000) column-split tensor, through
    ``load``; it arrives, and the only data read is the one chunk holding it."""
    from tests.reliability.stores import RawCheckpoint

    url = str(tmp_path / "ckpt")
    shape, off, size = hl.column_split(2000)
    manifest = hl.write_layout(RawCheckpoint(url), {"w": (shape, off, size)})
    dest = {
        "w": cloudckpt.GlobalPiece(torch.full((1, 1), 7, dtype=torch.uint8), shape, (1234, 567))
    }
    result = cloudckpt.load(dest, url)
    assert int(dest["w"].local[0, 0]) == 0
    holder = np.flatnonzero(((off <= (1234, 567)) & ((1234, 567) < off + size)).all(axis=1))
    assert len(holder) == 1
    assert result.bytes_fetched <= manifest.tensors["w"].chunks[int(holder[0])].byte_length
