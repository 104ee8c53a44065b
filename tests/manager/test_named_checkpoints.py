"""Checkpoints under names a trainer chose, against the session's SeaweedFS: ``cloudckpt.exists``,
``cloudckpt.delete``, ``cloudckpt.list_checkpoints``, ``CheckpointManager`` and ``cloudckpt ls``
/ ``prune`` on them; names that are prefixes of others or hold odd characters never widen a
deletion; damaged or hostile manifests are refused before anything is deleted."""

from __future__ import annotations

import json
import os
import random

import msgpack
import pytest
import torch

import cloudckpt
from cloudckpt import CheckpointManager, SaveOptions
from cloudckpt.errors import CheckpointNotFound, ManifestError
from cloudckpt.manifest.framing import frame, unframe
from tests.cli_forkserver import run_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ATTEMPT = "0123456789abcdef"


def _state(seed: int) -> dict:
    return {"w": torch.arange(8, dtype=torch.float32) + seed, "seed": seed}


def _keys(s3_server, url: str) -> dict[str, str]:
    """Every object under ``url`` (relative key -> ETag), through boto3."""
    bucket, _, root = url[len("s3://") :].partition("/")
    client = s3_server.boto3_client()
    keys = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root + "/"):
        keys.update({o["Key"][len(root) + 1 :]: o["ETag"] for o in page.get("Contents", [])})
    return keys


def _put(s3_server, url: str, key: str, body: bytes = b"x") -> None:
    bucket, _, root = url[len("s3://") :].partition("/")
    s3_server.boto3_client().put_object(Bucket=bucket, Key=f"{root}/{key}", Body=body)


def _cli(s3_server, *argv: str):
    return run_cli(
        list(argv),
        cwd=REPO,
        env={**os.environ, **s3_server.env(), "PYTHONPATH": REPO},
        timeout=120,
    )


def test_exists_list_delete_by_url(s3_env, s3_url):
    run = s3_url
    CheckpointManager(run).save(100, _state(100))
    cloudckpt.save(_state(1), f"{run}/epoch=0-step=10.ckpt")
    cloudckpt.save(_state(2), f"{run}/checkpoint-500")
    cloudckpt.save(_state(3), f"{run}/last", metadata={"step": 7})
    _put(s3_env, run, f"half/data/{ATTEMPT}/r00000-0000.bin")  # a killed save
    _put(s3_env, run, "misc/data/readme.txt")  # some other layout: not a checkpoint
    _put(s3_env, run, "notes.txt")

    infos = cloudckpt.list_checkpoints(run)
    assert sorted((i.name, i.step, i.complete) for i in infos) == [
        ("checkpoint-500", 500, True),
        ("epoch=0-step=10.ckpt", 10, True),
        ("half", None, False),
        ("last", 7, True),  # the manifest's metadata, not the name
        ("step-000000000100", 100, True),
    ]
    assert infos[-1].name == "half" and infos[-1].created_at is None
    # oldest commit first (the store's times have whole seconds: ties go by step)
    assert [(i.created_at, i.step) for i in infos[:4]] == sorted(
        (i.created_at, i.step) for i in infos[:4]
    )
    assert {i.url for i in infos} == {f"{run}/{i.name}" for i in infos}
    # the manager sees the same checkpoints, by step then commit time
    assert [i.name for i in CheckpointManager(run).list()] == [
        "half",
        "last",
        "epoch=0-step=10.ckpt",
        "step-000000000100",
        "checkpoint-500",
    ]
    sd = {"w": torch.zeros(8), "seed": -1}
    assert CheckpointManager(run).load(sd, step="last") == "last" and sd["seed"] == 3

    for name in ("epoch=0-step=10.ckpt", "checkpoint-500", "last", "step-000000000100"):
        assert cloudckpt.exists(f"{run}/{name}")
    for name in ("half", "misc", "nothing", "las"):
        assert not cloudckpt.exists(f"{run}/{name}")

    before = _keys(s3_env, run)
    removed = cloudckpt.delete(f"{run}/epoch=0-step=10.ckpt")
    after = _keys(s3_env, run)
    gone = set(before) - set(after)
    assert removed == len(gone) >= 2 and all(k.startswith("epoch=0-step=10.ckpt/") for k in gone)
    assert not any(k.startswith("epoch=0-step=10.ckpt/") for k in after)
    assert not cloudckpt.exists(f"{run}/epoch=0-step=10.ckpt")
    with pytest.raises(CheckpointNotFound, match="nothing deleted"):
        cloudckpt.delete(f"{run}/epoch=0-step=10.ckpt")
    with pytest.raises(CheckpointNotFound):
        cloudckpt.delete(f"{run}/misc")  # owns nothing: never touched
    assert cloudckpt.delete(f"{run}/half") == 1  # a half-written one: its owned objects
    assert {"misc/data/readme.txt", "notes.txt"} <= set(_keys(s3_env, run))
    with pytest.raises(ValueError):
        cloudckpt.delete("s3://cloudckpt-test")
    with pytest.raises(ValueError):
        CheckpointManager(run).delete("../x")
    left = [i.name for i in cloudckpt.list_checkpoints(run)]
    assert sorted(left) == ["checkpoint-500", "last", "step-000000000100"]


