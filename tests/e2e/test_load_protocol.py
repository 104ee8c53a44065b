"""The load protocol's collectives and the work it overlaps, on real gloo worlds.

- A load runs a fixed, small number of collectives: one all-gather closing each of its phases
  (the planning one in two steps only when a plan does not fit its first slot, which is larger
  than other exchanges'; the restore's only when some rank's restore runs code that may raise)
  and one broadcast of the manifest's bytes, whose length travels in the first phase's
  exchange; a round of regions read once and exchanged through buffers adds the exchange alone
  (each source's status rides at the end of its bytes).
- A restore that fails on one rank (``load_state_dict()``, a mapping's own ``__setitem__``)
  fails every rank.
- The coordinator checks the stored objects while every rank plans: a missing data object
  still fails every rank with the same ``ManifestError`` before any byte is read.
- A rank's state dict is flattened while the coordinator reads the manifest; an error doing so
  still fails every rank together, in the planning phase, and a missing checkpoint still wins.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import cloudckpt
from cloudckpt.errors import CheckpointError, CheckpointNotFound, ManifestError

_OPS = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "broadcast",
    "barrier",
    "batch_isend_irecv",
    "send",
    "recv",
    "all_reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
)


def _state() -> dict:
    # 40 tensors: each rank's load plan (about 1 KiB) is more than the 504 bytes an exchange's
    # first all-gather carries by default, and fits the planning exchange's larger slot
    state = {f"layer{i}.weight": torch.arange(12.0).reshape(3, 4) + i for i in range(40)}
    state["step"] = 7
    return state


def _plan_bytes(url: str) -> int:
    from cloudckpt.api.load_wanted import Wanted
    from cloudckpt.api.reports import LoadPlanReport
    from cloudckpt.planning.load.plan import plan_local_load
    from cloudckpt.transport import ControlChannel

    wanted = Wanted.of(_state(), ControlChannel())
    plan = plan_local_load(
        cloudckpt.read_manifest(url), wanted.requests, rank=0, value_names=tuple(wanted.flat.values)
    )
    return len(LoadPlanReport(plan).encode())


def _replicated() -> dict:
    # 24 KiB every rank needs, in regions of 1 KiB: read once, in one exchange round
    return {f"t{i}": torch.arange(256.0) + i for i in range(24)}


class _Holder:
    """A stateful value: its restore (``load_state_dict()``) is user code."""

    def __init__(self, fail: bool = False):
        self.t, self.fail = torch.zeros(4), fail

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, sd):
        if self.fail:
            raise ValueError(f"load_state_dict() refused on rank {dist.get_rank()}")
        self.t = sd["t"]


class _Picky(dict):
    """A mapping whose item assignment is its own code (here: refusing on rank 1)."""

    def __setitem__(self, key, value):
        if dist.get_rank() == 1 and key == "lr":
            raise KeyError("this mapping takes no new lr on rank 1")
        super().__setitem__(key, value)


def rank_count_collectives(url: str, case: str = "own") -> dict:
    """Save, then load with every torch collective counted: ``own``, data read by each rank
    itself (``broadcast=False``: only the protocol's own collectives run); ``stateful``, the
    same with a stateful value; ``shared``, a replicated state read once and exchanged."""
    state = _state() if case != "shared" else _replicated()
    options = (
        cloudckpt.LoadOptions(broadcast=False)
        if case != "shared"
        else cloudckpt.LoadOptions(broadcast=True, min_broadcast_bytes=0)
    )
    cloudckpt.save(state if case != "stateful" else {**state, "h": {"t": torch.ones(4)}}, url)
    counts: Counter = Counter()
    originals = {op: getattr(dist, op) for op in _OPS if hasattr(dist, op)}

    def counted(op, fn):
        def wrapper(*args, **kwargs):
            counts[op] += 1
            return fn(*args, **kwargs)

        return wrapper

    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    if case == "stateful":
        dest["h"] = _Holder()
    try:
        for op, fn in originals.items():
            setattr(dist, op, counted(op, fn))
        result = cloudckpt.load(dest, url, options=options)
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
    ok = all(
        torch.equal(dest[k], v) if isinstance(v, torch.Tensor) else dest[k] == v
        for k, v in state.items()
    )
    if case == "stateful":
        ok &= torch.equal(dest["h"].t, torch.ones(4))
    return {
        "counts": dict(counts),
        "ok": ok,
        "received": result.bytes_received,
        "plan_bytes": _plan_bytes(url) if case == "own" else 0,
    }


def test_a_load_runs_three_exchanges_and_one_manifest_broadcast(world2, s3_url):
    from cloudckpt.transport import INLINE_BYTES

    for r in world2.run(rank_count_collectives, s3_url):
        assert r["ok"] and r["plan_bytes"] > INLINE_BYTES
        # manifest, planning (the plans fit its first slot), data: one all-gather each (the
        # restore sets values in plain dicts: nothing there can fail, no exchange); the
        # manifest's bytes: one broadcast (its length came with the first exchange)
        assert r["counts"] == {"all_gather": 3, "broadcast": 1}
    # a stateful value: its load_state_dict() may raise, the restore closes with an exchange
    for r in world2.run(rank_count_collectives, s3_url + "-stateful", "stateful"):
        assert r["ok"] and r["counts"] == {"all_gather": 4, "broadcast": 1}


def rank_failing_restore(url: str, kind: str) -> dict:
    cloudckpt.save({"w": torch.ones(4), "h": {"t": torch.ones(4)}, "opt": {"lr": 0.5}}, url)
    dest = {
        "w": torch.zeros(4),
        "h": _Holder(fail=dist.get_rank() == 1 and kind == "stateful"),
        "opt": _Picky(lr=0.1) if kind == "mapping" else {"lr": 0.1},
    }
    if kind == "mapping":
        dest["h"] = {"t": torch.zeros(4)}
    try:
        cloudckpt.load(dest, url)
    except CheckpointError as exc:
        return {
            "message": str(exc),
            "failed": sorted(exc.failures),
            "data": torch.equal(dest["w"], torch.ones(4)),
        }
    return {"message": None}


@pytest.mark.parametrize("kind", ["stateful", "mapping"])
def test_a_restore_failing_on_one_rank_fails_every_rank(world2, s3_url, kind):
    results = world2.run(rank_failing_restore, s3_url, kind)
    assert len({r["message"] for r in results}) == 1
    for r in results:
        assert r["message"] is not None and r["failed"] == [1], r
        assert r["message"].startswith("loading (restoring values) failed on rank 1")
        assert r["data"]


def test_a_round_of_small_regions_carries_its_sources_statuses(world2, s3_url):
    """Regions read once and exchanged through buffers: each source's status travels at the
    end of its bytes, so the round is the exchange alone (one ring step for two ranks)."""
    results = world2.run(rank_count_collectives, s3_url, "shared")
    assert sum(r["received"] for r in results) == 24 * 1024
    for r in results:
        assert r["ok"]
        assert r["counts"] == {"all_gather": 3, "broadcast": 1, "batch_isend_irecv": 1}


def rank_missing_object(url: str, mode: str) -> dict:
    if mode == "save":
        cloudckpt.save({"w": torch.ones(64)}, url)
        return {}
    dest = {"w": torch.full((64,), 3.0)}
    try:
        cloudckpt.load(dest, url)
    except CheckpointError as exc:
        return {
            "manifest_error": isinstance(exc, ManifestError),
            "message": str(exc),
            "untouched": bool((dest["w"] == 3).all()),
        }
    return {"manifest_error": False}


def test_a_missing_data_object_fails_every_rank_before_any_read(world2, s3_url, s3_server):
    world2.run(rank_missing_object, s3_url, "save")
    client = s3_server.boto3_client()
    prefix = s3_url.split("/", 3)[3] + "/data/"
    for obj in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)["Contents"]:
        client.delete_object(Bucket=s3_server.bucket, Key=obj["Key"])
    results = world2.run(rank_missing_object, s3_url, "load")
    assert len({r["message"] for r in results}) == 1
    for r in results:
        assert r["manifest_error"] and r["untouched"], r
        assert "failed on rank 0" in r["message"] and "is missing" in r["message"]


def test_a_short_data_object_fails_every_rank_before_any_read(world2, s3_url, s3_server):
    """The coordinator's HEADs start as soon as it has decoded the manifest and report in the
    planning phase: an object shorter than its chunks fails every rank, nothing read."""
    world2.run(rank_missing_object, s3_url, "save")
    client = s3_server.boto3_client()
    prefix = s3_url.split("/", 3)[3] + "/data/"
    for obj in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)["Contents"]:
        body = client.get_object(Bucket=s3_server.bucket, Key=obj["Key"])["Body"].read()
        client.put_object(Bucket=s3_server.bucket, Key=obj["Key"], Body=body[: len(body) // 2])
    results = world2.run(rank_missing_object, s3_url, "load")
    assert len({r["message"] for r in results}) == 1
    for r in results:
        assert r["manifest_error"] and r["untouched"], r
        assert "failed on rank 0" in r["message"] and "the manifest refers to" in r["message"]


class _Broken:
    """A stateful object whose ``state_dict()`` fails on rank 1."""

    def state_dict(self):
        if dist.get_rank() == 1:
            raise ValueError("state_dict() broke on rank 1")
        return {"x": torch.zeros(2)}

    def load_state_dict(self, sd):
        pass


def rank_broken_state_dict(url: str, exists: bool) -> dict:
    if exists:
        cloudckpt.save({"obj": {"x": torch.ones(2)}}, url)
    try:
        cloudckpt.load({"obj": _Broken()}, url)
    except CheckpointError as exc:
        return {
            "types": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "failed": sorted(exc.failures),
        }
    return {"types": []}


def test_a_state_dict_that_fails_to_flatten_fails_every_rank_in_planning(world2, s3_url):
    results = world2.run(rank_broken_state_dict, s3_url, True)
    assert len({r["message"] for r in results}) == 1
    for r in results:
        assert r["failed"] == [1] and r["message"].startswith("loading failed on rank 1"), r
        assert "state_dict() broke on rank 1" in r["message"]
    # no checkpoint: that is what every rank hears, not the flattening error
    missing = world2.run(rank_broken_state_dict, s3_url + "-nothing-here", False)
    for r in missing:
        assert CheckpointNotFound.__name__ in r["types"] and r["failed"] == [0], r
