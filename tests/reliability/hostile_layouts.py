"""Adversarial chunk layouts (valid tilings and broken ones) and manifests built from them.

Each layout function returns ``(shape, offsets, sizes)`` with ``(n, ndim)`` int64 arrays;
:func:`layout_manifest` wraps layouts into a :class:`~cloudckpt.manifest.Manifest` (uint8
tensors, chunks back to back in one all-zero object) and :func:`write_layout` writes it as a
checkpoint. Used by the coverage tests (tests/planning, tests/reliability) and by
``benchmarks/planning.py`` (its hostile-manifest section).

Layouts:

- :func:`column_split`: a ``(K, K)`` tensor whose column ``j`` is split in two at row ``r_j``,
  the rows all different: no axis is a slab axis, and no two columns line up. The layout that
  made the old pairwise check quadratic (K = 24,000: 48,000 chunks, a ~480 KB manifest).
- :func:`row_split`: its transpose.
- :func:`staircase`: the corner ``[0, c)^d`` and ``d`` L-shaped slabs around it, in ``d`` dims.
- :func:`brick_wall`: rows of bricks, each row's joints shifted (not a grid, not slabs).
- :func:`spiral`: strips peeled off alternately along each axis (a guillotine layout whose cuts
  are all one box deep).
- :func:`tiny_cubes`: a ``2 x 2 x ... `` grid of unit cells in ``d`` dims (``2**d`` chunks).
- :func:`with_defect`: the same layout with one gap or one overlap.

Whole manifests (stored bytes): :func:`empty_chunks` (many zero-element chunks of a 64-dim
tensor) and :func:`deep_structure`, both through :func:`with_fields`.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np

from cloudckpt.checksum import block_crcs
from cloudckpt.manifest.codec import encode_manifest
from cloudckpt.manifest.columns import encode_int_column
from cloudckpt.manifest.model import Manifest
from cloudckpt.manifest.values import encode_value

ATTEMPT = "0123456789abcdef"


def _arrays(pairs, ndim):
    off = np.array([p[0] for p in pairs], dtype=np.int64).reshape(len(pairs), ndim)
    size = np.array([p[1] for p in pairs], dtype=np.int64).reshape(len(pairs), ndim)
    return off, size


def column_split(k: int, seed: int = 0):
    """``(K, K)``: column ``j`` holds rows ``[0, r_j)`` and ``[r_j, K)``, the ``r_j`` a permutation
    of distinct rows in ``1..K-1`` (so ``K - 1`` columns; the last column is whole)."""
    rng = np.random.default_rng(seed)
    cuts = rng.permutation(np.arange(1, k, dtype=np.int64))  # k - 1 distinct rows
    cols = np.arange(k - 1, dtype=np.int64)
    top_off = np.stack([np.zeros(k - 1, np.int64), cols], axis=1)
    top_size = np.stack([cuts, np.ones(k - 1, np.int64)], axis=1)
    bot_off = np.stack([cuts, cols], axis=1)
    bot_size = np.stack([k - cuts, np.ones(k - 1, np.int64)], axis=1)
    last_off = np.array([[0, k - 1]], dtype=np.int64)
    last_size = np.array([[k, 1]], dtype=np.int64)
    off = np.concatenate([top_off, bot_off, last_off])
    size = np.concatenate([top_size, bot_size, last_size])
    order = np.lexsort((off[:, 0], off[:, 1]))  # column by column, as a saver would list them
    return (k, k), off[order], size[order]


def row_split(k: int, seed: int = 0):
    shape, off, size = column_split(k, seed)
    return shape, off[:, ::-1].copy(), size[:, ::-1].copy()


def staircase(d: int, side: int = 3, corner: int = 2):
    """In ``d`` dims of ``side``: the corner ``[0, corner)^d`` and, for each ``k``, the slab
    ``x_k >= corner, x_i < corner (i < k)``, any ``x_i`` for ``i > k``: ``d + 1`` chunks."""
    pairs = [((0,) * d, (corner,) * d)]
    for k in range(d):
        off = [0] * d
        size = [side] * d
        for i in range(k):
            size[i] = corner
        off[k], size[k] = corner, side - corner
        pairs.append((tuple(off), tuple(size)))
    off, size = _arrays(pairs, d)
    return (side,) * d, off, size


def brick_wall(rows: int, bricks: int, width: int = 7, seed: int = 0):
    """``rows`` rows of height 1, each of ``bricks`` bricks with randomly placed joints."""
    rng = np.random.default_rng(seed)
    total = bricks * width
    pairs = []
    for r in range(rows):
        joints = np.sort(rng.choice(np.arange(1, total), size=bricks - 1, replace=False))
        edges = np.concatenate(([0], joints, [total]))
        for a, b in zip(edges[:-1], edges[1:]):
            pairs.append(((r, int(a)), (1, int(b - a))))
    off, size = _arrays(pairs, 2)
    return (rows, total), off, size


def spiral(n: int, d: int = 2):
    """A ``(n, ..., n)`` tensor peeled one unit strip at a time, cycling through the axes."""
    lo, hi = [0] * d, [n] * d
    pairs = []
    k = 0
    while all(high - low > 0 for low, high in zip(lo, hi)):
        axis = k % d
        off, size = list(lo), [high - low for low, high in zip(lo, hi)]
        if size[axis] == 1 or any(s == 0 for s in size):
            pairs.append((tuple(off), tuple(size)))
            break
        size[axis] = 1
        pairs.append((tuple(off), tuple(size)))
        lo[axis] += 1
        k += 1
    off, size = _arrays(pairs, d)
    return (n,) * d, off, size


def tiny_cubes(d: int):
    """Every unit cell of ``(2,) * d``: ``2**d`` one-element chunks."""
    cells = np.array(list(np.ndindex(*(2,) * d)), dtype=np.int64).reshape(-1, d)
    return (2,) * d, cells, np.ones_like(cells)


def with_defect(layout, kind: str, seed: int = 0):
    """The layout with one ``"gap"`` (a chunk shrunk by one along an axis it spans more than
    one element of; with unit chunks only, one chunk dropped) or one ``"overlap"`` (a chunk
    grown by one where the tensor has room; else one chunk listed twice)."""
    shape, off, size = layout
    off, size = off.copy(), size.copy()
    rng = np.random.default_rng(seed)
    for i in rng.permutation(len(off)).tolist():
        for axis in rng.permutation(len(shape)).tolist():
            if kind == "gap" and size[i, axis] > 1:
                size[i, axis] -= 1
                return shape, off, size
            if kind == "overlap" and off[i, axis] + size[i, axis] < shape[axis]:
                size[i, axis] += 1
                return shape, off, size
    i = int(rng.integers(len(off)))
    if kind == "gap":  # unit chunks only: drop one
        return shape, np.delete(off, i, 0), np.delete(size, i, 0)
    return shape, np.concatenate((off, off[i : i + 1])), np.concatenate((size, size[i : i + 1]))


DATA_KEY = f"data/{ATTEMPT}/r00000-0000.bin"


def layout_manifest(layouts: dict, *, checksums: bool = False, block: int = 1 << 40) -> Manifest:
    """A manifest holding one uint8 tensor per ``name -> (shape, offsets, sizes)``.

    Chunks lie back to back in object :data:`DATA_KEY` (all zero bytes, see :func:`write_layout`);
    byte lengths match the boxes, so the manifest decodes as long as each tensor's chunks hold as
    many elements as it has. Whether they cover it exactly once is left to the planner (this is
    what the tests attack). crcs are those of the zero bytes with ``checksums``, else 0 (enough
    for planning, which never reads data).
    """
    names, shapes, counts, offs, sizes, numel = [], [], [], [], [], []
    for name, (shape, off, size) in layouts.items():
        off = np.asarray(off, dtype=np.int64).reshape(len(off), len(shape))
        size = np.asarray(size, dtype=np.int64).reshape(len(off), len(shape))
        names.append(name)
        shapes.append(tuple(int(s) for s in shape))
        counts.append(len(off))
        offs.append(off.reshape(-1))
        sizes.append(size.reshape(-1))
        numel.append(np.array([math.prod(s) for s in size.tolist()], dtype=np.int64))
    lengths = np.concatenate(numel) if numel else np.zeros(0, np.int64)
    byte_offset = (np.cumsum(lengths) - lengths).astype(np.int64)
    if checksums:
        crcs = [c for n in lengths.tolist() for c in block_crcs(bytes(n), block)]
    else:
        crcs = [0] * sum(max(1, -(-n // block)) for n in lengths.tolist())
    n = len(lengths)
    return Manifest(
        world_size=1,
        created_at=0.0,
        cloudckpt_version="test",
        metadata={},
        checksum_block_size=block,
        objects=[DATA_KEY],
        tensor_names=names,
        tensor_dtypes=["uint8"] * len(names),
        tensor_shapes=shapes,
        chunk_counts=counts,
        chunk_offsets=np.concatenate(offs) if offs else np.zeros(0, np.int64),
        chunk_sizes=np.concatenate(sizes) if sizes else np.zeros(0, np.int64),
        chunk_object_index=np.zeros(n, np.int64),
        chunk_byte_offset=byte_offset,
        chunk_byte_length=lengths,
        chunk_crcs=np.array(crcs, dtype=np.int64),
        value_blobs={},
        structure=["d", [[name, ["x", name]] for name in names]],
    )


def layout_manifest_bytes(layouts: dict, **kw) -> bytes:
    return encode_manifest(layout_manifest(layouts, **kw))


def write_layout(raw, layouts: dict, *, block: int = 1 << 40) -> Manifest:
    """Write a checkpoint of ``layouts`` through ``raw`` (a
    ``tests.reliability.stores.RawCheckpoint``): its data object (zeros) and its manifest, with real
    crcs."""
    manifest = layout_manifest(layouts, checksums=True, block=block)
    raw.write(DATA_KEY, bytes(manifest.total_bytes()))
    raw.write("manifest.msgpack", encode_manifest(manifest))
    return manifest


def with_fields(manifest: Manifest, **fields) -> bytes:
    """The stored bytes of ``manifest`` with top-level document fields replaced by ``fields``
    (msgpack-ready values): what an attacker who writes the manifest file can store. Keeps the
    manifest's framing when the format has one (``cloudckpt.manifest.framing``)."""
    data = encode_manifest(manifest)
    try:
        from cloudckpt.manifest import framing
    except ImportError:  # format version 1: the document is the file
        doc = msgpack.unpackb(data, raw=False)
        doc.update(fields)
        return msgpack.packb(doc, use_bin_type=True)
    version, payload = framing.unframe(data)
    doc = msgpack.unpackb(bytes(payload), raw=False)
    doc.update(fields)
    return framing.frame(msgpack.packb(doc, use_bin_type=True), version)


