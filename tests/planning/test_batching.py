"""Batching (planning/batching.py, planning/broadcast/rounds.py): every item in exactly one
batch, caps respected unless one item alone exceeds them, order kept, broadcast batches
identical for every rank's input."""

from __future__ import annotations

import copy
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.planning.batching import WINDOW_ALIGN, Span, aligned, batch_by_object, pack_in_order
from cloudckpt.planning.broadcast.parts import RunPart, WindowPart
from cloudckpt.planning.broadcast.rounds import (
    RunBatch,
    WindowBatch,
    balance_sources,
    batch_parts,
    plan_rounds,
)
from cloudckpt.planning.load.windows import RunWindow, Window

SIZES = st.lists(st.integers(0, 200), max_size=40)
CAPS = st.integers(1, 400)


def _greedy_groups_ok(groups, sizes, cap):
    """Concatenation is the input order; a group over the cap holds one item; a cut happens
    only when the next item would not have fitted."""
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    for g in groups:
        assert g and (sum(sizes[i] for i in g) <= cap or len(g) == 1)
    for g, nxt in zip(groups, groups[1:]):
        assert sum(sizes[i] for i in g) + sizes[nxt[0]] > cap


@settings(max_examples=300, deadline=None)
@given(SIZES, CAPS)
def test_pack_in_order_cuts_greedily_in_order(sizes, cap):
    _greedy_groups_ok(pack_in_order(sizes, cap), sizes, cap)


def test_pack_in_order_examples():
    assert pack_in_order([], 10) == []
    assert pack_in_order([4, 4, 4], 8) == [[0, 1], [2]]
    assert pack_in_order([20, 1, 1], 8) == [[0], [1, 2]]  # an oversized item alone
    assert pack_in_order([0, 20], 8) == [[0], [1]]  # a cut only needs a non-empty group


@st.composite
def spans(draw):
    keys = draw(st.lists(st.sampled_from("abcd"), min_size=0, max_size=30))
    return [Span(k, draw(st.integers(0, 1000)), draw(st.integers(1, 300))) for k in keys]


@settings(max_examples=300, deadline=None)
@given(spans(), st.integers(WINDOW_ALIGN, 1024))
def test_batch_by_object_covers_each_span_once_per_object_in_byte_order(items, cap):
    batches = batch_by_object(items, cap)
    seen = sorted(i for b in batches for i in b.members)
    assert seen == list(range(len(items)))
    first_seen = list(dict.fromkeys(s.object_key for s in items))
    assert list(dict.fromkeys(b.object_key for b in batches)) == first_seen
    for key in first_seen:
        mine = [b for b in batches if b.object_key == key]
        order = [i for b in mine for i in b.members]
        # one object's spans: sorted by start, ties in input order (a stable sort)
        assert order == sorted(
            (i for i, s in enumerate(items) if s.object_key == key),
            key=lambda i: (items[i].start, i),
        )
        _greedy_groups_ok(
            [[order.index(i) for i in b.members] for b in mine],
            [aligned(items[i].length) for i in order],
            cap,
        )
    for b in batches:
        assert all(items[i].object_key == b.object_key for i in b.members)


def _window(length: int) -> Window:
    return Window(
        object_key="o",
        start=0,
        length=length,
        first_block=0,
        crc32c=(),
        block_size=1,
        itemsize=1,
        strides=(),
        boxes=(),
    )


@st.composite
def broadcast_parts(draw):
    world = draw(st.integers(2, 5))
    groups = draw(
        st.lists(
            st.lists(st.integers(0, world - 1), min_size=2, unique=True), min_size=1, max_size=4
        )
    )
    broadcasts = []
    for g in groups:
        g = tuple(sorted(g))
        broadcasts.append(SimpleNamespace(group=g, src=draw(st.sampled_from(g))))
    parts = []
    for _ in range(draw(st.integers(0, 40))):
        b = draw(st.integers(0, len(broadcasts) - 1))
        n = draw(st.integers(1, 500))
        parts.append(
            RunPart(b, RunWindow("o", 0, n, ()))
            if draw(st.booleans())
            else WindowPart(b, _window(n))
        )
    return broadcasts, parts


@settings(max_examples=300, deadline=None)
@given(broadcast_parts(), st.integers(1, 1500))
def test_broadcast_batches_cover_parts_once_keep_order_and_cap(case, cap):
    broadcasts, parts = case
    batches = batch_parts(broadcasts, parts, cap)
    ids = {id(p): i for i, p in enumerate(parts)}
    placed = sorted(ids[id(p)] for b in batches for p in b.parts)
    assert placed == list(range(len(parts)))
    key_of = lambda p: (broadcasts[p.broadcast].group, broadcasts[p.broadcast].src)  # noqa: E731
    for b in batches:
        assert all(key_of(p) == (b.members, b.src) for p in b.parts)
        if isinstance(b, RunBatch):
            assert isinstance(b.part, RunPart) and b.nbytes == b.part.nbytes
        else:
            assert isinstance(b, WindowBatch) and b.parts
            assert all(isinstance(p, WindowPart) for p in b.parts)
            assert b.nbytes <= cap or len(b.parts) == 1
            assert b.layout()[1] == b.nbytes
    # per (group, src): parts keep the global order; batches interleave round-robin
    keys = list(dict.fromkeys(key_of(p) for p in parts))
    for key in keys:
        got = [ids[id(p)] for b in batches if (b.members, b.src) == key for p in b.parts]
        assert got == [i for i, p in enumerate(parts) if key_of(p) == key]
    rounds, counts = [], {}
    for b in batches:
        k = (b.members, b.src)
        rounds.append((counts.get(k, 0), keys.index(k)))
        counts[k] = counts.get(k, 0) + 1
    assert rounds == sorted(rounds)
    # every rank computes the same batches from its own copy of the same inputs
    assert batch_parts(copy.deepcopy(broadcasts), copy.deepcopy(parts), cap) == batches


