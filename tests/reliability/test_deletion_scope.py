"""Deleting a checkpoint never deletes what another folder owns (issue 28, deletion scope).

A run holds three siblings a deletion must leave alone: ``step-1`` (complete; it must still load
bit-exact), ``step-2`` (a killed save: data objects, no manifest) and ``keep`` (a folder that is
no step: data objects of the layout, no manifest). Then ``step-5``'s manifest is replaced by a
forged one (a valid, checksummed format-3 manifest) whose objects name those siblings, and
itself, as their homes (one of them is ``step-1``'s manifest), with an attempt id whose pins exist
nowhere. ``step-5`` is deleted through every entry point: ``delete_checkpoint`` (judged two hours
later), the manager's ``delete`` and ``prune`` (``abandoned_after=0``: every object counts as old)
and ``cloudckpt rm`` (on a local run the siblings' files are aged two hours, past the command's
one-hour cutoff).
Every sibling key survives, ``step-1`` loads bit-exact, and ``step-5`` owns nothing afterwards.

Manifests that do not decode (keys with ``..``, absolute keys, homes with ``/`` or ``..``, the
manifest of another checkpoint as an object) are deleted as damaged ones: only ``step-5`` goes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgpack
import pytest
import torch

import cloudckpt
from cloudckpt import CheckpointManager, RetentionPolicy, SaveOptions
from cloudckpt.layout import step_dir
from cloudckpt.manifest.framing import frame, unframe
from cloudckpt.runs.cleanup import delete_checkpoint
from cloudckpt.runtime.loop import run_coroutine, shared_store
from tests.reliability.stores import cli

OPTIONS = SaveOptions(object_size=16 << 10, content_hashes=True)
FORGED_ATTEMPT = "00000000000000fe"
ENTRY_POINTS = ("api", "manager", "prune", "cli")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {**{f"p{i}": torch.randn(48, 96, generator=g) for i in range(5)}, "step": seed}


@pytest.fixture(params=["s3", "local"])
def run(request, s3_url, storage, tmp_path):
    if request.param == "s3":
        return s3_url, storage
    return str(tmp_path / "run"), None


def _keys(store, prefix: str = "") -> set[str]:
    async def go():
        return {i.key async for i in store.list(prefix)}

    return run_coroutine(go())


def _doc(raw: bytes) -> tuple[int, dict]:
    version, body = unframe(raw)
    return version, msgpack.unpackb(body, raw=False, strict_map_key=False)


def _as_v3(version: int, doc: dict) -> tuple[int, dict]:
    """A save without a base writes version 2 (its hashes in ``chunks.hash64``): the forger
    writes version 3's fields itself."""
    if version != 2:
        return version, doc
    lineage = dict(homes=[""] * len(doc["objects"]), base="", attempt="", hash_algorithm="")
    return 3, {**doc, **lineage, "version": 3, "chunks": {**doc["chunks"], "hash": b""}}


def _pack(version: int, doc: dict) -> bytes:
    return frame(msgpack.packb(doc, use_bin_type=True), version)


def _build(url: str, storage):
    """The run of the module docstring; returns (store, sibling keys, forged manifest doc)."""
    mgr = CheckpointManager(url, storage=storage, save_options=OPTIONS)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    cloudckpt.save(_state(3), f"{url}/keep", storage=storage, options=OPTIONS)
    mgr.save(5, _state(5))
    store = shared_store(url, storage)
    run_coroutine(store.delete([step_dir(2) + "manifest.msgpack", "keep/manifest.msgpack"]))
    siblings = _keys(store) - _keys(store, step_dir(5))
    version, doc = _as_v3(*_doc(run_coroutine(store.get(step_dir(5) + "manifest.msgpack"))))
    assert version >= 3 and len(doc["objects"]) >= 5, (version, len(doc["objects"]))
    return store, siblings, version, doc


def _forge(store, version: int, doc: dict, siblings: set[str]) -> None:
    """Objects 0-2 of step-5 now live in the three siblings, object 3 in step-5 itself, object 4
    is step-1's manifest."""
    pick = {}
    for key in sorted(siblings):
        home, _, rel = key.partition("/")
        if rel.startswith("data/"):
            pick.setdefault(home, rel)
    homes, objects = list(doc["homes"]), list(doc["objects"])
    for i, home in enumerate([step_dir(1)[:-1], step_dir(2)[:-1], "keep"]):
        homes[i], objects[i] = home, pick[home]
    homes[3] = step_dir(5)[:-1]
    homes[4], objects[4] = step_dir(1)[:-1], "manifest.msgpack"  # another checkpoint's manifest
    doc = {**doc, "homes": homes, "objects": objects, "attempt": FORGED_ATTEMPT}
    run_coroutine(store.put(step_dir(5) + "manifest.msgpack", _pack(version, doc)))


