"""Hostile manifests, hand-made, end to end through ``cloudckpt.read_manifest`` / ``load_full`` /
``load`` (and ``verify``, the CLI) on real stores: LocalStore with a sentinel file next to the
checkpoint root, and S3. Rules (``hostile.py``): a refused manifest is refused everywhere with a
``ManifestError``, nothing is read outside the checkpoint root, nothing is written anywhere,
nothing reaches a destination tensor, memory stays bounded, pickle needs the loader's opt-in.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tracemalloc
import zlib

import msgpack
import pytest
import torch

import cloudckpt
from cloudckpt import errors
from cloudckpt.checksum import block_crcs
from cloudckpt.manifest.builder import ManifestBuilder
from cloudckpt.manifest.codec import encode_manifest
from cloudckpt.manifest.columns import encode_int_column
from tests.reliability.hostile import (
    HOSTILE_KEYS,
    SECRET,
    check_refusals,
    doc_of,
    make_target,
    pack,
    run_entry_points,
    valid_doc,
)
from tests.reliability.stores import REPO, cli

pytestmark = pytest.mark.timeout(300)

ATTEMPT = "0123456789abcdef"


@pytest.fixture(scope="module")
def local_target(tmp_path_factory):
    area = tmp_path_factory.mktemp("hostile")
    return make_target(str(area / "ckpt"), area=area)


@pytest.fixture(scope="module")
def s3_target(s3_server, storage):
    return make_target(
        s3_server.url(f"hostile-{os.getpid()}/ckpt"), storage=storage, s3_server=s3_server
    )


@pytest.fixture(params=["local", "s3"])
def target(request):
    t = request.getfixturevalue(f"{request.param}_target")
    yield t
    t.write_manifest(t.valid)


def _expect_refused(target, data: bytes, what: str, cls=errors.ManifestError):
    target.write_manifest(data)
    outcome = run_entry_points(target)
    assert check_refusals(outcome, what) == "refused", what
    for name, exc in outcome.errors.items():
        assert isinstance(exc, cls), f"{what}: {name}: {exc!r}"
    return outcome


def test_the_untouched_target_loads(target):
    outcome = run_entry_points(target)
    assert outcome.errors == {"read_manifest": None, "load_full": None, "load": None}
    assert check_refusals(outcome) == "accepted"


@pytest.mark.parametrize(
    "field,value",
    [
        ("version", 3),
        ("version", 1),
        ("version", 0),
        ("version", "2"),
        ("version", 2.0),
        ("version", None),
        ("version", True),
        ("format", "other"),
        ("format", None),
        ("format", b"cloudckpt"),
    ],
)
def test_unknown_formats_and_versions(target, field, value, figures):
    doc = valid_doc(target)
    doc[field] = value
    _expect_refused(target, pack(doc), f"{field}={value!r}", errors.UnsupportedManifestVersion)
    figures.add("hostile manifests (hand-made)")


WRONG_TYPES = [
    (("world_size",), "2"),
    (("world_size",), 0),
    (("world_size",), -1),
    (("world_size",), 2.5),
    (("world_size",), True),
    (("created_at",), "now"),
    (("created_at",), float("nan")),
    (("cloudckpt_version",), 1),
    (("checksum_block_size",), 0),
    (("checksum_block_size",), -64),
    (("checksum_block_size",), 2**62),
    (("metadata",), "meta"),
    (("metadata",), {"a": 1}),
    (("structure",), None),
    (("objects",), "data/x"),
    (("objects",), {"a": 1}),
    (("objects", 0), 5),
    (("objects", 0), None),
    (("tensors",), []),
    (("tensors", "names"), "w"),
    (("tensors", "names", 0), 7),
    (("tensors", "dtypes", 0), "object"),
    (("tensors", "dtypes", 0), "float128"),
    (("tensors", "dtypes", 0), "torch.float32"),
    (("tensors", "dtypes", 0), None),
    (("tensors", "ndims"), [1, 2, 3]),
    (("tensors", "ndims"), b"\x00"),
    (("chunks",), None),
    (("chunks", "crc32c"), "abc"),
    (("chunks", "crc32c"), b"\x00\x01\x02"),
    (("chunks", "crc32c"), b""),
    (("chunks", "offsets"), None),
    (("values",), []),
    (("values", "v.lr"), "0.1"),
    (("values", "v.lr"), None),
]


@pytest.mark.parametrize("path,value", WRONG_TYPES, ids=lambda x: repr(x)[:40])
def test_wrong_types(target, path, value, figures):
    doc = valid_doc(target)
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    _expect_refused(target, pack(doc), f"{path}={value!r}")
    figures.add("hostile manifests (hand-made)")


@pytest.mark.parametrize(
    "field",
    [
        "format",
        "version",
        "world_size",
        "objects",
        "tensors",
        "chunks",
        "values",
        "metadata",
        "structure",
        "checksum_block_size",
    ],
)
def test_missing_fields(target, field, figures):
    doc = valid_doc(target)
    del doc[field]
    _expect_refused(target, pack(doc), f"without {field}")
    figures.add("hostile manifests (hand-made)")


def test_truncated_manifests(target, figures):
    """Every prefix of the manifest (a stride of them on S3) is refused everywhere."""
    data = target.valid
    stride = 1 if target.storage is None else max(1, len(data) // 60)
    for cut in range(0, len(data), stride):
        _expect_refused(target, data[:cut], f"first {cut} of {len(data)} bytes")
        figures.add("hostile manifests (truncated)")


@pytest.mark.parametrize(
    "junk",
    [b"\x00", b"\xc1", msgpack.packb({"x": 1}), os.urandom(1 << 20)],
    ids=["nil", "reserved", "second-map", "1MiB"],
)
def test_trailing_bytes_after_the_manifest(target, junk, figures):
    _expect_refused(target, target.valid + junk, "trailing bytes")
    figures.add("hostile manifests (hand-made)")


def test_large_unknown_field_is_ignored_without_blowing_up(target):
    """Unknown top-level fields are ignored (the format is additive): a 32 MiB one included."""
    doc = valid_doc(target)
    doc["future"] = b"\x00" * (32 << 20)
    target.write_manifest(pack(doc))
    outcome = run_entry_points(target)
    assert outcome.errors == {"read_manifest": None, "load_full": None, "load": None}


# -- keys that leave the checkpoint root ----------------------------------------------------------


def _manifest_over(key: str, data: bytes, *, block: int = 64) -> bytes:
    """A valid-looking manifest with one uint8 tensor ``s`` stored whole in object ``key``, with
    the right crcs for ``data``: if the library read ``key``, the load would succeed."""
    b = ManifestBuilder(
        world_size=1, checksum_block_size=block, structure=["d", [["s", ["x", "s"]]]]
    )
    b.add_tensor("s", "uint8", (len(data),))
    b.add_chunk("s", (0,), (len(data),), key, 0, len(data), block_crcs(memoryview(data), block))
    return encode_manifest(_unchecked_build(b))


def _unchecked_build(builder):
    """``ManifestBuilder.build`` validates object keys; build a valid one and swap the key in."""
    keys = list(builder._objects)
    builder._objects = {f"data/{ATTEMPT}/k{i}.bin": i for i in range(len(keys))}
    manifest = builder.build()
    manifest.objects = tuple(keys)
    return manifest


@pytest.mark.parametrize("key", HOSTILE_KEYS + ("{secret}",), ids=repr)
def test_object_keys_outside_the_root_are_refused(local_target, key, figures):
    t = local_target
    key = key.format(secret=t.secret)
    data = _manifest_over(key, SECRET)
    t.write_manifest(data)
    outcome = run_entry_points(t)
    verdict = check_refusals(outcome, f"key {key!r}")  # never opens the sentinel, never writes
    safe_literals = ("%2e%2e/secret", "data/" + "a" * 300)
    if key in safe_literals:  # ordinary names inside the root: accepted, then not there
        assert verdict == "accepted"
        assert outcome.errors["load_full"] is not None
    else:
        assert verdict == "refused", key
        assert "objects[0]" in str(outcome.errors["read_manifest"])
    t.write_manifest(t.valid)
    figures.add("hostile manifests (hand-made)")


def test_object_keys_outside_the_root_are_refused_on_s3(s3_target, figures):
    for key in HOSTILE_KEYS:
        if key in ("%2e%2e/secret", "data/" + "a" * 300):
            continue
        _expect_refused(s3_target, _manifest_over(key, SECRET), f"key {key!r}")
        figures.add("hostile manifests (hand-made)")
    s3_target.write_manifest(s3_target.valid)


def test_symlinked_object_pointing_outside_the_root(local_target):
    t = local_target
    link = t.root / "data" / ATTEMPT / "evil.bin"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(t.secret)
    try:
        t.write_manifest(_manifest_over(f"data/{ATTEMPT}/evil.bin", SECRET))
        outcome = run_entry_points(t)
        check_refusals(outcome, "symlink")
    finally:
        link.unlink()
        t.write_manifest(t.valid)


# -- sizes: huge declarations, bombs ---------------------------------------------------------------


def test_product_of_dims_beyond_int64_is_refused(target):
    doc = valid_doc(target)
    names = doc["tensors"]["names"]
    i = names.index("w")
    ndims = encode_int_column([3 if k == i else n for k, n in enumerate(_col(doc, "ndims"))])
    shapes = _col(doc, "shapes")
    pos = sum(_col(doc, "ndims")[:i])
    shapes[pos : pos + 1] = [2**31, 2**31, 2**31]
    doc["tensors"]["ndims"] = ndims
    doc["tensors"]["shapes"] = encode_int_column(shapes)
    _expect_refused(target, pack(doc), "2**93 elements")


def _col(doc, name):
    from cloudckpt.manifest.columns import decode_int_column

    section = "tensors" if name in ("ndims", "shapes", "chunk_counts") else "chunks"
    return decode_int_column(doc[section][name]).tolist()


def _run_traced(target):
    """``run_entry_points(target)`` and the peak of Python allocations while it ran."""
    tracemalloc.start()
    try:
        outcome = run_entry_points(target)
        return outcome, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("column", ["offsets", "sizes", "byte_length"])
def test_zlib_bomb_columns_are_refused_with_bounded_memory(target, column):
    """A column whose zlib payload inflates to 256 MiB (its count says a few values)."""
    doc = valid_doc(target)
    col = list(doc["chunks"][column])
    bomb = zlib.compress(b"\x00" * (256 << 20), 9)
    doc["chunks"][column] = [col[0], col[1], "zlib", col[3], bomb]
    target.write_manifest(pack(doc))
    outcome, peak = _run_traced(target)
    assert check_refusals(outcome, "zlib bomb") == "refused"
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB while refusing a zlib bomb"


@pytest.mark.parametrize("count", [10**6, 10**12, 2**62])
def test_huge_declared_counts_are_refused_with_bounded_memory(target, count):
    """Chunk counts (and so column lengths) far beyond what the crc column can back."""
    doc = valid_doc(target)
    counts = _col(doc, "chunk_counts")
    counts[0] = count
    doc["tensors"]["chunk_counts"] = encode_int_column(counts)
    target.write_manifest(pack(doc))
    outcome, peak = _run_traced(target)
    assert check_refusals(outcome, f"{count} chunks") == "refused"
    assert peak < 64 << 20


def test_deeply_nested_structure_is_refused(target):
    doc = valid_doc(target)
    doc["structure"] = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    _expect_refused(target, pack(doc), "deep structure")
    doc = valid_doc(target)
    doc["metadata"] = b"\x81\xa1a" * 50_000 + b"\xc0"  # 50k nested maps
    _expect_refused(target, pack(doc), "deep metadata")


HUGE_LOAD = """
import json, sys
sys.path.insert(0, {repo!r})
import cloudckpt, torch

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) * 1024

