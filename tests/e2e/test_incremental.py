"""Incremental checkpoints against SeaweedFS: only changed chunks are uploaded, every reader
(load, load_full, verify, export, the command line) reads a referencing checkpoint exactly like
a full one, deleting keeps what later checkpoints reference and collects it once nothing does;
the same through async saves and a 2-rank world."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import cloudckpt
from cloudckpt import CheckpointManager, SaveOptions
from cloudckpt.errors import ConfigError
from cloudckpt.layout import step_dir
from tests.reliability.stores import cli

FROZEN = 64 * 256 * 4  # bytes of the frozen tensor
OPTIONS = SaveOptions(object_size=64 << 10, checksum_block_size=16 << 10)


def _state(step: int) -> dict:
    """A frozen embedding, a trained layer that changes at every step, a buffer that changes
    every other step, and plain values."""
    frozen = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    trained = torch.randn(32, 32, generator=torch.Generator().manual_seed(100 + step))
    buffer = torch.full((16,), float(step // 2))
    return {
        "model": {"embed": frozen, "layer": trained, "buf": buffer},
        "opt": {"step": step, "betas": (0.9, 0.99)},
    }


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b and type(a) is type(b)


def _raw_keys(s3_server, url: str) -> set[str]:
    bucket, _, root = url[len("s3://") :].partition("/")
    client = s3_server.boto3_client()
    keys = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root + "/"):
        keys |= {o["Key"][len(root) + 1 :] for o in page.get("Contents", [])}
    return keys


def test_incremental_run_through_every_reader(s3_env, s3_url, tmp_path):
    mgr = CheckpointManager(s3_url, incremental=True, save_options=OPTIONS)
    first = mgr.save(1, _state(1))
    assert first.bytes_reused == 0 and first.base == ""
    second = mgr.save(2, _state(2))  # the embedding is reused; the layer and buffer changed
    assert second.base == step_dir(1).rstrip("/")
    assert (second.bytes_reused, second.bytes_written) == (FROZEN, 32 * 32 * 4 + 64)
    third = mgr.save(3, _state(3))  # the embedding (in step 1) and the buffer (in step 2)
    assert (third.bytes_reused, third.bytes_written) == (FROZEN + 64, 32 * 32 * 4)
    assert third.base == step_dir(2).rstrip("/")

    for step in (1, 2, 3):
        url = mgr.step_url(step)
        assert _equal(cloudckpt.load_full(url), _state(step)), step
        assert cloudckpt.verify(url).ok
        target = _state(0)
        cloudckpt.load(target, url)
        assert _equal(target, _state(step))
    manifest = cloudckpt.read_manifest(mgr.step_url(3))
    assert manifest.base == step_dir(2).rstrip("/")
    one, two = step_dir(1).rstrip("/"), step_dir(2).rstrip("/")
    assert set(manifest.object_homes) == {"", one, two}  # the embedding: step 1, not via 2

    # export and the command line read it like a full checkpoint
    out = tmp_path / "three.safetensors"
    from cloudckpt.export.file import export

    export(mgr.step_url(3), str(out))
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out))["model.embed"], _state(3)["model"]["embed"])
    # the Hugging Face export and the conversion to DCP read through the same view
    hf = tmp_path / "hf"
    cloudckpt.export_safetensors(mgr.step_url(3), str(hf), prefix="model.")
    exported = {}
    for f in sorted(hf.glob("*.safetensors")):
        exported.update(load_file(str(f)))
    assert exported.keys() == _state(3)["model"].keys()
    assert all(torch.equal(exported[k], v) for k, v in _state(3)["model"].items())
    dcp_dir = tmp_path / "dcp"
    cloudckpt.convert(mgr.step_url(3), str(dcp_dir), to="dcp")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    target = {"model": {k: torch.zeros_like(v) for k, v in _state(3)["model"].items()}}
    dcp.load(target, storage_reader=FileSystemReader(str(dcp_dir)))
    assert all(torch.equal(target["model"][k], v) for k, v in _state(3)["model"].items())
    res = cli(s3_env, "show", mgr.step_url(3))
    assert res.returncode == 0, res.stderr
    assert f"base        {two}" in res.stdout
    assert "objects of other checkpoints it uses (2, " in res.stdout
    res = cli(s3_env, "show", mgr.step_url(3), "--json")
    refs = json.loads(res.stdout)["references"]
    assert [(r["folder"], r["bytes"]) for r in refs] == [(one, FROZEN), (two, 64)]
    res = cli(s3_env, "ls", s3_url, "--details", "--json")
    rows = {r["step"]: r for r in json.loads(res.stdout)}
    assert (rows[1]["shared_bytes"], rows[1]["base_step"]) == (0, None)
    assert (rows[3]["own_bytes"], rows[3]["shared_bytes"], rows[3]["base_step"]) == (
        32 * 32 * 4,
        FROZEN + 64,
        2,
    )

    # deleting step 1 keeps its embedding's object (steps 2 and 3 use it): retained, not listed
    before = _raw_keys(s3_env, s3_url)
    mgr.delete(1)
    assert [i.step for i in mgr.list()] == [2, 3]
    kept = _raw_keys(s3_env, s3_url)
    assert f"{one}/manifest.msgpack" not in kept
    embed_objects = {
        f"{one}/{k}" for h, k in zip(manifest.object_homes, manifest.objects) if h == one
    }
    assert {k for k in kept if k.startswith(f"{one}/data/")} == embed_objects
    assert {k for k in before if k.startswith(f"{one}/data/")} > embed_objects
    for step in (2, 3):
        assert _equal(cloudckpt.load_full(mgr.step_url(step)), _state(step))
        assert cloudckpt.verify(mgr.step_url(step)).ok
    # rm step 2 (3 uses its buffer), save 4, prune 3: what only 2 and 3 used goes
    assert cli(s3_env, "rm", mgr.step_url(2)).returncode == 0
    assert _equal(cloudckpt.load_full(mgr.step_url(3)), _state(3))
    mgr.save(4, _state(4))
    now = CheckpointManager(s3_url, keep_last=1, abandoned_after=0)
    assert [i.step for i in now.prune()][:1] == [3]
    left = _raw_keys(s3_env, s3_url)
    assert {k.split("/")[0] for k in left} == {one, step_dir(4).rstrip("/")}
    assert {k for k in left if k.startswith(f"{one}/data/")} == embed_objects
    assert _equal(cloudckpt.load_full(mgr.step_url(4)), _state(4))
    now.delete(4)
    assert _raw_keys(s3_env, s3_url) == set()


def test_a_base_outside_the_run_is_refused_and_a_missing_one_means_a_full_save(s3_env, s3_url):
    cloudckpt.save(_state(1), f"{s3_url}/run/a")  # a default save records chunk hashes
    for bad in (f"{s3_url}/other/a", f"{s3_url}/run/b", f"{s3_url}/run"):
        with pytest.raises(ConfigError, match="not another checkpoint of the run"):
            cloudckpt.save(_state(2), f"{s3_url}/run/b", base=bad)
    result = cloudckpt.save(_state(2), f"{s3_url}/run/b", base=f"{s3_url}/run/missing")
    assert result.base == "" and result.bytes_reused == 0
    # so it serves as a base with no option: every unchanged chunk is reused
    result = cloudckpt.save(_state(2), f"{s3_url}/run/c", base=f"{s3_url}/run/a")
    assert result.base == "a" and result.bytes_reused == FROZEN
    assert _equal(cloudckpt.load_full(f"{s3_url}/run/c"), _state(2))
    # a base without hashes (a save that turned them off) makes a full save that records them
    cloudckpt.save(_state(1), f"{s3_url}/run/plain", options=SaveOptions(content_hashes=False))
    assert cloudckpt.read_manifest(f"{s3_url}/run/plain").chunk_hashes is None
    result = cloudckpt.save(_state(1), f"{s3_url}/run/d", base=f"{s3_url}/run/plain")
    assert result.base == "" and cloudckpt.read_manifest(f"{s3_url}/run/d").chunk_hashes is not None


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_a_base_changed_after_its_early_read_means_a_full_save(
    s3_env, s3_url, s3_server, monkeypatch, change
):
    """The coordinator reads the base during planning, pins it later: a base manifest replaced
    or deleted in between is caught by the check after pinning (ETag), and the save writes every
    chunk, its pins removed."""
    import cloudckpt.api.save as save_module
    from cloudckpt.layout import MANIFEST_KEY

    run = f"{s3_url}/early-{change}"
    cloudckpt.save(_state(1), f"{run}/a", options=SaveOptions(content_hashes=True))
    cloudckpt.save(_state(3), f"{run}/other", options=SaveOptions(content_hashes=True))
    read_base = save_module.read_base

    async def read_then_change(store, base):
        read = await read_base(store, base)
        assert read.manifest is not None  # usable when read
        if change == "deleted":
            await store.delete([f"{base}/{MANIFEST_KEY}"])
        else:  # another valid manifest (other bytes, another ETag) in its place
            other = await store.get(f"other/{MANIFEST_KEY}")
            await store.put(f"{base}/{MANIFEST_KEY}", other)
        return read

    monkeypatch.setattr(save_module, "read_base", read_then_change)
    result = cloudckpt.save(_state(2), f"{run}/b", base=f"{run}/a")
    assert result.base == "" and result.bytes_reused == 0
    assert not cloudckpt.read_manifest(f"{run}/b").references
    assert not [k for k in _raw_keys(s3_server, run) if "/pins/" in k]
    assert _equal(cloudckpt.load_full(f"{run}/b"), _state(2))


def test_async_incremental_save_hashes_the_staged_copy(s3_env, s3_url):
    mgr = CheckpointManager(s3_url, incremental=True, save_options=OPTIONS)
    mgr.save(1, _state(1))
    state = _state(2)
    handle = mgr.save(2, state, blocking=False)
    state["model"]["embed"].add_(1.0)  # training mutates right away: the staged copy is saved
    state["model"]["layer"].zero_()
    result = handle.result(timeout=120)
    assert result.bytes_reused == FROZEN and result.base == step_dir(1).rstrip("/")
    assert _equal(cloudckpt.load_full(mgr.step_url(2)), _state(2))
    mgr.close()


def rank_incremental(url: str) -> dict:
    """Each rank holds a row shard of a frozen and of a trained tensor (as DTensor-free
    GlobalPieces) plus a replicated buffer; three incremental saves, then loads."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def state(step):
        frozen = torch.randn(64, 128, generator=torch.Generator().manual_seed(7))
        trained = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
        rows = slice(rank * 32, (rank + 1) * 32)
        return (
            {
                "frozen": cloudckpt.GlobalPiece(frozen[rows].clone(), (64, 128), (rank * 32, 0)),
                "trained": cloudckpt.GlobalPiece(trained[rows].clone(), (64, 16), (rank * 32, 0)),
                "buf": torch.arange(8.0),
                "step": step,
            },
            frozen,
            trained,
        )

    mgr = CheckpointManager(url, incremental=True, save_options=OPTIONS)
    results = []
    for step in (1, 2, 3):
        results.append(mgr.save(step, state(step)[0]))
    full = cloudckpt.load_full(mgr.step_url(3))
    _, frozen, trained = state(3)
    target = state(0)[0]
    cloudckpt.load(target, mgr.step_url(3))
    _, _, trained3 = state(3)
    rows = slice(rank * 32, (rank + 1) * 32)
    return {
        "reused": [r.bytes_reused for r in results],
        "written": [r.rank_bytes_written for r in results],
        "full_ok": torch.equal(full["frozen"], frozen) and torch.equal(full["trained"], trained),
        "load_ok": torch.equal(target["frozen"].local, frozen[rows])
        and torch.equal(target["trained"].local, trained3[rows])
        and target["step"] == 3,
        "world": world,
    }


