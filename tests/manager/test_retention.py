"""Retention policy: pure selection of the complete steps to delete (no store)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloudckpt.runs.retention import RetentionPolicy, select_to_delete


def kept(steps, policy):
    return sorted(set(steps) - select_to_delete(steps, policy))


def test_keep_last_and_keep_every_union():
    steps = range(1, 11)
    assert kept(steps, RetentionPolicy(keep_last=3, keep_every=4)) == [4, 8, 9, 10]


def test_keep_last_only_and_unordered_input():
    assert kept([5, 1, 9, 3, 7], RetentionPolicy(keep_last=2)) == [7, 9]


def test_keep_every_counts_step_zero():
    assert kept([0, 1, 2, 3, 5], RetentionPolicy(keep_every=2)) == [0, 2, 5]


def test_explicit_set_and_predicate():
    policy = RetentionPolicy(keep_steps={2, 3}, keep_if=lambda s: s > 90)
    assert kept([1, 2, 3, 50, 91, 92, 100], policy) == [2, 3, 91, 92, 100]


def test_newest_is_never_deleted():
    assert kept([10, 20, 30], RetentionPolicy(keep_last=0)) == [30]
    assert kept([10, 20, 30], RetentionPolicy(keep_if=lambda s: False)) == [30]


def test_inactive_policy_deletes_nothing():
    assert not RetentionPolicy().active
    assert select_to_delete([1, 2, 3], RetentionPolicy()) == set()
    assert select_to_delete([], RetentionPolicy(keep_last=1)) == set()


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"keep_last": -1}, ValueError),
        ({"keep_every": 0}, ValueError),
        ({"keep_last": 1.5}, TypeError),
        ({"keep_every": True}, TypeError),
        ({"keep_steps": {-3}}, ValueError),
        ({"keep_if": 3}, TypeError),
    ],
)
def test_invalid_policies(kwargs, exc):
    with pytest.raises(exc):
        RetentionPolicy(**kwargs)


def test_policy_is_frozen_and_keyword_only():
    policy = RetentionPolicy(keep_steps=[1, 2])
    assert policy.keep_steps == frozenset({1, 2})
    with pytest.raises(AttributeError):
        policy.keep_last = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        RetentionPolicy(3)  # type: ignore[misc]


@given(st.sets(st.integers(0, 500), max_size=40), st.integers(0, 6), st.integers(1, 50))
def test_properties(steps, keep_last, keep_every):
    policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
    doomed = select_to_delete(steps, policy)
    assert doomed <= steps
    if steps:
        assert max(steps) not in doomed
    newest = sorted(steps, reverse=True)[:keep_last]
    for step in steps:
        expected_keep = step in newest or step % keep_every == 0 or step == max(steps)
        assert (step not in doomed) == expected_keep
    # pruning is idempotent: applying the policy to the survivors deletes nothing more
    assert select_to_delete(steps - doomed, policy) == set()
