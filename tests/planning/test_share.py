"""A rank's share of the global save plan (planning/save/share.py): every rank's share, cut from
one plan by the coordinator, is exactly what that rank would have planned itself; a share that
does not fit the rank's own local plan, or is not a share, is refused with ProtocolError."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.errors import ProtocolError
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.planning.save.global_plan import plan_global_save
from cloudckpt.planning.save.local_plan import LocalSavePlan
from cloudckpt.planning.save.share import SHARE_FORMAT, decode_share, encode_shares

from .layouts import shard_boxes


def _locals(world: int = 4) -> list[LocalSavePlan]:
    """A (64, 32) float32 tensor sharded on a 2 x (world / 2) mesh, a replicated (4096, 64)
    bfloat16 tensor (cut between holders), a replicated 0-d step, and a value on every rank."""
    boxes = shard_boxes((64, 32), (2, world // 2), [("S", 0), ("S", 1)])
    return [
        LocalSavePlan(
            rank=r,
            world_size=world,
            pieces=(
                PieceSpec("w", "float32", (64, 32), *boxes[r]),
                PieceSpec("emb", "bfloat16", (4096, 64), (0, 0), (4096, 64)),
                PieceSpec("step", "int64", (), (), ()),
            ),
            value_names=("epoch",) + (("only_r1",) if r == 1 else ()),
        )
        for r in range(world)
    ]


def _share_doc(raw: bytes) -> list:
    return msgpack.unpackb(raw, raw=False)


@pytest.mark.parametrize("weights", [None, [1.0, 0.25, 1.0, 0.5]])
def test_every_share_is_the_ranks_own_plan(weights):
    local = _locals()
    plan = plan_global_save(local, rank=0, replica_piece_bytes=64 << 10, rate_weights=weights)
    encoded = encode_shares(plan)
    assert len(encoded) == 4
    written = []
    for r, raw in enumerate(encoded):
        own = plan_global_save(local, rank=r, replica_piece_bytes=64 << 10, rate_weights=weights)
        share = decode_share(raw, local[r])
        assert share.plan_digest == plan.skeleton.digest() and share.skeleton is None
        expected = [
            (w.chunk_id, w.piece_index, w.within, w.sizes) for w in own.writes
        ]  # piece order, then chunk id
        got = [
            (c, p, at[: len(w.within)], sz[: len(w.within)])
            for (c, p, at, sz), w in zip(share.boxes(), own.writes)
        ]
        assert got == expected and len(share) == len(own.writes)
        owned = {v for v, o in own.value_owner.items() if o == r}
        assert set(share.values) == owned
        written += share.chunk_ids.tolist()
    assert sorted(written) == list(range(plan.skeleton.num_chunks))  # each chunk once
    assert {v for r in range(4) for v in decode_share(encoded[r], local[r]).values} == {
        "epoch",
        "only_r1",
    }


def test_a_selection_of_ranks_and_the_coordinators_skeleton():
    local = _locals()
    plan = plan_global_save(local, rank=0)
    (only,) = encode_shares(plan, ranks=[2])
    assert only == encode_shares(plan)[2]
    mine = decode_share(encode_shares(plan, ranks=[0])[0], local[0], plan.skeleton)
    assert mine.skeleton is plan.skeleton


def test_a_rank_that_writes_nothing_gets_an_empty_share():
    local = [
        LocalSavePlan(rank=0, world_size=2, pieces=(PieceSpec("t", "float32", (4,), (0,), (4,)),)),
        LocalSavePlan(rank=1, world_size=2, pieces=()),
    ]
    plan = plan_global_save(local, rank=0, replicas_to_lowest_rank=True)
    share = decode_share(encode_shares(plan)[1], local[1])
    assert len(share) == 0 and share.boxes() == [] and share.values == ()


def _broken(doc: list, field: int, value) -> bytes:
    doc = list(doc)
    doc[field] = value
    return msgpack.packb(doc, use_bin_type=True)


def _i64(values) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def test_malformed_shares_are_refused():
    local = _locals()
    plan = plan_global_save(local, rank=0)
    raw = encode_shares(plan)[1]
    doc = _share_doc(raw)
    count, width = doc[5], doc[6]
    assert count >= 2 and width == 2
    cases = {
        "truncated": raw[:-3],
        "trailing": raw + b"\x00",
        "not msgpack": b"\xc1\xc1",
        "a map": msgpack.packb({"format": SHARE_FORMAT}),
        "other format": _broken(doc, 0, "cloudckpt.save_plan"),
        "other version": _broken(doc, 1, 2),
        "another rank's": _broken(doc, 2, 2),
        "a bool rank": _broken(doc, 2, True),
        "another world": _broken(doc, 3, 8),
        "short digest": _broken(doc, 4, b"x" * 15),
        "negative count": _broken(doc, 5, -1),
        "count past the columns": _broken(doc, 5, count + 1),
        "zero width": _broken(doc, 6, 0),
        "huge width": _broken(doc, 6, 1 << 40),
        "a width below the tensors' ndim": msgpack.packb(
            doc[:6] + [1, doc[7], doc[8], _i64([0] * count), _i64([1] * count), doc[11]]
        ),
        "chunk ids not bytes": _broken(doc, 7, [1, 2]),
        "repeated chunk ids": _broken(doc, 7, _i64([3] * count)),
        "a negative chunk id": _broken(doc, 7, _i64([-1] + list(range(1, count)))),
        "a piece past the rank's": _broken(doc, 8, _i64([3] * count)),
        "a negative piece": _broken(doc, 8, _i64([-1] * count)),
        "a box past its piece": _broken(doc, 10, _i64([10**6] * (count * width))),
        "an empty box": _broken(doc, 10, _i64([0] * (count * width))),
        "a negative start": _broken(doc, 9, _i64([-1] * (count * width))),
        "a value the rank does not hold": _broken(doc, 11, ["epoch", "nope"]),
        "a repeated value": _broken(doc, 11, ["epoch", "epoch"]),
        "a value that is not a string": _broken(doc, 11, [1]),
    }
    for what, bad in cases.items():
        with pytest.raises(ProtocolError, match="malformed save plan share") as info:
            decode_share(bad, local[1])
        assert "same cloudckpt version" in str(info.value), what


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_garbled_shares_decode_to_a_fitting_share_or_raise_protocol_error(data):
    """Bytes flipped, cut or appended anywhere: either still a share that fits the rank's
    pieces (a flip inside a number that stays in range), or ProtocolError; nothing else."""
    local = _locals()
    raw = bytearray(encode_shares(plan_global_save(local, rank=0))[3])
    kind = data.draw(st.sampled_from(["flip", "cut", "append"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    elif kind == "cut":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=16))
    try:
        share = decode_share(bytes(raw), local[3])
    except ProtocolError:
        return
    table = local[3].table
    _, extent = table.padded(share.within.shape[1])
    assert (share.within + share.sizes <= extent[share.pieces]).all()
    assert set(share.values) <= set(local[3].value_names)