cloudckpt.read_manifest  # import everything before measuring
import cloudckpt.api.load, cloudckpt.api.verify
results = {{}}
for url in sys.argv[1:]:
    out = results[url] = {{}}
    for name, fn in (("read_manifest", lambda: cloudckpt.read_manifest(url)),
                     ("load_full", lambda: cloudckpt.load_full(url)),
                     ("verify", lambda: cloudckpt.verify(url))):
        before = peak()
        try:
            result = fn()
            out[name] = {{"error": None, "ok": getattr(result, "ok", None)}}
        except BaseException as exc:
            out[name] = {{"error": [c.__name__ for c in type(exc).__mro__],
                          "message": str(exc)[:300]}}
        out[name]["vm_growth"] = peak() - before
print(json.dumps(results))
"""


def _declare(
    root, elements: int, *, dtype: str = "float32", block: int = 1 << 40, object_bytes: int = 4096
) -> None:
    """A self-consistent manifest at ``root`` declaring one ``elements``-long tensor ``w`` stored
    in a data object of only ``object_bytes`` bytes (checksum blocks of ``block`` bytes keep the
    crc list short)."""
    obj = root / "data" / ATTEMPT / "r00000-0000.bin"
    obj.parent.mkdir(parents=True)
    obj.write_bytes(b"\0" * object_bytes)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    b = ManifestBuilder(
        world_size=1, checksum_block_size=block, structure=["d", [["w", ["x", "w"]]]]
    )
    b.add_tensor("w", dtype, (elements,))
    b.add_chunk(
        "w",
        (0,),
        (elements,),
        f"data/{ATTEMPT}/r00000-0000.bin",
        0,
        itemsize * elements,
        [0] * max(1, math.ceil(itemsize * elements / block)),
    )
    (root / "manifest.msgpack").write_bytes(encode_manifest(b.build()))


def test_huge_declared_shapes_allocate_nothing(tmp_path, figures):
    """Manifests declaring 10**15 and 2**31 float32 elements stored in a 4 KiB object. Every
    entry point must refuse them (load_full with a ManifestError) and the process's peak virtual
    memory must not grow by anything like the declared size (measured in a fresh process, with
    at most two malloc arenas)."""
    roots = []
    for elements in (10**15, 2**31):
        roots.append(tmp_path / f"ckpt-{elements}")
        _declare(roots[-1], elements)
    script = tmp_path / "huge.py"
    script.write_text(HUGE_LOAD.format(repo=REPO))
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    res = subprocess.run(
        [sys.executable, str(script), *map(str, roots)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    for root, out in json.loads(res.stdout.strip().splitlines()[-1]).items():
        assert out["read_manifest"]["error"] is None, out  # the manifest itself is well-formed
        assert out["verify"]["ok"] is False, out  # verify compares object sizes
        assert out["load_full"]["error"] and "ManifestError" in out["load_full"]["error"], out
        for name, o in out.items():
            assert o["vm_growth"] < 2 << 30, (
                f"{root} {name}: VmPeak grew by {o['vm_growth'] / 2**30:.1f} GiB"
            )
        figures.add("hostile manifests (hand-made)")


def test_chunk_past_the_end_of_its_object_is_refused_before_reading(tmp_path):
    """A 4 MiB declared tensor in a 4 KiB object, loaded into a destination of the declared
    shape: refused with a ManifestError, the destination untouched."""
    root = tmp_path / "ckpt"
    _declare(root, 1 << 20, block=64 << 10)
    dest = {"w": torch.full((1 << 20,), 3.0)}
    with pytest.raises(errors.ManifestError):
        cloudckpt.load(dest, str(root))
    assert bool((dest["w"] == 3.0).all())
    with pytest.raises(errors.ManifestError):
        cloudckpt.load_full(str(root))


# -- pickle ---------------------------------------------------------------------------------------


class _Boom:
    """Unpickling this creates ``path`` (stands for running any code)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _pickled_blob(obj) -> bytes:
    import pickle

    return msgpack.packb(msgpack.ExtType(3, pickle.dumps(obj)), use_bin_type=True)


