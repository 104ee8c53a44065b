"""The direct reader's body plan (``Exchange._plan``): which view each byte of a ranged GET's
answer lands in. The plan is a sweep over the members (a GET coalesces hundreds of ranges); it
must give exactly the segments of the plain definition: for each stretch between two cuts, the
members covering it in their own order, an ``out`` view before a held range."""

from __future__ import annotations

import types

from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.storage.base import ReadRange
from cloudckpt.storage.ranges import HeldRange
from cloudckpt.storage.s3.exchange import Exchange


def _reference(start: int, end: int, members) -> list:
    """The plan by its definition: every member checked for every stretch."""
    cuts = {start, end}
    for off, stop, _ in members:
        cuts.update(x for x in (off, stop) if start < x < end)
    bounds = sorted(cuts)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        cover = [(off, t) for off, stop, t in members if off <= a and b <= stop]
        cover.sort(key=lambda c: isinstance(c[1], HeldRange))
        if not cover:
            out.append((a, b, "s", None, a, ()))
            continue
        off, target = cover[0]
        kind = "h" if isinstance(target, HeldRange) else "o"
        out.append((a, b, kind, target, off, tuple(cover[1:])))
    return out


member = st.tuples(st.integers(-8, 60), st.integers(0, 24), st.booleans())


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 20), st.integers(1, 40), st.lists(member, max_size=14))
def test_the_sweep_gives_the_segments_of_the_definition(start, span, raw_members):
    members = []
    for off, n, held in raw_members:
        target = (
            HeldRange(ReadRange(offset=off, length=n, crc32c=0))
            if held
            else memoryview(bytearray(n))
        )
        members.append((off, off + n, target))
    ex = types.SimpleNamespace(start=start, end=start + span, members=members)
    assert Exchange._plan(ex) == _reference(start, start + span, members)  # type: ignore[arg-type]


def test_many_disjoint_members_each_land_in_their_own_view():
    """The shape of a coalesced GET: 500 touching ranges and gaps between some."""
    members, pos = [], 0
    for k in range(500):
        pos += 3 if k % 7 == 0 else 0  # a gap nobody asked for
        members.append((pos, pos + 5, memoryview(bytearray(5))))
        pos += 5
    ex = types.SimpleNamespace(start=0, end=pos, members=members)
    plan = Exchange._plan(ex)  # type: ignore[arg-type]
    assert plan == _reference(0, pos, members)
    landed = [seg for seg in plan if seg[2] == "o"]
    assert [seg[3] for seg in landed] == [m[2] for m in members]
    assert sum(seg[1] - seg[0] for seg in plan if seg[2] == "s") == 3 * len(range(0, 500, 7))