def test_world2_incremental_saves(world2, s3_url):
    results = world2.run(rank_incremental, s3_url)
    assert all(r["full_ok"] and r["load_ok"] for r in results), results
    reused = results[0]["reused"]
    assert reused[0] == 0 and reused[1] == reused[2] == 64 * 128 * 4 + 8 * 4  # both ranks' shards
    # every rank wrote only its trained shard after the first save
    assert [r["written"][1] for r in results] == [32 * 16 * 4, 32 * 16 * 4]
    assert cloudckpt.verify(f"{s3_url}/{step_dir(3)}").ok


@pytest.mark.parametrize("how", ["flip", "garbage"])
def test_a_damaged_newest_checkpoint_makes_a_full_save_not_a_stuck_run(
    s3_env, s3_url, s3_server, caplog, how
):
    """The newest checkpoint, the next save's base, has a damaged manifest: the save writes
    every chunk (WARNING logged) instead of failing every save of the run from then on; the
    save after it is incremental again, on the new checkpoint."""
    from tests.manager.test_manager_s3 import _damage_manifest

    mgr = CheckpointManager(s3_url, incremental=True, save_options=OPTIONS)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    _damage_manifest(s3_server, s3_url, 2, how)
    with caplog.at_level("WARNING", logger="cloudckpt.api.incremental"):
        third = mgr.save(3, _state(3))
    assert third.base == "" and third.bytes_reused == 0
    assert any("damaged" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert _equal(cloudckpt.load_full(mgr.step_url(3)), _state(3))
    assert cloudckpt.verify(mgr.step_url(3)).ok
    fourth = mgr.save(4, _state(4))
    assert fourth.base == step_dir(3).rstrip("/") and fourth.bytes_reused == FROZEN
    assert _equal(cloudckpt.load_full(mgr.step_url(4)), _state(4))


_COUNTED = ("all_gather", "all_gather_into_tensor", "broadcast", "barrier", "all_reduce")


def rank_hashed_save_collectives(url: str) -> dict:
    """A save with chunk hashes and no base, and one without hashes, each with its collectives
    and phases counted; then the hashed one serves as the base of a third save."""
    from collections import Counter

    from cloudckpt.transport import ControlChannel

    rank = dist.get_rank()
    state = {"w": torch.arange(64.0) + rank, "step": 3}
    originals = {op: getattr(dist, op) for op in _COUNTED}
    phase = ControlChannel.phase
    seen: dict[str, tuple] = {}

    def counted_save(name: str, **kwargs) -> None:
        counts: Counter = Counter()
        phases: list[str] = []

        def counted(op, fn):
            def wrapper(*args, **kw):
                counts[op] += 1
                return fn(*args, **kw)

            return wrapper

        def named(self, what, *args, **kw):
            phases.append(what)
            return phase(self, what, *args, **kw)

        try:
            for op, fn in originals.items():
                setattr(dist, op, counted(op, fn))
            ControlChannel.phase = named  # type: ignore[method-assign]
            cloudckpt.save(
                {"w": cloudckpt.GlobalPiece(state["w"], (128,), (64 * rank,)), "step": 3},
                f"{url}/{name}",
                **kwargs,
            )
        finally:
            for op, fn in originals.items():
                setattr(dist, op, fn)
            ControlChannel.phase = phase  # type: ignore[method-assign]
        seen[name] = (dict(counts), tuple(phases))

    # no plan cache: both plan (a cached plan would skip two phases of the second save)
    counted_save("plain", options=SaveOptions(content_hashes=False, use_plan_cache=False))
    counted_save("hashed", options=SaveOptions(content_hashes=True, use_plan_cache=False))
    result = cloudckpt.save(
        {"w": cloudckpt.GlobalPiece(state["w"], (128,), (64 * rank,)), "step": 3},
        f"{url}/again",
        base=f"{url}/hashed",
    )
    return {"seen": seen, "reused": result.bytes_reused, "base": result.base}


def test_a_hashed_save_without_a_base_runs_no_base_phase(world2, s3_env, s3_url):
    """Chunk hashes without a base cost no collective: no ``save base`` phase, no broadcast of
    a table of known hashes (every rank learns there is no base from the planning report)."""
    for r in world2.run(rank_hashed_save_collectives, s3_url):
        plain, hashed = r["seen"]["plain"], r["seen"]["hashed"]
        assert "save base" not in hashed[1] and hashed == plain, r
        assert r["reused"] == 64 * 4 * 2 and r["base"] == "hashed", r
    assert cloudckpt.read_manifest(f"{s3_url}/hashed").chunk_hashes is not None
    assert cloudckpt.read_manifest(f"{s3_url}/plain").chunk_hashes is None


def _as_legacy_v3(folder) -> None:
    """Rewrite a checkpoint's manifest as an older cloudckpt wrote a hashed one: format version
    3, 16-byte XXH3-128 digests of each chunk's stored bytes (``hash_algorithm`` "xxh3-128")."""
    import msgpack
    import xxhash

    from cloudckpt.manifest.framing import frame, unframe

    path = folder / "manifest.msgpack"
    m = cloudckpt.read_manifest(str(folder))
    c = m.columns
    digests = b""
    for obj, off, n in zip(c.object_index, c.byte_offset, c.byte_length):
        with open(folder / m.objects[int(obj)], "rb") as f:
            f.seek(int(off))
            digests += xxhash.xxh3_128_digest(f.read(int(n)))
    version, payload = unframe(path.read_bytes())
    doc = msgpack.unpackb(bytes(payload), raw=False, strict_map_key=False)
    assert version == 2 and len(doc["chunks"].pop("hash64")) == 8 * m.num_chunks
    doc["chunks"]["hash"] = digests
    doc.update(version=3, homes=[""] * len(m.objects), base="", attempt="")
    doc["hash_algorithm"] = "xxh3-128"
    path.write_bytes(frame(msgpack.packb(doc, use_bin_type=True), 3))


def test_a_base_saved_by_an_older_cloudckpt_still_serves(tmp_path):
    """Old manifests serve as bases: one with 16-byte XXH3-128 hashes (format 3 of an older
    cloudckpt) gives the same reuse as today's 8-byte ones, and the new manifest records 8-byte
    hashes; one without hashes (format 2, hashes off) makes a full save."""
    from cloudckpt.checksum import content_hash
    from cloudckpt.manifest.framing import stored_version

    run = tmp_path / "run"
    cloudckpt.save(_state(1), str(run / "old"), options=OPTIONS)
    _as_legacy_v3(run / "old")
    old = cloudckpt.read_manifest(str(run / "old"))
    assert stored_version((run / "old" / "manifest.msgpack").read_bytes()) == 3
    assert old.chunk_hash_bytes == 16 and old.attempt == ""
    result = cloudckpt.save(_state(2), str(run / "new"), base=str(run / "old"), options=OPTIONS)
    assert result.base == "old" and result.bytes_reused == FROZEN
    assert _equal(cloudckpt.load_full(str(run / "new")), _state(2))
    assert cloudckpt.verify(str(run / "new")).ok
    new = cloudckpt.read_manifest(str(run / "new"))
    assert new.chunk_hash_bytes == 8 and new.references
    c = new.columns
    for i, (obj, off, n) in enumerate(zip(c.object_index, c.byte_offset, c.byte_length)):
        home = new.object_homes[int(obj)] or "new"
        with open(run / home / new.objects[int(obj)], "rb") as f:
            f.seek(int(off))
            assert new.chunk_hashes[i].tobytes() == content_hash(f.read(int(n)))
    # the next save takes the new checkpoint as its base: the references stay flat
    again = cloudckpt.save(_state(3), str(run / "next"), base=str(run / "new"), options=OPTIONS)
    assert again.bytes_reused >= FROZEN
    assert _equal(cloudckpt.load_full(str(run / "next")), _state(3))
    # a format 2 base without hashes: a full save
    off = SaveOptions(object_size=64 << 10, checksum_block_size=16 << 10, content_hashes=False)
    cloudckpt.save(_state(1), str(run / "plain"), options=off)
    assert stored_version((run / "plain" / "manifest.msgpack").read_bytes()) == 2
    full = cloudckpt.save(_state(1), str(run / "full"), base=str(run / "plain"), options=OPTIONS)
    assert full.base == "" and full.bytes_reused == 0
