"""``verify`` agrees with ``load``: a checkpoint that ``load_full`` or ``load`` refuses is one
``verify`` reports a problem with (a not-``ok`` report, or the same error when the manifest does
not decode), and a checkpoint they load is one it passes. Broken layouts (gaps and overlaps with
the element count kept, so only the coverage check can see them; layouts too irregular to check),
broken data (missing, truncated, corrupted objects; empty chunks past an object's end), a
manifest that does not decode, and
harmless oddities (an unused object that does not exist, empty chunks naming one) on LocalStore
and S3. And ``verify`` asks the store about exactly the objects the chunks use: one HEAD each, no
listing, whatever else the store holds.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import cloudckpt
from cloudckpt import errors
from cloudckpt.checksum import block_crcs
from cloudckpt.manifest.builder import ManifestBuilder
from cloudckpt.manifest.codec import encode_manifest
from cloudckpt.planning import cover_sweep
from tests.reliability import hostile_layouts as hl
from tests.reliability.stores import RawCheckpoint

pytestmark = pytest.mark.timeout(300)

BLOCK = 64


def _columns():
    return hl.column_split(24)


def _shift_one_chunk(layout):
    """Move one chunk one row up: an overlap above it and a gap below, element count kept."""
    shape, off, size = layout
    off = off.copy()
    i = int(np.flatnonzero(off[:, 0] > 0)[0])
    off[i, 0] -= 1
    return shape, off, size


def _duplicate_one_drop_another(layout):
    """One unit chunk listed twice, another left out: element count kept."""
    shape, off, size = layout
    keep = [0, 0] + list(range(2, len(off)))
    return shape, off[keep], size[keep]


def _build(layouts: dict, *, extra=None) -> bytes:
    """Manifest bytes (real crcs of the zero data in :data:`hl.DATA_KEY`); ``extra(builder)`` may
    add more chunks and objects."""
    b = ManifestBuilder(
        world_size=1,
        checksum_block_size=BLOCK,
        created_at=0.0,
        structure=["d", [[name, ["x", name]] for name in layouts]],
    )
    at = 0
    for name, (shape, off, size) in layouts.items():
        b.add_tensor(name, "uint8", shape)
        for o, s in zip(off.tolist(), size.tolist()):
            n = int(np.prod(s))
            b.add_chunk(name, o, s, hl.DATA_KEY, at, n, block_crcs(bytes(n), BLOCK))
            at += n
    if extra is not None:
        extra(b)
    return encode_manifest(b.build())


def _data_size(layouts) -> int:
    return sum(int(np.prod(s)) for _, _, size in layouts.values() for s in size.tolist())


def _empty_chunk(key: str, byte_offset: int):
    def add(b):
        b.add_tensor("e", "uint8", (0, 3))
        b.add_chunk("e", (0, 0), (0, 3), key, byte_offset, 0, [0])
        b.structure = ["d", [[name, ["x", name]] for name in ("w", "g", "e")]]

    return add


def _unused_object(b):
    b.object_index(f"data/{hl.ATTEMPT}/unused.bin")


LAYOUTS = {"w": _columns(), "g": hl.brick_wall(4, 3, 3)}

#: name -> (layouts, manifest extra, data mutation, refused by load?)
CASES = {
    "valid": (LAYOUTS, None, None, False),
    "unused-object-missing": (LAYOUTS, _unused_object, None, False),
    "empty-chunk-in-missing-object": (
        LAYOUTS,
        _empty_chunk(f"data/{hl.ATTEMPT}/none.bin", 0),
        None,
        False,
    ),
    "overlap-and-gap-columns": ({**LAYOUTS, "w": _shift_one_chunk(_columns())}, None, None, True),
    "overlap-and-gap-wall": (
        {**LAYOUTS, "g": _shift_one_chunk(hl.row_split(12))},
        None,
        None,
        True,
    ),
    "duplicate-and-missing-cell": (
        {**LAYOUTS, "g": _duplicate_one_drop_another(hl.tiny_cubes(5))},
        None,
        None,
        True,
    ),
    "manifest-cut-short": (LAYOUTS, None, "cut-manifest", True),
    "empty-chunk-past-the-end": (LAYOUTS, _empty_chunk(hl.DATA_KEY, 1 << 20), None, True),
    "missing-object": (LAYOUTS, None, "delete", True),
    "truncated-object": (LAYOUTS, None, "truncate", True),
    "corrupted-byte": (LAYOUTS, None, "flip", True),
}


def _delete(raw: RawCheckpoint, key: str) -> None:
    if raw.url.startswith("s3://"):
        raw.client.delete_object(Bucket=raw.bucket, Key=f"{raw.prefix}/{key}")
    else:
        (raw.root / key).unlink()


def _outcomes(url, storage, layouts):
    """What load_full, load and verify did: None (loaded / ok) or the error / the report."""
    out = {}
    try:
        cloudckpt.load_full(url, storage=storage)
        out["load_full"] = None
    except errors.CloudCkptError as exc:
        out["load_full"] = exc
    dest = {name: torch.zeros(shape, dtype=torch.uint8) for name, (shape, _, _) in layouts.items()}
    try:
        cloudckpt.load(dest, url, storage=storage, strict=False)
        out["load"] = None
    except errors.CloudCkptError as exc:
        out["load"] = exc
    try:
        report = cloudckpt.verify(url, storage=storage)
        out["verify"] = None if report.ok else report
    except errors.CloudCkptError as exc:
        out["verify"] = exc
    return out


def _where(request, tmp_path, name):
    if request.param == "local":
        url = str(tmp_path / name)
        return url, None, RawCheckpoint(url)
    s3_server, storage = request.getfixturevalue("s3_server"), request.getfixturevalue("storage")
    url = s3_server.url(f"agree-{os.getpid()}/{name}")
    return url, storage, RawCheckpoint(url, s3_server)


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    return lambda name: _where(request, tmp_path, name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_reports_a_problem_exactly_when_load_refuses(place, case, figures):
    layouts, extra, mutation, refused = CASES[case]
    url, storage, raw = place(case)
    raw.write(hl.DATA_KEY, bytes(_data_size(layouts)))
    raw.write("manifest.msgpack", _build(layouts, extra=extra))
    if mutation == "delete":
        _delete(raw, hl.DATA_KEY)
    elif mutation == "truncate":
        raw.truncate(hl.DATA_KEY, _data_size(layouts) - 1)
    elif mutation == "flip":
        raw.flip(hl.DATA_KEY, 5)
    elif mutation == "cut-manifest":  # does not decode: every entry point raises ManifestError
        raw.truncate("manifest.msgpack", 100)
    out = _outcomes(url, storage, layouts)
    assert (out["load_full"] is not None) == (out["load"] is not None) == refused, (case, out)
    assert (out["verify"] is not None) == refused, (case, out)
    if mutation == "cut-manifest":
        assert all(isinstance(e, errors.ManifestError) for e in out.values()), out
    if case.startswith(("overlap", "duplicate")):
        assert isinstance(out["load_full"], errors.CoverageError), out
        assert any("CoverageError" in p for p in out["verify"].problems), out["verify"].problems
    figures.add("verify agrees with load (cases)")


def test_layouts_too_irregular_to_check_are_refused_by_both(tmp_path, monkeypatch):
    monkeypatch.setattr(cover_sweep, "WORK_FACTOR", 0)
    monkeypatch.setattr(cover_sweep, "WORK_FLOOR", 4)
    url = str(tmp_path / "ckpt")
    raw = RawCheckpoint(url)
    raw.write(hl.DATA_KEY, bytes(_data_size(LAYOUTS)))
    raw.write("manifest.msgpack", _build(LAYOUTS))
    out = _outcomes(url, None, LAYOUTS)
    assert isinstance(out["load_full"], errors.CoverageError) and "too irregular" in str(
        out["load_full"]
    )
    assert out["load"] is not None
    assert any("too irregular" in p for p in out["verify"].problems), out["verify"]


def test_hostile_entry_point_checkpoints_agree(tmp_path):
    """The hostile-manifest target (tests/reliability/hostile.py) with its ``r`` pieces moved so
    they overlap and leave a gap (element count kept): every entry point refuses, verify too."""
    from tests.reliability.hostile import (
        check_refusals,
        column_values,
        make_target,
        pack,
        reencode_column,
        run_entry_points,
        valid_doc,
    )

    target = make_target(str(tmp_path / "ckpt"), area=tmp_path)
    doc = valid_doc(target)
    names = doc["tensors"]["names"]
    counts = column_values(doc["tensors"]["chunk_counts"])
    ndims = column_values(doc["tensors"]["ndims"])
    t = names.index("r")
    offsets = column_values(doc["chunks"]["offsets"])
    # offsets are dimension-major per tensor: tensor r's dim-0 offsets come first
    start = sum(c * n for c, n in zip(counts[:t], ndims[:t]))
    r_dim0 = offsets[start : start + counts[t]]
    assert r_dim0 == [0, 2]
    offsets[start + 1] = 1  # second half moved up a row: row 1 twice, row 3 never
    doc["chunks"]["offsets"] = reencode_column(doc["chunks"]["offsets"], offsets)
    target.write_manifest(pack(doc))
    outcome = run_entry_points(target)
    assert check_refusals(outcome, "moved piece") == "accepted"  # the manifest decodes
    assert isinstance(outcome.errors["load_full"], errors.CoverageError), outcome.errors
    assert outcome.errors["load"] is not None
    assert not cloudckpt.verify(target.url).ok


# -- what verify asks the store ------------------------------------------------------------------


@pytest.fixture(params=["local", "s3"])
def saved(request, tmp_path):
    """A saved checkpoint of several data objects, a store full of other objects around it (in
    its own data folder, beside it, in another checkpoint), and its manifest listing one more
    object no chunk uses."""
    url, storage, raw = _where(request, tmp_path, "ckpt")
    state = {f"t{i}": torch.arange(300 * (i + 1), dtype=torch.float32) for i in range(6)}
    cloudckpt.save(state, url, storage=storage, options=cloudckpt.SaveOptions(object_size=2048))
    manifest = cloudckpt.read_manifest(url, storage=storage)
    used = {
        manifest.objects[c.object_index]
        for name in manifest.tensors
        for c in manifest.tensors[name].chunks
        if c.byte_length
    }
    attempt_dir = sorted(used)[0].rsplit("/", 1)[0]
    listed_unused = f"{attempt_dir}/r99999-0000.bin"
    for key in (
        f"{attempt_dir}/zz-extra.bin",
        listed_unused,
        "other/junk.bin",
        "data/ffffffffffffffff/r00000-0000.bin",
    ):
        raw.write(key, b"x" * 100)
    raw.write(
        "manifest.msgpack", hl.with_fields(manifest, objects=[*manifest.objects, listed_unused])
    )
    return url, storage, used


def test_verify_heads_only_the_objects_the_chunks_use(saved, monkeypatch):
    url, storage, used = saved
    import cloudckpt.api.verify as verify_mod

    stores = []
    real = verify_mod.shared_store

    def spy(u, s=None):
        store = real(u, s)
        stores.append(store)
        return store

    monkeypatch.setattr(verify_mod, "shared_store", spy)
    from cloudckpt.runtime.loop import shared_store

    before = dict(shared_store(url, storage).stats.requests)  # S3: stats shared by the bucket
    report = cloudckpt.verify(url, storage=storage)
    assert report.ok, report.problems
    assert len(stores) == 1
    after = stores[0].stats.requests
    if storage is None:
        before = {}
    delta = {op: after.get(op, 0) - before.get(op, 0) for op in after}
    assert len(used) > 2
    assert delta.get("head", 0) == len(used) == report.objects_checked, (delta, used)
    assert delta.get("list", 0) == 0, delta
