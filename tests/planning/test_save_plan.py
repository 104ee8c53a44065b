"""Global save planning: agreement and coverage errors, replica assignment, codecs, plan cache."""

from __future__ import annotations

import numpy as np
import pytest

from cloudckpt.errors import CoverageError, LayoutMismatchError, PlanningError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from cloudckpt.planning.pieces import PieceHeader, PieceSpec, PieceTable
from cloudckpt.planning.save.cache import SavePlanCache, key_digest, save_plan_cache_key
from cloudckpt.planning.save.global_plan import plan_global_save
from cloudckpt.planning.save.local_plan import (
    LocalSavePlan,
    decode_local_save_plan,
    encode_local_save_plan,
)


def plans_of(*per_rank, values=()):
    world = len(per_rank)
    return [
        LocalSavePlan(rank=r, world_size=world, pieces=p, value_names=tuple(values))
        for r, p in enumerate(per_rank)
    ]


def rows(name, shape, start, n, dtype="float32"):
    return PieceSpec(
        name, dtype, shape, (start,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:])
    )


def test_dtype_allow_list():
    assert {"float32", "bfloat16", "bool", "float8_e4m3fn", "float8_e5m2", "complex128"} <= set(
        DTYPE_ITEMSIZE
    )
    assert DTYPE_ITEMSIZE["bfloat16"] == 2 and DTYPE_ITEMSIZE["complex128"] == 16
    with pytest.raises(PlanningError, match="not supported"):
        PieceSpec("w", "float128", (1,), (0,), (1,))


def test_piece_spec_validation_and_sizes():
    p = PieceSpec("w", "bfloat16", [4, 3], [2, 0], [2, 3])
    assert p.global_shape == (4, 3) and p.numel == 6 and p.nbytes == 12
    with pytest.raises(PlanningError, match="not inside"):
        PieceSpec("w", "float32", (4,), (3,), (2,))
    with pytest.raises(PlanningError, match="same length"):
        PieceSpec("w", "float32", (4, 1), (0,), (4,))


def test_sharded_tensor_one_chunk_per_rank_in_piece_order():
    p = plans_of(
        [rows("w", (5, 2), 0, 3), PieceSpec("s", "int64", (), (), ())],
        [PieceSpec("s", "int64", (), (), ()), rows("w", (5, 2), 3, 2)],
    )
    g0, g1 = (plan_global_save(p, rank=r) for r in range(2))
    sk = g0.skeleton
    assert sk.names == ("w", "s") and sk.shapes == ((5, 2), ())
    off, size, writer = sk.chunks_of("w")
    assert (
        off.tolist() == [[0, 0], [3, 0]]
        and size.tolist() == [[3, 2], [2, 2]]
        and writer.tolist() == [0, 1]
    )
    assert [(w.chunk_id, w.name, w.piece_index) for w in g0.writes] == [(0, "w", 0)]
    # the replicated scalar goes to the rank with fewer bytes (rank 1: 16 < 24)
    assert [(w.chunk_id, w.name, w.piece_index, w.nbytes) for w in g1.writes] == [
        (2, "s", 0, 8),
        (1, "w", 1, 16),
    ]
    assert g0.skeleton.digest() == g1.skeleton.digest()


def test_replicas_heaviest_first_to_fewest_bytes_ties_lowest_rank():
    whole = [
        PieceSpec("big", "float32", (10,), (0,), (10,)),
        PieceSpec("mid", "float32", (6,), (0,), (6,)),
        PieceSpec("small", "float32", (4,), (0,), (4,)),
        PieceSpec("tiny", "float32", (4,), (0,), (4,)),
    ]
    p = plans_of(whole, whole, whole)
    writer = {
        n: int(plan_global_save(p, rank=0).skeleton.chunks_of(n)[2][0])
        for n in ("big", "mid", "small", "tiny")
    }
    # big(40) -> r0 (tie, lowest); mid(24) -> r1; small(16) -> r2; tiny(16) -> r2 (16 < 24 < 40)
    assert writer == {"big": 0, "mid": 1, "small": 2, "tiny": 2}
    lowest = plan_global_save(p, rank=0, replicas_to_lowest_rank=True).skeleton
    assert lowest.writer.tolist() == [0, 0, 0, 0]


def test_replica_assignment_counts_unique_pieces_first():
    p = plans_of(
        [rows("w", (8, 1), 0, 6), PieceSpec("b", "float32", (2,), (0,), (2,))],
        [rows("w", (8, 1), 6, 2), PieceSpec("b", "float32", (2,), (0,), (2,))],
    )
    g = plan_global_save(p, rank=1)
    assert [w.name for w in g.writes] == ["w", "b"]


def test_hsdp_like_layout_replicated_shards():
    # 2 replicas x 2 shards: ranks 0,2 hold rows 0:2, ranks 1,3 hold rows 2:4
    p = plans_of(*[[rows("w", (4, 3), 2 * (r % 2), 2)] for r in range(4)])
    plans = [plan_global_save(p, rank=r) for r in range(4)]
    assert sorted(w.chunk_id for g in plans for w in g.writes) == [0, 1]
    assert plans[0].skeleton.writer.tolist() == [0, 1]


