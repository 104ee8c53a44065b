"""Replicated bytes spread by the ranks' write rates (planning/save/rates.py and the weighted
rules of planning/save/replicas.py), with N simulated ranks in one process."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloudckpt.errors import PlanningError
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.planning.save import rates
from cloudckpt.planning.save.cache import save_plan_cache_key
from cloudckpt.planning.save.global_plan import plan_global_save
from cloudckpt.planning.save.replicas import REPLICA_PIECE_BYTES, _weighted_fill
from tests.planning.test_replicas import SETTINGS, ddp_state, loads, plans_of, whole

MiB = 1 << 20


def test_rate_classes_and_weights():
    assert rates.rate_class(0) == 0 and rates.rate_class(float("nan")) == 0
    assert rates.rate_class(-5) == 0 and rates.rate_class(float("inf")) == 0
    assert rates.rate_class(1e-9) == 1 and rates.rate_class(1e300) == rates.MAX_CLASS
    fast, slow = rates.rate_class(50e6 / 8), rates.rate_class(12.5e6 / 8)
    assert fast - slow == 2 * rates.CLASS_STEPS  # a quarter of the rate: two doublings
    assert rates.replica_weights([fast, fast, fast, slow]) == [1.0, 1.0, 1.0, 0.25]
    # one kind of node measuring within a step of each other: the even spread, as before
    assert rates.replica_weights([fast, fast - 1, fast, fast - 2]) is None
    # any rank without a rate, or a malformed class from a peer: the even spread
    assert rates.replica_weights([fast, 0, slow]) is None
    assert rates.replica_weights([fast, -3, slow]) is None
    assert rates.replica_weights([fast, rates.MAX_CLASS + 1, slow]) is None
    assert rates.replica_weights([fast, True, slow]) is None
    assert rates.replica_weights([]) is None


def test_write_rates_measure_and_tell():
    w = rates.WriteRates()
    assert w.rate == 0 and w.rate_class() == 0
    w.record(rates.MIN_SAMPLE_BYTES - 1, 0.001)  # too small to say anything
    w.record(8 * MiB, 0.0)
    assert w.rate == 0
    w.record(8 * MiB, 1.0)
    assert w.rate == 8 * MiB
    w.record(8 * MiB, 0.5)  # a moving mean
    assert w.rate == pytest.approx(8 * MiB * (1 - rates.SAMPLE_WEIGHT + 2 * rates.SAMPLE_WEIGHT))
    w.tell(1e6)
    assert w.rate == 1e6
    w.record(80 * MiB, 1.0)
    assert w.rate == 1e6  # told wins
    w.tell(0)
    assert w.rate > 8 * MiB
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            w.tell(bad)
    w.forget()
    assert w.rate == 0


@SETTINGS
@given(
    levels=st.lists(st.integers(0, 1 << 40), min_size=1, max_size=9),
    data=st.data(),
    amount=st.integers(0, 1 << 42),
)
def test_weighted_fill_adds_up_and_levels(levels, data, amount):
    weights = data.draw(st.lists(st.floats(1e-6, 1.0), min_size=len(levels), max_size=len(levels)))
    add = _weighted_fill(levels, weights, amount)
    assert sum(add) == amount and min(add) >= 0
    after = [(lv + a) / w for lv, a, w in zip(levels, add, weights)]
    raised = [t for t, a in zip(after, add) if a > 0]
    if raised:
        # every raised holder ends at one level (within the rounding), none below it stays low
        top = max(raised)
        assert min(raised) >= top - (len(levels) + 1) / min(weights)
        assert all(t >= min(raised) - (len(levels) + 1) / min(weights) for t in after)


def test_one_slow_node_writes_its_rate_share_of_replicated_state():
    state = ddp_state()
    total = sum(p.nbytes for p in state)
    for world, weights in ((4, [1.0, 1.0, 1.0, 0.25]), (8, [1.0] * 7 + [0.25]), (3, [0.5, 1, 1])):
        plans = [
            plan_global_save(plans_of([state] * world), rank=r, rate_weights=weights)
            for r in range(world)
        ]
        sk = plans[0].skeleton
        assert {p.skeleton.digest() for p in plans} == {sk.digest()}  # every rank agrees
        per_rank = loads(sk, world)
        assert per_rank.sum() == total
        assert sum(w.nbytes for p in plans for w in p.writes) == total
        fair = total * np.array(weights) / sum(weights)
        # within one piece of the rate-proportional share (was total / world for every node)
        assert (np.abs(per_rank - fair) <= REPLICA_PIECE_BYTES).all(), (per_rank / MiB, fair / MiB)
        assert {p.rank for p in plans} == set(range(world))
    even = plan_global_save(plans_of([state] * 4), rank=0).skeleton
    same = plan_global_save(plans_of([state] * 4), rank=0, rate_weights=[1.0] * 4).skeleton
    assert same.digest() == even.digest()  # equal weights: the even plan
    with pytest.raises(ValueError):
        plan_global_save(plans_of([state] * 4), rank=0, rate_weights=[1.0, 1.0, 0.0, 1.0])
    with pytest.raises(ValueError):
        plan_global_save(plans_of([state] * 4), rank=0, rate_weights=[1.0, 1.0])


def test_sharded_bytes_stay_with_their_holder_whatever_the_rates():
    state = [
        [whole("a", (1024, 1024))] + [whole("r", (4096, 1024))],
        [whole("b", (1024, 1024))] + [whole("r", (4096, 1024))],
    ]
    sk = plan_global_save(plans_of(state), rank=0, rate_weights=[1.0, 0.01]).skeleton
    assert sk.chunks_of("a")[2].tolist() == [0] and sk.chunks_of("b")[2].tolist() == [1]
    # the slow rank still writes its own 4 MiB; the replicated 16 MiB all go to the fast one
    assert loads(sk, 2).tolist() == [20 * MiB, 4 * MiB]


def test_cache_key_follows_the_weights():
    fps = [b"a" * 16, b"b" * 16]
    even = save_plan_cache_key(fps)
    assert save_plan_cache_key(fps, rate_weights=None) == even
    weighted = save_plan_cache_key(fps, rate_weights=[1.0, 0.25])
    assert weighted != even and weighted == save_plan_cache_key(fps, rate_weights=[1.0, 0.25])
    assert weighted != save_plan_cache_key(fps, rate_weights=[0.25, 1.0])
    # the lowest-rank rule ignores rates
    assert save_plan_cache_key(
        fps, replicas_to_lowest_rank=True, rate_weights=[1.0, 0.25]
    ) == save_plan_cache_key(fps, replicas_to_lowest_rank=True)


def test_for_rank_gives_every_ranks_own_plan():
    state = ddp_state()
    sharded = [
        [whole("r", (4096, 1024))] + [PieceSpec("s", "float32", (8, 4), (2 * r, 0), (2, 4))]
        for r in range(4)
    ]
    for per_rank, weights in (([state] * 4, [1.0, 1.0, 0.5, 0.25]), (sharded, None)):
        plans = [
            plan_global_save(plans_of(per_rank), rank=r, rate_weights=weights) for r in range(4)
        ]
        for r in range(4):
            other = plans[0].for_rank(r)
            assert other.rank == r and other.writes == plans[r].writes
            assert other.skeleton is plans[0].skeleton
        with pytest.raises(PlanningError):
            plans[0].for_rank(4)