def empty_chunks(size: int, ndim: int = 64, *, pad: int = 0) -> bytes:
    """About ``size`` bytes of manifest: a ``(4, 1, ..., 1)`` uint8 tensor of ``ndim`` dims held
    by one whole chunk and ``size // 4`` zero-element chunks (4 bytes of crc each, ``2 * ndim``
    coordinates each, the coordinate columns compressing to almost nothing). ``pad`` bytes more
    in a top-level field no decoder reads (an attacker's way past a bound set by the size)."""
    n = max(1, size // 4) + 1
    offsets = np.zeros((ndim, n), dtype=np.int64)  # dimension-major, as stored
    sizes = np.ones((ndim, n), dtype=np.int64)
    sizes[0, 0] = 4
    sizes[0, 1:] = 0
    offsets[0, 1:] = np.arange(1, n) % 5
    lengths = np.zeros(n, dtype=np.int64)
    lengths[0] = 4
    crcs = np.zeros(n, dtype="<u4")
    crcs[0] = block_crcs(bytes(4), 1 << 40)[0]
    shape = [4] + [1] * (ndim - 1)
    return with_fields(
        layout_manifest({}),
        checksum_block_size=1 << 40,
        tensors={
            "names": ["w"],
            "dtypes": ["uint8"],
            "ndims": encode_int_column([ndim]),
            "shapes": encode_int_column(shape),
            "chunk_counts": encode_int_column([n]),
        },
        chunks={
            "offsets": encode_int_column(offsets.reshape(-1), delta=True),
            "sizes": encode_int_column(sizes.reshape(-1), delta=True),
            "object_index": encode_int_column(np.zeros(n, np.int64), delta=True),
            "byte_offset": encode_int_column(np.zeros(n, np.int64), delta=True),
            "byte_length": encode_int_column(lengths, delta=True),
            "crc32c": crcs.tobytes(),
        },
        structure=encode_value(["d", [["w", ["x", "w"]]]], key="structure", allow_pickle=False),
        **({"x_padding": bytes(pad)} if pad else {}),
    )


def deep_structure(depth: int) -> bytes:
    """A one-tensor manifest whose structure is ``depth`` nested one-element lists (msgpack
    arrays) around nothing: far past any accepted nesting when ``depth`` is large."""
    manifest = layout_manifest(
        {"w": ((4,), np.zeros((1, 1), np.int64), np.full((1, 1), 4))}, checksums=True
    )
    return with_fields(manifest, structure=b"\x91" * depth + b"\xc0")