def test_ragged_boxes_on_one_rank_and_empty_pieces():
    p = plans_of(
        [rows("w", (6,), 0, 2), rows("w", (6,), 4, 2), rows("w", (6,), 6, 0)],
        [rows("w", (6,), 2, 2)],
    )
    g = plan_global_save(p, rank=0)
    assert [(w.piece_index, w.offsets) for w in g.writes] == [(0, (0,)), (1, (4,))]
    assert g.skeleton.num_chunks == 3


def test_empty_tensor_has_no_chunks():
    p = plans_of([PieceSpec("e", "float32", (0, 3), (0, 0), (0, 3))])
    g = plan_global_save(p, rank=0)
    assert g.writes == () and g.skeleton.num_chunks == 0 and g.skeleton.names == ("e",)


def test_dtype_disagreement_names_tensor_and_ranks():
    half = rows("w", (4,), 2, 2, dtype="bfloat16")
    p = plans_of([rows("w", (4,), 0, 2)], [half], [half])
    with pytest.raises(LayoutMismatchError) as exc:
        plan_global_save(p, rank=0)
    msg = str(exc.value)
    assert (
        "'w'" in msg
        and "ranks [0] have float32 (4,)" in msg
        and "ranks [1, 2] have bfloat16 (4,)" in msg
    )


def test_shape_disagreement_names_tensor_and_ranks():
    p = plans_of([rows("w", (4,), 0, 2)], [rows("w", (5,), 2, 2)])
    expected = r"'w'.*ranks \[0\] have float32 \(4,\).*ranks \[1\] have float32 \(5,\)"
    with pytest.raises(LayoutMismatchError, match=expected):
        plan_global_save(p, rank=1)


def test_pieces_of_one_rank_must_agree():
    with pytest.raises(LayoutMismatchError, match="'w'.*rank 3"):
        LocalSavePlan(rank=3, world_size=4, pieces=[rows("w", (4,), 0, 2), rows("w", (5,), 2, 2)])


def test_gap_names_tensor_and_region():
    p = plans_of([rows("w", (5, 3), 0, 2)], [rows("w", (5, 3), 3, 2)])
    with pytest.raises(CoverageError, match=r"'w'.*gap at \[2:3, 0:3\]"):
        plan_global_save(p, rank=0)


def test_missing_tensor_everywhere_is_a_gap():
    p = plans_of([rows("w", (5, 3), 0, 0)], [rows("w", (5, 3), 5, 0)])
    with pytest.raises(CoverageError, match=r"'w'.*gap at \[0:5, 0:3\]"):
        plan_global_save(p, rank=0)


def test_overlap_names_tensor_and_region():
    p = plans_of([rows("w", (5, 3), 0, 3)], [rows("w", (5, 3), 2, 3)])
    with pytest.raises(CoverageError, match=r"'w'.*overlap.*\[2:3, 0:3\]"):
        plan_global_save(p, rank=0)


def test_same_offsets_different_sizes_is_an_overlap():
    p = plans_of([rows("w", (5,), 0, 3), rows("w", (5,), 3, 2)], [rows("w", (5,), 0, 5)])
    with pytest.raises(CoverageError, match=r"'w': pieces overlap at \[0:3\].*ranks 0 and 1"):
        plan_global_save(p, rank=0)


def test_grid_layout_gap_is_located():
    boxes = [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2))]  # (2:4, 2:4) missing
    p = plans_of(*[[PieceSpec("g", "int8", (4, 4), o, s)] for o, s in boxes])
    with pytest.raises(CoverageError, match=r"'g'.*gap at \[2:4, 2:4\]"):
        plan_global_save(p, rank=0)


def test_piece_outside_global_shape_in_a_decoded_plan():
    header = PieceHeader(["w"], ["float32"], [(4,)])
    bad = PieceTable(
        header, [0], [3], [2], [True]
    )  # bypasses PieceSpec validation, like a foreign plan
    p = [LocalSavePlan(rank=0, world_size=1, pieces=bad)]
    with pytest.raises(
        CoverageError, match=r"'w'.*\[3:5\] of rank 0 is outside the global shape \(4,\)"
    ):
        plan_global_save(p, rank=0)


