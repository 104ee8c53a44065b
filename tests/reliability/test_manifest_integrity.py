"""Manifest integrity and bounded decoding, end to end on real stores.

- The manifest cannot change silently: every single-bit flip of a saved manifest is refused with
  a ``ManifestError`` by ``read_manifest`` and by a strict ``load`` (which leaves its destination
  untouched); the same manifest in the old unchecksummed layout (version 1) is still read, and
  ``verify`` says it has no checksum.
- Reading an untrusted manifest costs in proportion to its size: chunks sharing bytes are
  refused (no 1 GiB tensor out of a 1 MiB object), decode memory is bounded by a constant factor
  of the manifest's size (tracemalloc, on the costliest manifests per byte that ``bloat.py``
  knows), shapes whose strides overflow int64 are refused even when empty, the command line
  answers odd manifests with one error line or a display, and a manifest's size is checked
  before it is read (a FIFO, a sparse 3 GiB file, an S3 object over the limit).
"""

from __future__ import annotations

import os
import tracemalloc

import msgpack
import numpy as np
import pytest
import torch

import cloudckpt
from cloudckpt.api.verify import UNCHECKSUMMED
from cloudckpt.checksum import block_crcs
from cloudckpt.errors import CheckpointNotFound, ManifestError
from cloudckpt.manifest.builder import ManifestBuilder
from cloudckpt.manifest.codec import MAX_MANIFEST_BYTES, decode_manifest, encode_manifest
from cloudckpt.manifest.columns import encode_int_column
from cloudckpt.manifest.framing import stored_version
from cloudckpt.manifest.values import encode_value
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.stored import fetch_manifest_bytes
from tests.reliability.bloat import FAMILIES
from tests.reliability.hostile import (
    check_refusals,
    doc_of,
    make_target,
    pack,
    run_entry_points,
    valid_doc,
)
from tests.reliability.stores import RawCheckpoint, cli

pytestmark = pytest.mark.timeout(600)

ATTEMPT = "0123456789abcdef"


def _small_state(blank: bool = False) -> dict:
    """The issue's example: a tensor and the values a flip changed (step, lr, name)."""
    if blank:
        return {"w": torch.full((6,), -1.0), "step": 0, "lr": 0.0, "name": ""}
    return {"w": torch.arange(6, dtype=torch.float32), "step": 1234, "lr": 1e-3, "name": "cosine"}


