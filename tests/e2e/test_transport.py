"""The control channel and broadcasts on real gloo worlds."""

from __future__ import annotations

import os
import time

import pytest
import torch

from cloudckpt.errors import CheckpointError, CollectiveTimeout, MissingKeysError
from cloudckpt.transport import Broadcaster, ControlChannel


def rank_exchange() -> dict:
    ch = ControlChannel(timeout=30)
    payload = bytes([ch.rank]) * (ch.rank * 1000 + 1)
    gathered = ch.all_gather_bytes(payload)
    sent = ch.broadcast_bytes(b"hello from 1" if ch.rank == 1 else None, src=1)
    empty = ch.all_gather_bytes(b"")
    return {
        "sizes": [len(g) for g in gathered],
        "ok": gathered[ch.rank] == payload,
        "sent": sent,
        "empty": empty,
    }


def test_byte_collectives(world3):
    for r in world3.run(rank_exchange):
        assert r["sizes"] == [1, 1001, 2001] and r["ok"]
        assert r["sent"] == b"hello from 1" and r["empty"] == [b"", b"", b""]


def rank_agree_with_failure(kind: str) -> dict:
    ch = ControlChannel(timeout=30)
    error = None
    if ch.rank == 1:
        error = (
            MissingKeysError("missing: ['x']", keys=("x",))
            if kind == "typed"
            else RuntimeError("disk on fire")
        )
    try:
        ch.agree("test phase", b"payload", error)
    except CheckpointError as exc:
        return {
            "raised": True,
            "types": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "failed": sorted(exc.failures),
            "keys": getattr(exc, "keys", None),
            "tb": exc.failures[1].traceback,
        }
    return {"raised": False}


def test_agree_raises_the_same_error_on_every_rank(world3):
    results = world3.run(rank_agree_with_failure, "plain")
    assert [r["raised"] for r in results] == [True, True, True]
    assert len({r["message"] for r in results}) == 1
    for r in results:
        assert r["types"][0] == "CheckpointError" and r["failed"] == [1]
        assert (
            r["message"].startswith("test phase failed on rank 1 (")
            and "disk on fire" in r["message"]
        )
        assert "RuntimeError" in r["tb"]
    typed = world3.run(rank_agree_with_failure, "typed")
    assert [r["raised"] for r in typed] == [True, True, True]
    for r in typed:
        assert "MissingKeysError" in r["types"] and "CheckpointError" in r["types"]
    assert typed[1]["keys"] == ("x",)  # the detecting rank keeps the structured fields


def rank_phases() -> dict:
    """Every rank: a phase where every rank reports, one where only the coordinator does, one
    without reports."""
    from cloudckpt.api.reports import LatestStep, StopVote

    ch = ControlChannel(timeout=30)
    with ch.phase("every rank reports", StopVote) as votes:
        votes.report = StopVote(stop=ch.rank == 2)
    with ch.phase("the coordinator reports", LatestStep) as choice:
        if ch.is_coordinator:
            choice.report = LatestStep(step=41)
    with ch.phase("nothing to report") as silent:
        pass
    return {
        "votes": [v.stop for v in votes.reports],
        "choice": choice.reports,
        "silent": silent.reports,
    }


def test_phase_returns_every_ranks_typed_report(world3):
    from cloudckpt.api.reports import LatestStep

    for r in world3.run(rank_phases):
        assert r["votes"] == [False, False, True]
        assert r["choice"] == (LatestStep(step=41), None, None)
        assert r["silent"] == (None, None, None)


def rank_phase_fails(where: str) -> dict:
    """Every rank runs one phase; on rank 0 its block raises (``block``), or its report cannot
    be encoded (``report``: not the phase's report type). Then a second phase must still work."""
    from cloudckpt.api.reports import LatestStep, StopVote

    ch = ControlChannel(timeout=120)  # longer than the harness's 60 s: waiting for it fails
    outcome: dict = {"raised": False}
    try:
        with ch.phase("failing phase", StopVote) as phase:
            if ch.rank == 0 and where == "block":
                raise MissingKeysError("1 names are not in the checkpoint: 'w'", keys=("w",))
            phase.report = LatestStep(step=1) if ch.rank == 0 else StopVote(stop=False)
    except CheckpointError as exc:
        outcome = {
            "raised": True,
            "types": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "failed": sorted(exc.failures),
        }
    with ch.phase("after the failure", StopVote) as after:
        after.report = StopVote(stop=True)
    outcome["after"] = [v.stop for v in after.reports]
    return outcome


def test_phase_failure_on_rank_0_raises_the_same_error_everywhere(world3):
    for where, error in (("block", "MissingKeysError"), ("report", "TypeError")):
        results = world3.run(rank_phase_fails, where, timeout=60)
        assert [r["raised"] for r in results] == [True] * 3, where
        assert len({r["message"] for r in results}) == 1, results
        assert len({tuple(r["types"]) for r in results}) == 1, results
        for r in results:
            assert r["failed"] == [0] and "failing phase failed on rank 0 " in r["message"]
            assert f"rank 0: {error}" in r["message"]
            assert r["after"] == [True] * 3  # the channel stays usable
        if where == "block":  # one cloudckpt error type everywhere: that type
            assert "MissingKeysError" in results[2]["types"]