def test_value_owner_is_lowest_holder_and_names_cannot_be_both():
    p = [
        LocalSavePlan(rank=0, world_size=3, pieces=[], value_names=("a",)),
        LocalSavePlan(rank=1, world_size=3, pieces=[], value_names=("a", "b")),
        LocalSavePlan(rank=2, world_size=3, pieces=[], value_names=("c", "b")),
    ]
    assert plan_global_save(p, rank=2).value_owner == {"a": 0, "b": 1, "c": 2}
    p[2] = LocalSavePlan(rank=2, world_size=3, pieces=[PieceSpec("a", "int8", (), (), ())])
    with pytest.raises(
        LayoutMismatchError, match="'a' is a tensor on ranks \\[2\\] and a value on rank 0"
    ):
        plan_global_save(p, rank=0)
    with pytest.raises(LayoutMismatchError, match="both a tensor and a value"):
        LocalSavePlan(
            rank=0, world_size=1, pieces=[PieceSpec("a", "int8", (), (), ())], value_names=("a",)
        )


def test_plans_must_be_in_rank_order():
    p = plans_of([rows("w", (4,), 0, 2)], [rows("w", (4,), 2, 2)])
    with pytest.raises(PlanningError, match=r"local_plans\[0\] is rank 1"):
        plan_global_save(p[::-1], rank=0)
    with pytest.raises(PlanningError, match="outside world"):
        plan_global_save(p, rank=2)
    with pytest.raises(PlanningError, match="bad rank"):
        LocalSavePlan(rank=2, world_size=2, pieces=[])


def test_local_plan_codec_round_trip_and_fingerprint():
    pieces = [
        rows("w", (9, 4), 3, 3),
        PieceSpec("s", "bool", (), (), (), broadcastable=False),
        PieceSpec("w", "float32", (9, 4), (6, 0), (3, 4)),
    ]
    plan = LocalSavePlan(rank=1, world_size=3, pieces=pieces, value_names=("lr",))
    data = encode_local_save_plan(plan)
    back = decode_local_save_plan(data)
    assert back == plan and tuple(back.pieces) == tuple(pieces) and back.value_names == ("lr",)
    assert (
        back.fingerprint()
        == plan.fingerprint()
        == LocalSavePlan(rank=1, world_size=3, pieces=pieces, value_names=("lr",)).fingerprint()
    )
    assert len(plan.fingerprint()) == 16
    changed = [
        LocalSavePlan(rank=0, world_size=3, pieces=pieces, value_names=("lr",)),
        LocalSavePlan(rank=1, world_size=4, pieces=pieces, value_names=("lr",)),
        LocalSavePlan(rank=1, world_size=3, pieces=pieces[:2], value_names=("lr",)),
        LocalSavePlan(rank=1, world_size=3, pieces=pieces, value_names=()),
        LocalSavePlan(
            rank=1,
            world_size=3,
            pieces=[rows("w", (9, 4), 3, 3, dtype="bfloat16"), pieces[1]],
            value_names=("lr",),
        ),
    ]
    assert len({plan.fingerprint()} | {c.fingerprint() for c in changed}) == 1 + len(changed)
    assert b"pickle" not in data and data[:1] != b"\x80"  # msgpack map, not a pickle stream


@pytest.mark.parametrize("data", [b"", b"\x80\x04", b"\x81\xa6format\xa3bad", b"\xc1"])
def test_malformed_local_plan_bytes(data):
    with pytest.raises(PlanningError):
        decode_local_save_plan(data)


def test_plan_cache_is_bounded_lru_and_keyed_by_every_fingerprint():
    cache = SavePlanCache(maxsize=2)
    p = plans_of([rows("w", (4,), 0, 2)], [rows("w", (4,), 2, 2)])
    g = plan_global_save(p, rank=0)
    key = save_plan_cache_key([q.fingerprint() for q in p])
    assert cache.get(key) is None
    cache.put(key, g)
    assert cache.get(save_plan_cache_key([q.fingerprint() for q in p])) is g
    assert (
        cache.get(save_plan_cache_key([q.fingerprint() for q in p], replicas_to_lowest_rank=True))
        is None
    )
    assert cache.get(save_plan_cache_key([p[0].fingerprint()])) is None
    cache.put((b"a",), g)
    cache.get(key)  # refresh
    cache.put((b"b",), g)
    assert len(cache) == 2 and cache.get((b"a",)) is None and cache.get(key) is g
    held = cache.held()  # the vote: a snapshot by digest, unaffected by later changes
    assert held == {key_digest((b"b",)): g, key_digest(key): g}
    cache.clear()
    assert len(held) == 2 and cache.held() == {}
    assert key_digest(key) == key_digest(tuple(key)) and len(key_digest(key)) == 16
    assert key_digest((b"ab", b"c")) != key_digest((b"a", b"bc"))


def test_skeleton_flat_coords_follow_chunk_order():
    p = plans_of(
        [rows("a", (4, 2), 0, 2), PieceSpec("b", "int8", (3,), (0,), (3,))],
        [rows("a", (4, 2), 2, 2)],
    )
    sk = plan_global_save(p, rank=0).skeleton
    off, size = sk.flat_coords()
    assert off.tolist() == [0, 0, 2, 0, 0] and size.tolist() == [2, 2, 2, 2, 3]
    assert sk.chunk_tensor().tolist() == [0, 0, 1]
    assert np.array_equal(sk.nbytes, [16, 16, 3])