def _flipped(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


# -- the manifest cannot change silently ---------------------------------------------------------


def test_every_bit_flip_of_a_saved_manifest_is_refused(tmp_path, figures):
    url = str(tmp_path / "ckpt")
    cloudckpt.save(_small_state(), url)
    path = tmp_path / "ckpt" / "manifest.msgpack"
    raw = path.read_bytes()
    # a default save: version 2 with every chunk's hash (so flips of the hash column are here)
    assert stored_version(raw) == 2 and cloudckpt.read_manifest(url).chunk_hashes is not None
    for bit in range(8 * len(raw)):
        path.write_bytes(_flipped(raw, bit))
        with pytest.raises(ManifestError):
            cloudckpt.read_manifest(url)
        dest = _small_state(blank=True)
        with pytest.raises(ManifestError):
            cloudckpt.load(dest, url)
        assert dest["step"] == 0 and dest["name"] == "" and bool((dest["w"] == -1).all()), bit
        figures.add("manifest bit flips refused (v2, read_manifest and strict load)")
    path.write_bytes(raw)
    assert cloudckpt.load_full(url)["step"] == 1234

    # The detector detects: the same manifest in the old layout (no checksum) changes silently
    # under some flips, as the issue reported (step 1234 -> 1490, "cosine" -> "bosine", ...).
    v1 = encode_manifest(decode_manifest(raw), format_version=1)
    silent = 0
    for bit in range(8 * len(v1)):
        try:
            decoded = decode_manifest(_flipped(v1, bit))
        except ManifestError:
            continue
        silent += encode_manifest(decoded, format_version=1) != v1
    figures.add("manifest bit flips changing it silently (same manifest as v1)", silent)
    figures.add("manifest bit flips tried (same manifest as v1)", 8 * len(v1))
    assert silent > 0


def test_verify_notes_a_manifest_without_checksum(tmp_path):
    url = str(tmp_path / "ckpt")
    cloudckpt.save(_small_state(), url)
    report = cloudckpt.verify(url)
    assert report.ok and report.notes == []
    path = tmp_path / "ckpt" / "manifest.msgpack"
    path.write_bytes(encode_manifest(cloudckpt.read_manifest(url), format_version=1))
    report = cloudckpt.verify(url)
    assert report.ok and report.notes == [UNCHECKSUMMED]  # a warning, not a failure
    assert cloudckpt.load_full(url)["name"] == "cosine"  # version 1 still loads
    res = cli(None, "verify", url)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("OK") and "note: the manifest has no checksum" in res.stdout


# -- chunks sharing bytes -------------------------------------------------------------------------


def _aliasing_manifest(chunks: int, data: bytes) -> bytes:
    """One uint8 tensor of ``chunks * len(data)`` elements whose chunks all hold the same
    ``len(data)`` bytes of one object, with their true crcs: a load would "work"."""
    n = len(data)
    crcs = block_crcs(data, n)
    b = ManifestBuilder(
        world_size=1, checksum_block_size=n, structure=["d", [["big", ["x", "big"]]]]
    )
    b.add_tensor("big", "uint8", (n,))
    b.add_chunk("big", (0,), (n,), f"data/{ATTEMPT}/r00000-0000.bin", 0, n, crcs)
    doc = doc_of(encode_manifest(b.build()))
    doc["tensors"]["shapes"] = encode_int_column([chunks * n])
    doc["tensors"]["chunk_counts"] = encode_int_column([chunks])
    doc["chunks"].update(
        offsets=encode_int_column(np.arange(chunks) * n, delta=True),
        sizes=encode_int_column([n] * chunks, delta=True),
        object_index=encode_int_column([0] * chunks, delta=True),
        byte_offset=encode_int_column([0] * chunks, delta=True),
        byte_length=encode_int_column([n] * chunks, delta=True),
        crc32c=b"".join(int(c).to_bytes(4, "little") for c in crcs) * chunks,
    )
    return pack(doc)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_chunks_sharing_bytes_are_refused_everywhere(tmp_path, backend, request, figures):
    """1024 chunks aliasing one 1 MiB object: a 1 GiB tensor from a ~5 KB manifest, before."""
    data = os.urandom(1 << 20)
    manifest = _aliasing_manifest(1024, data)
    assert len(manifest) < 8 << 10
    if backend == "local":
        url, storage, raw = str(tmp_path / "ckpt"), None, RawCheckpoint(str(tmp_path / "ckpt"))
    else:
        server = request.getfixturevalue("s3_server")
        storage = request.getfixturevalue("storage")
        url = server.url(f"alias-{os.getpid()}-{tmp_path.name}")
        raw = RawCheckpoint(url, server)
    raw.write(f"data/{ATTEMPT}/r00000-0000.bin", data)
    raw.write("manifest.msgpack", manifest)
    for name, fn in (
        ("read_manifest", lambda: cloudckpt.read_manifest(url, storage=storage)),
        ("load_full", lambda: cloudckpt.load_full(url, storage=storage)),
        ("verify", lambda: cloudckpt.verify(url, storage=storage)),
    ):
        with pytest.raises(ManifestError, match=r"chunks\[1\].*also those of") as exc:
            fn()
        assert "data/" in str(exc.value), name
        figures.add("hostile manifests (integrity)")
    if backend == "local":
        out = tmp_path / "big.safetensors"
        for args in (("export", url, str(out)), ("verify", url), ("show", url)):
            res = cli(None, *args)
            assert (
                res.returncode == 1 and "error: " in res.stderr and "also those of" in res.stderr
            ), (args, res.stderr)
            assert "internal error" not in res.stderr
        assert not out.exists() and not (tmp_path / "big.safetensors.partial").exists()
        # nor a temporary entry of the one local atomic write (storage/local/files.temp_name)
        assert not [n for n in os.listdir(tmp_path) if ".cloudckpt-tmp-" in n]


# -- bounded decoding -----------------------------------------------------------------------------

#: Decode peak allowed per manifest byte, plus a constant. The floor of any decoder that builds
#: the values: an empty msgpack dict is 1 byte and 64 bytes of Python object, and a reference.
BYTES_PER_BYTE = 80
SLACK = 8 << 20


def _traced_read(url: str):
    tracemalloc.start()
    try:
        try:
            cloudckpt.read_manifest(url)
            outcome = "decoded"
        except ManifestError as exc:
            outcome = f"refused: {exc}"
        return outcome, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


CASES = [(name, 400_000) for name in FAMILIES] + [
    ("empty_chunks_64d", 4_000_000),
    ("empty_chunks_8d", 4_000_000),
    ("empty_tensors", 4_000_000),
]


@pytest.mark.parametrize("family,size", CASES, ids=[f"{n}-{s // 1000}KB" for n, s in CASES])
def test_decode_memory_is_bounded_by_the_manifest_size(tmp_path, family, size, figures):
    """read_manifest on a LocalStore: traced peak <= 80 bytes per manifest byte + 8 MiB, for the
    costliest manifests per byte known (``bloat.py``). Before: the 0.4 MB 64-dimension case
    peaked at 584 MB (1413 bytes per byte), the 4 MB one ran out of memory."""
    make, decodes = FAMILIES[family]
    data = make(size)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "manifest.msgpack").write_bytes(data)
    outcome, peak = _traced_read(str(tmp_path / "ckpt"))
    assert (outcome == "decoded") == decodes, outcome
    print(
        f"\n{family}: {len(data)} bytes, peak {peak / 2**20:.1f} MiB "
        f"({peak / len(data):.1f} per byte), {outcome[:60]}"
    )
    assert peak <= BYTES_PER_BYTE * len(data) + SLACK, (
        f"{family}: peak {peak / 2**20:.0f} MiB for {len(data)} bytes"
    )
    figures.add("hostile manifests (bounded decoding)")