def test_broadcast_batches_example():
    a = SimpleNamespace(group=(0, 1), src=0)
    b = SimpleNamespace(group=(0, 1), src=1)
    w = lambda i, n: WindowPart(i, _window(n))  # noqa: E731
    run = RunPart(0, RunWindow("o", 0, 1000, ()))
    parts = [w(0, 60), w(0, 60), w(1, 10), run, w(0, 64), w(1, 64), w(1, 64)]
    got = batch_parts([a, b], parts, 128)
    assert [(x.src, [p for p in x.parts]) for x in got] == [
        (0, [parts[0], parts[1]]),  # 64 + 64 fits the cap of 128
        (1, [parts[2], parts[5]]),
        (0, [run]),  # a run closes the open window batch and goes alone
        (1, [parts[6]]),
        (0, [parts[4]]),
    ]


@settings(max_examples=100, deadline=None)
@given(broadcast_parts(), st.lists(st.integers(0, 300), min_size=5, max_size=5))
def test_balanced_sources_are_group_members_and_even_out_the_bytes(case, base):
    broadcasts, parts = case
    loads = base[: 1 + max(m for b in broadcasts for m in b.group)]
    sources = balance_sources(broadcasts, parts, loads)
    assert len(sources) == len(parts)
    for p, s in zip(parts, sources):
        assert s in broadcasts[p.broadcast].group
    # the same answer from every rank's own copy of the inputs
    assert balance_sources(copy.deepcopy(broadcasts), copy.deepcopy(parts), list(loads)) == sources
    # one group of every rank: greedy on the least loaded member, so no member ends more than
    # the largest part above the least loaded one (unless its own reads already put it there)
    world = len(loads)
    every = [SimpleNamespace(group=tuple(range(world)), src=0)]
    alone = [type(p)(0, p.run if isinstance(p, RunPart) else p.window) for p in parts]
    total = list(loads)
    for p, s in zip(alone, balance_sources(every, alone, loads)):
        total[s] += p.fetch_bytes
    largest = max([p.fetch_bytes for p in alone] or [0])
    assert max(total) - min(total) <= max(largest, max(loads) - min(loads))


def test_balanced_sources_example():
    a = SimpleNamespace(group=(0, 1, 2), src=0)
    w = lambda n: WindowPart(0, _window(n))  # noqa: E731
    parts = [w(100), w(100), w(100), w(50), w(50), w(10)]
    # rank 2 already reads 120 bytes itself: it is given parts only once the others caught up
    assert balance_sources([a], parts, [0, 0, 120]) == [0, 1, 0, 1, 2, 1]  # 200, 160, 170


@settings(max_examples=100, deadline=None)
@given(broadcast_parts(), st.integers(1, 1500), st.randoms(use_true_random=False))
def test_rounds_hold_every_batch_once_one_per_source_in_order(case, cap, rnd):
    broadcasts, parts = case
    world = 1 + max(m for b in broadcasts for m in b.group)
    sources = [rnd.choice(broadcasts[p.broadcast].group) for p in parts]
    batches = batch_parts(broadcasts, parts, cap, sources)
    rounds = plan_rounds(batches)
    assert sorted(id(b) for r in rounds for b in r.batches) == sorted(id(b) for b in batches)
    for r in rounds:
        srcs = [b.src for b in r.batches]
        assert srcs == sorted(set(srcs)) and all(b.members == r.members for b in r.batches)
        assert r.exchange == (len(srcs) > 1)
        assert r.width % WINDOW_ALIGN == 0 and all(b.nbytes <= r.width for b in r.batches)
        assert all(r.members[r.slot(s)] == s for s in srcs)
    # each (group, source) sends its batches in the order batch_parts gave them
    for key in {(b.members, b.src) for b in batches}:
        assert [b for r in rounds for b in r.batches if (b.members, b.src) == key] == [
            b for b in batches if (b.members, b.src) == key
        ]
    # round k of a group comes before round k + 1 of it; every rank computes the same rounds
    for members in {r.members for r in rounds}:
        mine = [r for r in rounds if r.members == members]
        for k, r in enumerate(mine):
            assert all(
                sum(1 for q in mine[:k] for x in q.batches if x.src == b.src) == k
                for b in r.batches
            )
    assert (
        plan_rounds(
            batch_parts(copy.deepcopy(broadcasts), copy.deepcopy(parts), cap, list(sources))
        )
        == rounds
    )
    assert world >= 2