def test_pickled_values_need_the_loaders_opt_in(tmp_path, figures):
    url = str(tmp_path / "ckpt")
    cloudckpt.save({"w": torch.arange(4), "s": {1, 2, 3}}, url, allow_pickle=True)
    for name, fn in (
        ("read_manifest", lambda: cloudckpt.read_manifest(url)),
        ("load_full", lambda: cloudckpt.load_full(url)),
        ("load", lambda: cloudckpt.load({"w": torch.zeros(4, dtype=torch.int64), "s": None}, url)),
    ):
        with pytest.raises(errors.PickleNotAllowed) as refused:
            fn()
        assert "allow_pickle=True" in str(refused.value), (name, refused.value)
        figures.add("hostile manifests (hand-made)")
    full = cloudckpt.load_full(url, allow_pickle=True)
    assert full["s"] == {1, 2, 3} and torch.equal(full["w"], torch.arange(4))


@pytest.fixture
def booby_trapped(tmp_path):
    """Step 1 of a run, whose value ``trap`` unpickles into creating ``marker``."""
    url = tmp_path / "run" / "step-000000000001"
    marker = tmp_path / "marker"
    cloudckpt.save({"w": torch.arange(4), "trap": 1}, str(url))
    doc = doc_of((url / "manifest.msgpack").read_bytes())
    doc["values"]["trap"] = _pickled_blob(_Boom(str(marker)))
    (url / "manifest.msgpack").write_bytes(pack(doc))
    return url, marker