def _rewrite_manifest(s3_server, url: str, change) -> None:
    bucket, _, root = url[len("s3://") :].partition("/")
    client = s3_server.boto3_client()
    key = f"{root}/manifest.msgpack"
    raw = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    client.put_object(Bucket=bucket, Key=key, Body=change(raw))


def _hostile(raw: bytes) -> bytes:
    """A checksummed, well-framed manifest whose first object lies outside its checkpoint."""
    version, body = unframe(raw)
    doc = msgpack.unpackb(body, raw=False, strict_map_key=False)
    objects = list(doc["objects"])
    objects[0] = "../keep/manifest.msgpack"
    doc = {**doc, "objects": objects}
    return frame(msgpack.packb(doc, use_bin_type=True), version)


def test_delete_refuses_a_damaged_or_hostile_manifest_and_keeps_a_referenced_base(s3_env, s3_url):
    run = s3_url
    for name, change in (
        ("garbage", lambda raw: b"\x00not a manifest" * 10),
        ("flipped", lambda raw: raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:]),
        ("hostile", _hostile),
    ):
        cloudckpt.save(_state(1), f"{run}/{name}")
        _rewrite_manifest(s3_env, f"{run}/{name}", change)
    cloudckpt.save(_state(9), f"{run}/keep")
    before = _keys(s3_env, run)
    for name in ("garbage", "flipped", "hostile"):
        with pytest.raises(ManifestError, match="nothing deleted"):
            cloudckpt.delete(f"{run}/{name}")
        assert _keys(s3_env, run) == before, name
    assert cloudckpt.exists(f"{run}/hostile")  # still there: `cloudckpt rm` removes it

    inc = f"{run}/inc"
    mgr = CheckpointManager(inc, incremental=True, save_options=SaveOptions(object_size=64))
    big = {f"p{i}": torch.full((64,), float(i)) for i in range(4)}
    mgr.save(1, big)
    mgr.save(2, {**big, "p3": torch.full((64,), 33.0)})  # p0..p2 stay in step 1's objects
    assert mgr.info(2).shared_bytes > 0
    assert cloudckpt.delete(mgr.step_url(1)) >= 1
    assert not cloudckpt.exists(mgr.step_url(1))
    assert any(k.startswith("step-000000000001/data/") for k in _keys(s3_env, inc))  # kept
    full = cloudckpt.load_full(mgr.step_url(2))
    assert torch.equal(full["p0"], big["p0"]) and torch.equal(full["p3"], torch.full((64,), 33.0))
    assert [i.step for i in cloudckpt.list_checkpoints(inc)] == [2]


NAME_CHARS = "abcxyz019 =.-_+,é~"  # what an s3:// URL can carry (no #, ?, @)


def _names(rng: random.Random) -> list[str]:
    """Names that are prefixes of each other, with spaces and odd characters."""
    names = ["last", "last-v1", "ck", "ck 1", "ck.1", "a=1", "é é"]
    while len(names) < 11:
        n = "".join(rng.choice(NAME_CHARS) for _ in range(rng.randint(1, 12))).strip()
        if n and n not in (".", "..") and n not in names:
            names.append(n)
    return names


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_generated_names_delete_and_prune_stay_in_their_folder(s3_env, s3_url, seed):
    rng = random.Random(seed)
    run = s3_url
    names = _names(rng)
    for i, name in enumerate(names):
        cloudckpt.save(_state(i), f"{run}/{name}", metadata={"step": i})
    assert sorted(i.name for i in cloudckpt.list_checkpoints(run)) == sorted(names)

    victim = names[rng.randrange(len(names))]
    before = _keys(s3_env, run)
    cloudckpt.delete(f"{run}/{victim}")
    after = _keys(s3_env, run)
    assert all(k.startswith(victim + "/") for k in set(before) - set(after))
    assert {k: v for k, v in before.items() if not k.startswith(victim + "/")} == after
    names.remove(victim)

    res = _cli(s3_env, "ls", run, "--json")
    assert res.returncode == 0, res.stderr
    assert [r["name"] for r in json.loads(res.stdout)] == names  # steps 0.. in order
    res = _cli(s3_env, "prune", run, "--keep-last", "3", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert sorted(r["name"] for r in doc["removed"]) == sorted(names[:-3])
    final = _keys(s3_env, run)
    assert {k.split("/", 1)[0] for k in final} == set(names[-3:])
    assert {k: v for k, v in after.items() if k.split("/", 1)[0] in names[-3:]} == final
    for name in names[-3:]:
        assert cloudckpt.load_full(f"{run}/{name}")["seed"] >= 0
    res = _cli(s3_env, "ls", run)
    assert res.returncode == 0 and names[-1] in res.stdout, res.stderr
