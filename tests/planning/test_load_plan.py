"""Load planning: overlaps, errors (missing, shape, coverage), dtype conversion, codec."""

from __future__ import annotations

import numpy as np
import pytest

from cloudckpt.errors import CoverageError, MissingKeysError, PlanningError, ShapeMismatchError
from cloudckpt.manifest.builder import ManifestBuilder
from cloudckpt.manifest.model import crc_counts
from cloudckpt.planning.load.plan import LocalLoadPlan, ReadItem, plan_local_load
from cloudckpt.planning.load.plan_codec import decode_local_load_plan, encode_local_load_plan
from cloudckpt.planning.pieces import PieceSpec


def manifest_with(tensors, values=None, block=1 << 20):
    """tensors: {name: (dtype, shape, [(offsets, sizes), ...])}."""
    from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE

    b = ManifestBuilder(world_size=2, checksum_block_size=block, created_at=0.0)
    pos = 0  # chunks follow each other in the one object (no two share bytes)
    for name, (dtype, shape, boxes) in tensors.items():
        b.add_tensor(name, dtype, shape)
        for off, size in boxes:
            n = int(np.prod(size, dtype=np.int64)) * DTYPE_ITEMSIZE[dtype]
            b.add_chunk(
                name,
                off,
                size,
                "data/x/r0.bin",
                pos,
                n,
                [0] * int(crc_counts(np.array([n]), block)[0]),
            )
            pos += n
    for k, v in (values or {}).items():
        b.set_value(k, v)
    return b.build()


ROWS = {"w": ("float32", (6, 4), [((0, 0), (3, 4)), ((3, 0), (3, 4))])}


def test_request_spanning_two_chunks():
    m = manifest_with(ROWS)
    plan = plan_local_load(m, [PieceSpec("w", "float32", (6, 4), (2, 1), (2, 3))], rank=0)
    assert list(plan.reads) == [
        ReadItem(0, "w", 0, (0, 0), (2, 1), (1, 3), 12, True),
        ReadItem(0, "w", 1, (1, 0), (0, 1), (1, 3), 12, True),
    ]
    assert plan.unexpected == () and plan.missing == ()


def test_dtype_difference_is_planned_in_stored_bytes():
    m = manifest_with({"w": ("bfloat16", (4,), [((0,), (4,))])})
    plan = plan_local_load(m, [PieceSpec("w", "float32", (4,), (0,), (4,))], rank=0)
    assert [(r.lengths, r.nbytes) for r in plan.reads] == [((4,), 8)]


def test_scalar_and_empty_requests():
    m = manifest_with({"s": ("int64", (), [((), ())]), "e": ("float32", (0, 2), [])})
    plan = plan_local_load(
        m,
        [PieceSpec("s", "int64", (), (), ()), PieceSpec("e", "float32", (0, 2), (0, 0), (0, 2))],
        rank=0,
    )
    assert list(plan.reads) == [ReadItem(0, "s", 0, (), (), (), 8, True)]


def test_missing_names_are_listed_and_unexpected_reported():
    m = manifest_with(ROWS, values={"lr": 0.1, "step": 3})
    reqs = [
        PieceSpec("nope", "float32", (1,), (0,), (1,)),
        PieceSpec("w", "float32", (6, 4), (0, 0), (6, 4)),
    ]
    with pytest.raises(MissingKeysError) as exc:
        plan_local_load(m, reqs, rank=0, value_names=["lr", "gone"])
    assert (
        exc.value.keys == ("nope", "gone")
        and "'nope'" in str(exc.value)
        and "'gone'" in str(exc.value)
    )
    assert isinstance(exc.value, KeyError)
    plan = plan_local_load(m, reqs, rank=0, value_names=["lr", "gone"], strict=False)
    assert plan.missing == ("nope", "gone") and plan.unexpected == ("step",)
    assert len(plan.reads) == 2


def test_shape_mismatch_names_both_shapes():
    m = manifest_with(ROWS)
    with pytest.raises(ShapeMismatchError, match=r"'w'.*\(6, 4\).*\(6, 5\)"):
        plan_local_load(m, [PieceSpec("w", "float32", (6, 5), (0, 0), (6, 5))], rank=0)


def test_overlapping_stored_chunks_are_a_coverage_error():
    # element counts add up (2 + 2 == 4), so the manifest validates; the overlap shows at load time
    m = manifest_with({"w": ("int8", (4,), [((0,), (2,)), ((1,), (2,))])})
    with pytest.raises(CoverageError, match=r"'w'.*overlap at \[1:2\]"):
        plan_local_load(m, [PieceSpec("w", "int8", (4,), (0,), (4,))], rank=0)


def test_many_chunks_find_exactly_the_overlapping_ones():
    n = 4000
    boxes = [((i, 0), (1, 3)) for i in range(n)]
    m = manifest_with({"w": ("int8", (n, 3), boxes[::-1])})  # stored in reverse: the index sorts
    plan = plan_local_load(m, [PieceSpec("w", "int8", (n, 3), (1000, 1), (3, 2))], rank=0)
    assert sorted(r.chunk_index for r in plan.reads) == [n - 1 - 1002, n - 1 - 1001, n - 1 - 1000]
    assert sorted(r.dest_offsets for r in plan.reads) == [(0, 0), (1, 0), (2, 0)]


def test_grid_chunks_with_2d_requests():
    boxes = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    m = manifest_with({"g": ("float64", (4, 6), boxes)})
    plan = plan_local_load(m, [PieceSpec("g", "float64", (4, 6), (1, 2), (2, 2))], rank=0)
    got = sorted((r.chunk_index, r.src_offsets, r.dest_offsets, r.lengths) for r in plan.reads)
    assert got == [
        (0, (1, 2), (0, 0), (1, 1)),
        (1, (1, 0), (0, 1), (1, 1)),
        (2, (0, 2), (1, 0), (1, 1)),
        (3, (0, 0), (1, 1), (1, 1)),
    ]


def test_load_plan_codec_round_trip():
    m = manifest_with({**ROWS, "s": ("bool", (), [((), ())])}, values={"v": 1})
    plan = plan_local_load(
        m,
        [
            PieceSpec("w", "float32", (6, 4), (1, 0), (4, 4), broadcastable=False),
            PieceSpec("s", "bool", (), (), ()),
        ],
        rank=3,
    )
    back = decode_local_load_plan(encode_local_load_plan(plan))
    assert back == plan and back.rank == 3 and back.unexpected == ("v",)
    assert [r.broadcastable for r in back.reads] == [False, False, True]
    built = LocalLoadPlan(rank=3, reads=tuple(plan.reads), unexpected=("v",))
    assert decode_local_load_plan(encode_local_load_plan(built)) == plan


@pytest.mark.parametrize("data", [b"", b"\x80", b"\x81\xa6format\xa3bad", b"\xc1"])
def test_malformed_load_plan_bytes(data):
    with pytest.raises(PlanningError):
        decode_local_load_plan(data)
