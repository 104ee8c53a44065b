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
    return {"sizes": [len(g) for g in gathered], "ok": gathered[ch.rank] == payload,
            "sent": sent, "empty": empty}


def test_byte_collectives(world3):
    for r in world3.run(rank_exchange):
        assert r["sizes"] == [1, 1001, 2001] and r["ok"]
        assert r["sent"] == b"hello from 1" and r["empty"] == [b"", b"", b""]


def rank_agree_with_failure(kind: str) -> dict:
    ch = ControlChannel(timeout=30)
    error = None
    if ch.rank == 1:
        error = MissingKeysError("missing: ['x']", keys=("x",)) if kind == "typed" else \
            RuntimeError("disk on fire")
    try:
        ch.agree("test phase", b"payload", error)
    except CheckpointError as exc:
        return {"types": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                "failed": sorted(exc.failures), "keys": getattr(exc, "keys", None),
                "tb": exc.failures[1].traceback}
    return {"types": []}


def test_agree_raises_the_same_error_on_every_rank(world3):
    results = world3.run(rank_agree_with_failure, "plain")
    assert len({r["message"] for r in results}) == 1
    for r in results:
        assert r["types"][0] == "CheckpointError" and r["failed"] == [1]
        assert r["message"].startswith("test phase failed on rank 1 (") and "disk on fire" in r["message"]
        assert "RuntimeError" in r["tb"]
    typed = world3.run(rank_agree_with_failure, "typed")
    for rank, r in enumerate(typed):
        assert "MissingKeysError" in r["types"] and "CheckpointError" in r["types"]
    assert typed[1]["keys"] == ("x",)  # the detecting rank keeps the structured fields


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
        buf = torch.full((5,), 10 * src + 1, dtype=torch.uint8) if ch.rank == src else \
            torch.zeros(5, dtype=torch.uint8)
        b.broadcast(buf, src=src, members=members)
        out.append(buf.tolist())
    return out


def test_subgroup_broadcasts(world3):
    res = world3.run(rank_subgroup_broadcasts)
    assert res[0] == [[1] * 5, [], [11] * 5]
    assert res[1] == [[1] * 5, [21] * 5, [11] * 5]
    assert res[2] == [[], [21] * 5, [11] * 5]


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
    from cloudckpt.testing.dist import RankFailedError

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
    assert str(missing.value).startswith("loading (reading the manifest): no committed checkpoint at ")
    assert "rank" not in str(missing.value) and list(missing.value.failures) == [0]
    cloudckpt.save({"a": torch.ones(2)}, str(tmp_path / "ck"))
    with pytest.raises(MissingKeysError) as keys:
        cloudckpt.load({"b": torch.zeros(2)}, str(tmp_path / "ck"))
    assert isinstance(keys.value, CheckpointError)
    assert str(keys.value).startswith("loading: 1 name is not in the checkpoint: 'b' (")