def rank_subgroup_broadcasts() -> list[list[int]]:
    ch = ControlChannel(timeout=30)
    b = Broadcaster(ch)
    sets = [(0, 1), (1, 2), (0, 1, 2)]
    b.prepare(sets)
    out = []
    for members, src in [((0, 1), 0), ((1, 2), 2), ((0, 1, 2), 1)]:
        if ch.rank not in members:
            out.append([])
            continue
        buf = (
            torch.full((5,), 10 * src + 1, dtype=torch.uint8)
            if ch.rank == src
            else torch.zeros(5, dtype=torch.uint8)
        )
        b.broadcast(buf, src=src, members=members)
        out.append(buf.tolist())
    return out


def test_subgroup_broadcasts(world3):
    res = world3.run(rank_subgroup_broadcasts)
    assert res[0] == [[1] * 5, [], [11] * 5]
    assert res[1] == [[1] * 5, [21] * 5, [11] * 5]
    assert res[2] == [[], [21] * 5, [11] * 5]


def rank_exchanges() -> list:
    """Exchanges (a ring of sends and receives) and all-gathers among the whole world and two
    subgroups, with slots of different sizes, empty ones (nothing to send) and a slot that is
    part of a larger tensor."""
    ch = ControlChannel(timeout=30)
    b = Broadcaster(ch)
    sets = [(0, 1, 2, 3), (1, 3), (0, 2, 3)]
    b.prepare(sets)
    out = []
    for members in sets:
        if ch.rank not in members:
            out.append(None)
            continue
        sizes = [(m * 7 + len(members)) % 5 * 3 for m in members]  # rank 3 sends 0 in the first
        backing = torch.zeros(sum(sizes) + 4, dtype=torch.uint8)
        slots, pos = [], 2
        for m, n in zip(members, sizes):
            slots.append(backing[pos : pos + n])
            pos += n
            if m == ch.rank:
                slots[-1].fill_(m + 1)
        b.exchange(slots, members=members)
        statuses = torch.zeros(len(members), dtype=torch.uint8)
        me = members.index(ch.rank)
        statuses[me] = 10 + ch.rank
        b.all_gather(statuses, statuses[me : me + 1], members=members)
        out.append(
            {
                "slots": [s.tolist() for s in slots],
                "sizes": sizes,
                "edges": [backing[:2].tolist(), backing[pos:].tolist()],
                "statuses": statuses.tolist(),
            }
        )
    return out


def test_exchanges_and_all_gathers_reach_every_member(world4):
    for rank, res in enumerate(world4.run(rank_exchanges)):
        for members, got in zip([(0, 1, 2, 3), (1, 3), (0, 2, 3)], res):
            if rank not in members:
                assert got is None
                continue
            assert got["slots"] == [[m + 1] * n for m, n in zip(members, got["sizes"])]
            assert got["edges"] == [[0, 0], [0, 0]]  # nothing written outside the slots
            assert got["statuses"] == [10 + m for m in members]


def rank_peer_dies(timeout: float) -> dict:
    ch = ControlChannel(timeout=timeout)
    ch.barrier()
    if ch.rank == 1:
        os._exit(3)  # a dead peer: never reaches the next collective
    start = time.monotonic()
    try:
        ch.agree("after death", b"")
    except CollectiveTimeout as exc:
        return {"error": type(exc).__name__, "seconds": time.monotonic() - start}
    return {"error": None}


def test_dead_peer_gives_collective_timeout_not_a_hang(world2):
    from cloudckpt.testing.ranks.world import RankFailedError

    try:
        world2.run(rank_peer_dies, 5.0, timeout=60)
    except RankFailedError as exc:
        report = exc.failures
    else:  # pragma: no cover - rank 1 always dies
        raise AssertionError("rank 1 should have died")
    assert 1 in report
    assert 0 not in report or "CollectiveTimeout" in report.get(0, "")


def test_one_process_errors_carry_their_own_message(tmp_path):
    """Without torch.distributed, a failure is still a CheckpointError of the detecting type,
    with the detector's message and no rank bookkeeping in it."""
    import cloudckpt
    from cloudckpt.errors import CheckpointNotFound

    with pytest.raises(CheckpointNotFound) as missing:
        cloudckpt.load({"a": torch.zeros(2)}, str(tmp_path / "nope"))
    assert str(missing.value).startswith(
        "loading (reading the manifest): no committed checkpoint at "
    )
    assert "rank" not in str(missing.value) and list(missing.value.failures) == [0]
    cloudckpt.save({"a": torch.ones(2)}, str(tmp_path / "ck"))
    with pytest.raises(MissingKeysError) as keys:
        cloudckpt.load({"b": torch.zeros(2)}, str(tmp_path / "ck"))
    assert isinstance(keys.value, CheckpointError)
    assert str(keys.value).startswith("loading: 1 name is not in the checkpoint: 'b' (")