def test_shapes_overflowing_int64_are_refused_even_when_empty(tmp_path, figures):
    """A chunkless tensor of shape (0, 2**40, 2**40): no element, strides of 2**80 bytes."""
    target = make_target(str(tmp_path / "ckpt"), area=tmp_path)
    for shape in ((0, 2**40, 2**40), (2**40, 0, 2**40), (0,) * 3 + (2**31,) * 2):
        doc = valid_doc(target)
        tensors = doc["tensors"]
        tensors["names"].append("empty")
        tensors["dtypes"].append("float32")
        for key, extra in (("ndims", [len(shape)]), ("shapes", list(shape)), ("chunk_counts", [0])):
            tensors[key] = encode_int_column(list(_values(tensors[key])) + extra)
        target.write_manifest(pack(doc))
        outcome = run_entry_points(target)
        assert check_refusals(outcome, f"shape {shape}") == "refused"
        assert "too large" in str(outcome.errors["read_manifest"])
        figures.add("hostile manifests (integrity)")
    # just inside the limit: accepted, and torch makes the tensor
    doc = valid_doc(target)
    doc["tensors"]["names"].append("empty")
    doc["tensors"]["dtypes"].append("uint8")
    for key, extra in (("ndims", [3]), ("shapes", [0, 2**30, 2**30]), ("chunk_counts", [0])):
        doc["tensors"][key] = encode_int_column(list(_values(doc["tensors"][key])) + extra)
    target.write_manifest(pack(doc))
    assert cloudckpt.read_manifest(target.url).tensors["empty"].shape == (0, 2**30, 2**30)
    assert torch.empty((0, 2**30, 2**30), dtype=torch.uint8).numel() == 0


def _values(column):
    from cloudckpt.manifest.columns import decode_int_column

    return decode_int_column(column).tolist()


# -- the command line on odd manifests -----------------------------------------------------------


def _deep(depth: int):
    value = None
    for _ in range(depth):
        value = [value]
    return value


def _odd_manifests():
    """name -> (edit of the document, what ``show`` must do: 'error' or a text it displays)."""

    def value(name, v):
        return lambda doc: doc["values"].__setitem__(name, msgpack.packb(v, use_bin_type=True))

    def drop_values_pickle_metadata(doc):
        del doc["values"]
        doc["metadata"] = msgpack.packb(msgpack.ExtType(3, b"\x80\x04N."), use_bin_type=True)

    return {
        "deep value": (value("name", _deep(500)), "error"),
        "deep metadata": (
            lambda doc: doc.__setitem__(
                "metadata", msgpack.packb({"a": _deep(500)}, use_bin_type=True)
            ),
            "error",
        ),
        "pickled metadata, no values": (drop_values_pickle_metadata, "error"),
        "bytes value name": (
            lambda doc: doc["values"].__setitem__(b"raw", doc["values"]["lr"]),
            "error",
        ),
        "int tensor name": (lambda doc: doc["tensors"]["names"].__setitem__(0, 7), "error"),
        "created_at 1e300": (lambda doc: doc.__setitem__("created_at", 1e300), "1e+300"),
        "created_at -1e18": (lambda doc: doc.__setitem__("created_at", -1e18), "-1e+18"),
        "value 2**20000": (
            lambda doc: doc["values"].__setitem__(
                "step", encode_value(2**20000, key="step", allow_pickle=False)
            ),
            "<int of 20001 bits>",
        ),
        "list holding 2**20000": (
            lambda doc: doc["values"].__setitem__(
                "step", encode_value([2**20000], key="step", allow_pickle=False)
            ),
            "[<int of 20001 bits>]",
        ),
        "metadata 2**20000, tuple key": (
            lambda doc: doc.__setitem__(
                "metadata", encode_value({"n": 2**20000, (1, 2): "t"}, key="m", allow_pickle=False)
            ),
            "int of 20001 bits",
        ),
    }