def _age(url: str, storage, seconds: float) -> None:
    if storage is None:
        past = time.time() - seconds
        for path in Path(url).rglob("*"):
            os.utime(path, (past, past), follow_symlinks=False)


def _delete(entry: str, url: str, storage, store, s3_server) -> None:
    if entry == "api":
        later = time.time() + 7200.0
        run_coroutine(delete_checkpoint(store, step_dir(5), now=later))
    elif entry == "manager":
        CheckpointManager(url, storage=storage, abandoned_after=0).delete(5)
    elif entry == "prune":
        # the newest is always kept: step-5 is the one that goes; step-2 and keep go too
        # (abandoned: keep is a folder of the run with a killed save's objects, named by a user)
        CheckpointManager(url, storage=storage, save_options=OPTIONS).save(6, _state(6))
        mgr = CheckpointManager(
            url, storage=storage, abandoned_after=0.0, retention=RetentionPolicy(keep_steps={1})
        )
        removed = [i.name for i in mgr.prune()]
        assert removed == ["keep", step_dir(2)[:-1], step_dir(5)[:-1]], removed
    else:
        _age(url, storage, 7200.0)
        res = cli(s3_server, "rm", f"{url}/{step_dir(5)[:-1]}")
        assert res.returncode == 0, res.stderr


def _check(url: str, storage, store, siblings: set[str]) -> None:
    left = _keys(store)
    assert siblings <= left, sorted(siblings - left)[:5]
    assert not {k for k in left if k.startswith(step_dir(5))}, "the forged checkpoint stays"
    loaded = cloudckpt.load_full(
        CheckpointManager(url, storage=storage).step_url(1), storage=storage
    )
    expected = _state(1)
    assert loaded.keys() == expected.keys() and loaded["step"] == 1
    assert all(torch.equal(loaded[f"p{i}"], expected[f"p{i}"]) for i in range(5))


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_forged_reference_never_widens_a_deletion_to_a_sibling(entry, run, s3_server):
    url, storage = run
    store, siblings, version, doc = _build(url, storage)
    _forge(store, version, doc, siblings)
    forged = cloudckpt.read_manifest(f"{url}/{step_dir(5)[:-1]}", storage=storage)
    assert set(forged.object_homes) >= {step_dir(1)[:-1], step_dir(2)[:-1], "keep"}
    _delete(entry, url, storage, store, s3_server)
    if entry == "prune":  # the abandoned saves are prune's own business
        siblings = {k for k in siblings if not k.startswith((step_dir(2), step_dir(6), "keep/"))}
    _check(url, storage, store, siblings)


HOSTILE = [  # (homes[0], objects[0]): none decodes
    ("", "../step-000000000001/data/0000000000000000/r00000-0000.bin"),
    ("", "/etc/passwd"),
    ("..", "data/0000000000000000/r00000-0000.bin"),
    ("../other-run", "data/0000000000000000/r00000-0000.bin"),
    ("step-000000000001/data", "r00000-0000.bin"),
    ("", "step-000000000001/../manifest.msgpack"),
]


@pytest.mark.parametrize("entry", ["manager", "cli"])
def test_a_manifest_that_does_not_decode_deletes_only_its_own_checkpoint(entry, run, s3_server):
    url, storage = run
    store, siblings, version, doc = _build(url, storage)
    mgr = CheckpointManager(url, storage=storage, abandoned_after=0, save_options=OPTIONS)
    for n, (home, key) in enumerate(HOSTILE):
        step = 10 + n
        mgr.save(step, _state(step))
        _, own = _as_v3(*_doc(run_coroutine(store.get(step_dir(step) + "manifest.msgpack"))))
        homes, objects = list(own["homes"]), list(own["objects"])
        homes[0], objects[0] = home, key
        run_coroutine(
            store.put(
                step_dir(step) + "manifest.msgpack",
                _pack(
                    version, {**own, "homes": homes, "objects": objects, "attempt": FORGED_ATTEMPT}
                ),
            )
        )
        with pytest.raises(cloudckpt.errors.ManifestError):
            cloudckpt.read_manifest(mgr.step_url(step), storage=storage)
        if entry == "manager":
            mgr.delete(step)
        else:
            res = cli(s3_server, "rm", url, "--step", str(step))
            assert res.returncode == 0, res.stderr
        assert not _keys(store, step_dir(step)), (home, key)
    siblings.update(_keys(store, step_dir(5)))
    _check_siblings(store, siblings)


def _check_siblings(store, siblings: set[str]) -> None:
    left = _keys(store)
    assert siblings <= left, sorted(siblings - left)[:5]
