"""Corruption: for every data object of a 2-rank checkpoint (S3 and file://), a flipped byte and a
truncation are each detected by ``cloudckpt.load`` / ``load_full`` and by ``cloudckpt.verify``,
the error names the object, and nothing corrupt reaches a destination tensor: the destination
elements backed by a corrupted checksum block keep their previous values, every other element
holds either its previous or its correct value. ``cloudckpt verify`` (the CLI, a subprocess)
exits 1 naming every damaged object.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import cloudckpt
from cloudckpt import LoadOptions
from tests.reliability.conftest import SAVE_OPTIONS
from tests.reliability.ranks import load_step, save_step
from tests.reliability.states import full_expected
from tests.reliability.stores import RawCheckpoint, cli

pytestmark = pytest.mark.timeout(600)

MiB = 1 << 20
STATE = {"big_bytes": 1 * MiB, "small_bytes": 96 << 10}
STEP, GEN = 3, 1
SENTINEL = 0x5A5A5A5A
BLOCK = SAVE_OPTIONS.checksum_block_size


def _make_checkpoint(kind, world2, s3_server, storage, tmp_path_factory):
    """A committed 2-rank checkpoint: (url, storage options, raw access, manifest)."""
    if kind == "s3":
        url = s3_server.url(f"corruption-{os.getpid()}-{random.getrandbits(32):08x}")
        options = storage
    else:
        url = str(tmp_path_factory.mktemp("corruption") / "ckpt")
        options = None
    saved = world2.run(
        save_step, url, STEP, GEN, storage=options, options=SAVE_OPTIONS, state_kw=STATE
    )
    assert all(o["ok"] for o in saved), saved
    manifest = cloudckpt.read_manifest(url, storage=options)
    assert len(manifest.objects) >= 6
    return url, options, RawCheckpoint(url, s3_server), manifest


@pytest.fixture(scope="module")
def s3_checkpoint(world2, s3_server, storage, tmp_path_factory):
    return _make_checkpoint("s3", world2, s3_server, storage, tmp_path_factory)


@pytest.fixture(scope="module")
def file_checkpoint(world2, s3_server, storage, tmp_path_factory):
    return _make_checkpoint("file", world2, s3_server, storage, tmp_path_factory)


@pytest.fixture(params=["s3", "file"])
def checkpoint(request):
    return request.getfixturevalue(f"{request.param}_checkpoint")


def _chunks_of(manifest, key: str):
    """(tensor name, element offset in the tensor, byte offset in the object, byte length) of
    every chunk stored in object ``key`` (all tensors here are 1-d)."""
    index = manifest.objects.index(key)
    out = []
    for name, record in manifest.tensors.items():
        for chunk in record.chunks:
            if chunk.object_index == index:
                out.append((name, chunk.offsets[0], chunk.byte_offset, chunk.byte_length))
    return out


def _blank_full() -> dict:
    sd = {
        name: torch.full_like(t, SENTINEL)
        for name, t in full_expected(2, 0, 0, **STATE).items()
        if isinstance(t, torch.Tensor)
    }
    sd["meta"] = {"step": -1, "gen": -1}
    return sd


def _check_destinations(sd: dict, manifest, key: str, bad_bytes: range) -> None:
    """Elements backed by a checksum block that overlaps ``bad_bytes`` (object byte offsets)
    still hold the sentinel; every element holds either the sentinel or its correct value."""
    expected = full_expected(2, STEP, GEN, **STATE)
    for name, dest in sd.items():
        if isinstance(dest, torch.Tensor):
            ok = (dest == SENTINEL) | (dest == expected[name])
            assert bool(ok.all()), f"{name}: an element holds neither its old nor its true value"
    for name, elem0, byte0, nbytes in _chunks_of(manifest, key):
        for block_start in range(0, nbytes, BLOCK):
            block_end = min(block_start + BLOCK, nbytes)
            if block_end + byte0 <= bad_bytes.start or block_start + byte0 >= bad_bytes.stop:
                continue
            lo, hi = elem0 + block_start // 4, elem0 + block_end // 4
            assert bool((sd[name][lo:hi] == SENTINEL).all()), (
                f"{name}[{lo}:{hi}] was written from a corrupted block of {key}"
            )


def _detects(url, options, manifest, key: str, bad_bytes: range, figures) -> None:
    sd = _blank_full()
    with pytest.raises(cloudckpt.CloudCkptError) as failed:
        cloudckpt.load(sd, url, storage=options)
    assert key in str(failed.value), failed.value
    _check_destinations(sd, manifest, key, bad_bytes)
    with pytest.raises(cloudckpt.CloudCkptError) as failed:
        cloudckpt.load_full(url, storage=options)
    assert key in str(failed.value), failed.value
    report = cloudckpt.verify(url, storage=options)
    assert not report.ok
    assert report.problems and all(p.startswith(key) for p in report.problems), report.problems
    figures.add("corruptions detected")


@pytest.mark.parametrize("kind", ["flip", "truncate"])
def test_every_data_object_corrupted_is_detected(checkpoint, kind, figures):
    url, options, raw, manifest = checkpoint
    for key in manifest.objects:
        size = len(raw.read(key))
        if kind == "flip":
            offset = size // 2
            original = raw.flip(key, offset)
            bad = range(offset, offset + 1)
        else:
            cut = size // 2
            original = raw.truncate(key, cut)
            bad = range(cut, size)
        try:
            _detects(url, options, manifest, key, bad, figures)
        finally:
            raw.write(key, original)
    assert cloudckpt.verify(url, storage=options).ok


def test_cli_verify_names_every_damaged_object(s3_checkpoint, s3_server):
    """Half the objects flipped, the other half truncated, in one go; then the other way round:
    ``cloudckpt verify`` exits 1 and names each of them (and only them). (S3 only: the CLI's
    storage path is the library's, which the other tests cover on both backends.)"""
    url, options, raw, manifest = s3_checkpoint
    keys = list(manifest.objects)
    originals = {key: raw.read(key) for key in keys}
    try:
        for flipped in (keys[0::2], keys[1::2]):
            for key in keys:
                data = bytearray(originals[key])
                if key in flipped:
                    data[-1] ^= 0xFF
                else:
                    del data[len(data) // 3 :]
                raw.write(key, bytes(data))
            res = cli(s3_server, "verify", url)
            assert res.returncode == 1, res.stdout + res.stderr
            assert res.stdout.startswith("FAILED"), res.stdout
            problems = [line.strip() for line in res.stdout.splitlines()[1:] if line.strip()]
            assert sorted({p.split(":", 1)[0] for p in problems}) == sorted(keys), problems
            assert "Traceback" not in res.stderr
    finally:
        for key, data in originals.items():
            raw.write(key, data)
    assert cloudckpt.verify(url, storage=options).ok


def test_two_rank_load_without_broadcasts_fails_on_every_rank_naming_the_object(checkpoint, world2):
    url, options, raw, manifest = checkpoint
    key = manifest.objects[-1]
    original = raw.flip(key, len(raw.read(key)) // 2)
    try:
        results = world2.run(
            load_step,
            url,
            STEP,
            GEN,
            storage=options,
            options=LoadOptions(broadcast=False),
            state_kw=STATE,
        )
    finally:
        raw.write(key, original)
    for outcome in results:
        assert not outcome["ok"] and "CheckpointError" in outcome["error"], outcome
        assert key in outcome["message"], outcome


def test_two_rank_load_with_read_once_broadcasts_fails_on_every_rank(s3_checkpoint, world2):
    """The replicated ``small.*`` tensors are read once and broadcast: corrupt the object of one
    of them. Every rank must raise (naming the object) well before the collective timeout
    (a healthy load of this checkpoint takes well under a second)."""
    url, options, raw, manifest = s3_checkpoint
    key = next(
        k
        for k in manifest.objects
        if any(name.startswith("small.") for name, *_ in _chunks_of(manifest, k))
    )
    original = raw.flip(key, 0)
    try:
        results = world2.run(
            load_step, url, STEP, GEN, storage=options, state_kw=STATE, timeout=10.0
        )
    finally:
        raw.write(key, original)
    for outcome in results:
        assert not outcome["ok"] and key in outcome["message"], outcome


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_random_corruptions_long(checkpoint, figures, seed):
    """Many random flips (anywhere in an object) and truncations (anywhere, to 0 bytes, to one
    byte short) per object."""
    url, options, raw, manifest = checkpoint
    rng = random.Random(seed)
    for key in manifest.objects:
        original = raw.read(key)
        size = len(original)
        cuts = {0, size - 1, *(rng.randrange(size) for _ in range(3))}
        for offset in [rng.randrange(size) for _ in range(4)]:
            raw.flip(key, offset)
            try:
                _detects(url, options, manifest, key, range(offset, offset + 1), figures)
            finally:
                raw.write(key, original)
        for cut in sorted(cuts):
            raw.truncate(key, cut)
            try:
                _detects(url, options, manifest, key, range(cut, size), figures)
            finally:
                raw.write(key, original)