ODD = _odd_manifests()


@pytest.mark.parametrize("case", list(ODD))
def test_show_ls_verify_answer_odd_manifests_without_internal_errors(tmp_path, case, figures):
    edit, expect = ODD[case]
    run = tmp_path / "run"
    url = str(run / "step-000000000001")
    cloudckpt.save(_small_state(), url)
    path = run / "step-000000000001" / "manifest.msgpack"
    doc = doc_of(path.read_bytes())
    edit(doc)
    path.write_bytes(pack(doc))
    try:
        cloudckpt.read_manifest(url)
        api_error = None
    except ManifestError as exc:
        api_error = exc
    assert (api_error is not None) == (expect == "error"), api_error
    for args in (("show", url), ("verify", url), ("ls", str(run))):
        res = cli(None, *args)
        where = f"{case}: cloudckpt {' '.join(args)}: {res.stderr}"
        assert "internal error" not in res.stderr and "Traceback" not in res.stderr, where
        if expect == "error" and args[0] != "ls":
            assert res.returncode == 1 and res.stderr.count("\n") == 1, where
            assert res.stderr.startswith(f"cloudckpt {args[0]}: error: "), where
        elif args[0] == "ls" and expect == "error":
            assert res.returncode in (0, 1), where
        else:
            assert res.returncode == 0, where
            if args[0] == "show":
                assert expect in res.stdout, res.stdout
    figures.add("hostile manifests (command line)")


# -- the size is checked before reading ------------------------------------------------------------


def test_a_manifest_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    url = str(tmp_path / "ckpt")
    cloudckpt.save(_small_state(), url)
    path = tmp_path / "ckpt" / "manifest.msgpack"
    path.unlink()
    os.mkfifo(path)
    res = cli(None, "show", url)  # a blocking open would hang here until the timeout
    assert res.returncode == 1 and "error: " in res.stderr, res.stderr
    with pytest.raises(CheckpointNotFound):
        cloudckpt.read_manifest(url)
    with pytest.raises(CheckpointNotFound):
        cloudckpt.verify(url)


def test_a_huge_sparse_manifest_is_refused_before_reading(tmp_path):
    url = str(tmp_path / "ckpt")
    cloudckpt.save(_small_state(), url)
    with open(tmp_path / "ckpt" / "manifest.msgpack", "r+b") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB of zeros on no disk
    for fn in (
        lambda: cloudckpt.read_manifest(url),
        lambda: cloudckpt.load_full(url),
        lambda: cloudckpt.verify(url),
    ):
        tracemalloc.start()
        try:
            with pytest.raises(ManifestError, match="more than the 2147483648"):
                fn()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, f"peak {peak / 2**20:.0f} MiB refusing a 3 GiB manifest"
    res = cli(None, "show", url)
    assert res.returncode == 1 and "refused without reading it" in res.stderr, res.stderr


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_the_limit_is_checked_before_the_body_is_read(tmp_path, backend, request):
    """fetch_manifest_bytes (every manifest reader uses it) with a limit under the object's
    size: refused, and not one body byte received; at the limit: read."""
    if backend == "local":
        store = shared_store(str(tmp_path / "ckpt"), None)
        raw = RawCheckpoint(str(tmp_path / "ckpt"))
    else:
        server = request.getfixturevalue("s3_server")
        url = server.url(f"limit-{os.getpid()}-{tmp_path.name}")
        store = shared_store(url, request.getfixturevalue("storage"))
        raw = RawCheckpoint(url, server)
    body = os.urandom(1 << 20)
    raw.write("manifest.msgpack", body)
    store.stats.reset()
    with pytest.raises(ManifestError, match="refused without reading it"):
        run_coroutine(fetch_manifest_bytes(store, max_bytes=(1 << 20) - 1))
    assert store.stats.bytes_received == 0
    assert run_coroutine(fetch_manifest_bytes(store, max_bytes=1 << 20)) == body
    assert MAX_MANIFEST_BYTES == 1 << 31