def test_code_in_a_pickled_value_never_runs_without_opt_in(booby_trapped, figures):
    url, marker = booby_trapped
    for fn in (
        lambda: cloudckpt.read_manifest(str(url)),
        lambda: cloudckpt.load_full(str(url)),
        lambda: cloudckpt.load({"w": torch.zeros(4, dtype=torch.int64), "trap": 0}, str(url)),
    ):
        with pytest.raises(errors.PickleNotAllowed):
            fn()
    assert not marker.exists()
    run = str(url.parent)
    for cmd in (
        ["show", run, "--step", "1"],
        ["ls", run],
        ["export", str(url), str(url.parent / "o.pt")],
    ):
        res = cli(None, *cmd)
        assert "Traceback" not in res.stderr, res.stderr
        assert not marker.exists(), f"cloudckpt {cmd[0]} ran the pickle"
        if cmd[0] == "export":
            assert res.returncode == 1 and "allow_pickle=True" in res.stderr, res.stderr
        else:
            assert res.returncode == 0, res.stderr
            assert cmd[0] == "ls" or "pickled" in res.stdout, res.stdout
    figures.add("hostile manifests (hand-made)")


@pytest.mark.parametrize("where", ["metadata", "structure"])
def test_pickle_in_metadata_or_structure_is_refused_even_with_opt_in(tmp_path, where):
    url = tmp_path / "ckpt"
    marker = tmp_path / "marker"
    cloudckpt.save({"w": torch.arange(4)}, str(url))
    doc = doc_of((url / "manifest.msgpack").read_bytes())
    doc[where] = _pickled_blob(_Boom(str(marker)))
    (url / "manifest.msgpack").write_bytes(pack(doc))
    for fn in (
        lambda: cloudckpt.read_manifest(str(url), allow_pickle=True),
        lambda: cloudckpt.load_full(str(url), allow_pickle=True),
    ):
        with pytest.raises(errors.ManifestError):
            fn()
    assert not marker.exists()


def test_verify_never_unpickles(booby_trapped):
    """``verify`` checks a checkpoint one may not trust yet: it must never unpickle."""
    url, marker = booby_trapped
    assert cloudckpt.verify(str(url)).ok
    res = cli(None, "verify", str(url))
    assert res.returncode == 0, res.stdout + res.stderr
    assert not marker.exists(), "verify ran the pickle"
