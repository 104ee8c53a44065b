"""Broadcast group selection (planning/broadcast/groups.py): the busiest groups, whole groups kept
or dropped, and the same selection on every rank."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.planning.broadcast.groups import select_broadcasts
from cloudckpt.planning.broadcast.readers import assign_readers
from cloudckpt.planning.load.plan import plan_local_load
from cloudckpt.planning.load.plan_codec import decode_local_load_plan, encode_local_load_plan
from cloudckpt.planning.pieces import PieceSpec
from tests.planning.test_load_plan import manifest_with


@st.composite
def broadcasts(draw):
    world = draw(st.integers(2, 6))
    out = []
    for _ in range(draw(st.integers(0, 30))):
        group = tuple(sorted(draw(st.lists(st.integers(0, world - 1), min_size=2, unique=True))))
        out.append(
            SimpleNamespace(
                group=group, src=group[0], region=SimpleNamespace(nbytes=draw(st.integers(0, 1000)))
            )
        )
    return out


@settings(max_examples=300, deadline=None)
@given(broadcasts(), st.integers(0, 8))
def test_keeps_whole_groups_of_the_busiest(bs, limit):
    kept = select_broadcasts(bs, limit)
    assert list(kept) == sorted(set(kept))
    weight = defaultdict(int)
    for b in bs:
        weight[b.group] += b.region.nbytes
    kept_groups = {bs[i].group for i in kept}
    assert len(kept_groups) == min(limit, len(weight))
    # every broadcast of a kept group is kept
    assert set(kept) == {i for i, b in enumerate(bs) if b.group in kept_groups}
    # no dropped group outranks a kept one (more bytes; ties to the smaller rank tuple)
    rank = lambda g: (-weight[g], g)  # noqa: E731
    for dropped in set(weight) - kept_groups:
        assert all(rank(dropped) > rank(g) for g in kept_groups)
    assert select_broadcasts(list(bs), limit) == kept  # deterministic


@settings(max_examples=100, deadline=None)
@given(broadcasts(), st.integers(0, 8))
def test_only_group_keeps_that_group_if_it_is_among_the_busiest(bs, limit):
    kept = set(select_broadcasts(bs, limit))
    for group in {b.group for b in bs}:
        only = select_broadcasts(bs, limit, only_group=group)
        assert set(only) == {i for i in kept if bs[i].group == group}


KIB = 1024
M = manifest_with({f"t{i}": ("float32", (16 * KIB,), [((0,), (16 * KIB,))]) for i in range(6)})


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sets(st.integers(0, 5)), min_size=2, max_size=4), st.integers(0, 4))
def test_every_rank_selects_the_same_broadcasts_from_its_own_copy(wants, limit):
    plans = [
        plan_local_load(
            M,
            [PieceSpec(f"t{i}", "float32", (16 * KIB,), (0,), (16 * KIB,)) for i in sorted(names)],
            rank=r,
        )
        for r, names in enumerate(wants)
    ]
    wire = [encode_local_load_plan(p) for p in plans]
    selections = set()
    for _rank in range(len(plans)):  # each rank decodes every plan it received
        mine = [decode_local_load_plan(raw) for raw in wire]
        selections.add(select_broadcasts(assign_readers(mine).broadcasts, limit))
    assert len(selections) == 1
