"""One conformance suite for every ObjectStore backend: LocalStore, and S3Store on two S3
implementations (SeaweedFS and moto's server mode). The two tests that move the most data run on
moto only in the long mode (``slow``: see conftest.py); moto's batched delete is covered by
tests/storage/test_s3_compat.py with small batches."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.checksum import crc32c
from cloudckpt.errors import (
    ChecksumError,
    ConfigError,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    StorageError,
)
from cloudckpt.storage import CommonPrefix, ObjectInfo, ObjectStore, ReadRange, S3Store, open_store

MiB = 1024 * 1024


def test_put_get_head_roundtrip(backend):
    async def body(store):
        data = os.urandom(100_000)
        info = await store.put("a/b/c.bin", data)
        assert info.key == "a/b/c.bin" and info.size == len(data)
        assert await store.get("a/b/c.bin") == data
        head = await store.head("a/b/c.bin")
        assert head.size == len(data) and head.key == "a/b/c.bin"
        # every bytes-like body, and segments concatenated
        arr = np.arange(1000, dtype=np.float32)
        await store.put("np", arr)
        assert await store.get("np") == arr.tobytes()
        await store.put("segs", [b"ab", bytearray(b"cd"), memoryview(b"xxefxx")[2:4], arr[:2]])
        assert await store.get("segs") == b"abcdef" + arr[:2].tobytes()
        await store.put("empty", b"")
        assert await store.get("empty") == b""
        assert (await store.head("empty")).size == 0
        await store.put("a/b/c.bin", b"new")  # overwrite
        assert await store.get("a/b/c.bin") == b"new"

    backend.run(body)


def test_missing_and_bad_keys(backend):
    async def body(store):
        for call in (
            store.get("nope"),
            store.head("nope"),
            store.read_ranges("nope", [ReadRange(0, 1)]),
        ):
            with pytest.raises(ObjectNotFound) as info:
                await call
            assert isinstance(info.value, FileNotFoundError)
        for bad in ("", "/abs", "a/../b", "a//b", "./a", "dir/"):
            with pytest.raises(ConfigError):
                await store.put(bad, b"x")

    backend.run(body)


def test_read_ranges_coalesced_and_concurrent(backend):
    async def body(store):
        data = os.urandom(3 * MiB)
        await store.put("obj", data)
        before = store.stats.requests.get("get", 0)
        out = bytearray(4096)
        ranges = [
            ReadRange(0, 1000),  # \
            ReadRange(5000, 4096, out=memoryview(out)),  #  } one GET (gaps < 1 MiB)
            ReadRange(20_000, 10, crc32c=crc32c(data[20_000:20_010])),  # /
            ReadRange(2 * MiB + 100, 500),  # far: a second GET
            ReadRange(42, 0),  # empty: no request
            ReadRange(10, 20),  # overlaps the first
        ]
        views = await store.read_ranges("obj", ranges)
        assert [bytes(v) for v in views] == [data[r.offset : r.offset + r.length] for r in ranges]
        assert views[1].obj is out or bytes(out) == data[5000:9096]
        assert bytes(out) == data[5000:9096]
        assert store.stats.requests["get"] - before == 2
        # a small coalesce gap splits them
        assert all(isinstance(v, memoryview) for v in views)

    backend.run(body)
    backend.run(lambda store: _split_reads(store), coalesce_gap=0)


async def _split_reads(store):
    data = os.urandom(200_000)
    await store.put("obj2", data)
    before = store.stats.requests.get("get", 0)
    ranges = [ReadRange(0, 10), ReadRange(100, 10), ReadRange(1000, 10)]
    views = await store.read_ranges("obj2", ranges)
    assert [bytes(v) for v in views] == [data[0:10], data[100:110], data[1000:1010]]
    assert store.stats.requests["get"] - before == 3


def test_read_range_errors(backend):
    async def body(store):
        data = os.urandom(10_000)
        await store.put("obj", data)
        with pytest.raises(InvalidRange):
            await store.read_ranges("obj", [ReadRange(9_000, 2_000)])
        with pytest.raises(InvalidRange):
            await store.read_ranges("obj", [ReadRange(20_000, 10)])
        with pytest.raises(ConfigError):
            await store.read_ranges("obj", [ReadRange(0, 10, out=memoryview(bytearray(9)))])
        with pytest.raises(ChecksumError) as err:
            await store.read_ranges("obj", [ReadRange(100, 50, crc32c=crc32c(data[100:150]) ^ 1)])
        assert err.value.key == "obj" and (err.value.offset, err.value.length) == (100, 50)
        assert "obj" in str(err.value) and "[100, 150)" in str(err.value)

    backend.run(body)


def test_sinks_receive_verified_bytes(backend):
    data = os.urandom(3 * MiB + 123)
    blocks = [(o, min(MiB, len(data) - o)) for o in range(0, len(data), MiB)]

    async def body(store):
        await store.put("obj", data)
        dest_a = bytearray(len(data))
        dest_b = bytearray(b"\xee" * 1000)
        ranges = [
            ReadRange(
                o, n, crc32c=crc32c(data[o : o + n]), sinks=((0, memoryview(dest_a)[o : o + n]),)
            )
            for o, n in blocks
        ]
        # a second sink taking only part of the second block (bytes 10..1010 of it)
        ranges[1] = ReadRange(
            ranges[1].offset,
            ranges[1].length,
            crc32c=ranges[1].crc32c,
            sinks=ranges[1].sinks + ((10, memoryview(dest_b)),),
        )
        views = await store.read_ranges("obj", ranges)
        assert [len(v) for v in views] == [0] * len(ranges)
        assert bytes(dest_a) == data
        assert bytes(dest_b) == data[MiB + 10 : MiB + 1010]
        with pytest.raises(ConfigError):  # sinks need a crc to verify against
            await store.read_ranges(
                "obj", [ReadRange(0, 10, sinks=((0, memoryview(dest_b)[:10]),))]
            )
        with pytest.raises(ConfigError):  # a sink must lie inside its range
            await store.read_ranges(
                "obj",
                [ReadRange(0, 10, crc32c=crc32c(data[:10]), sinks=((5, memoryview(dest_b)[:10]),))],
            )

    backend.run(body)


def test_sinks_of_a_corrupt_block_keep_their_contents(backend):
    data = os.urandom(2 * MiB)
    blocks = [(o, min(MiB, len(data) - o)) for o in range(0, len(data), MiB)]
    backend.run(lambda store: store.put("ckpt/sinks.bin", data))
    backend.flip_byte("ckpt/sinks.bin", MiB + 777)

    async def body(store):
        dest = bytearray(b"\x5a" * len(data))
        ranges = [
            ReadRange(
                o, n, crc32c=crc32c(data[o : o + n]), sinks=((0, memoryview(dest)[o : o + n]),)
            )
            for o, n in blocks
        ]
        with pytest.raises(ChecksumError) as err:
            await store.read_ranges("ckpt/sinks.bin", ranges)
        assert (err.value.offset, err.value.length) == (MiB, MiB)
        assert bytes(dest[MiB:]) == b"\x5a" * MiB  # nothing of the bad block was written

    backend.run(body)


def test_flipped_byte_is_a_checksum_error(backend):
    data = os.urandom(2 * MiB)
    blocks = [(o, min(MiB, len(data) - o)) for o in range(0, len(data), MiB)]
    crcs = [crc32c(data[o : o + n]) for o, n in blocks]
    backend.run(lambda store: store.put("ckpt/data.bin", data))
    backend.flip_byte("ckpt/data.bin", MiB + 12345)

    async def body(store):
        ranges = [ReadRange(o, n, crc32c=c) for (o, n), c in zip(blocks, crcs)]
        with pytest.raises(ChecksumError) as err:
            await store.read_ranges("ckpt/data.bin", ranges)
        assert (err.value.key, err.value.offset, err.value.length) == ("ckpt/data.bin", MiB, MiB)
        # the intact block still reads and verifies
        views = await store.read_ranges("ckpt/data.bin", ranges[:1])
        assert bytes(views[0]) == data[:MiB]

    backend.run(body)


def _two_blocks(data: bytes, into: str):
    """Ranges of the two 1 MiB blocks of ``data`` (crc-checked) into ``out`` buffers or sinks,
    and the destinations they fill."""
    dest = [bytearray(b"\x5a" * MiB) for _ in range(2)]
    ranges = []
    for i, d in enumerate(dest):
        crc = crc32c(data[i * MiB : (i + 1) * MiB])
        ranges.append(
            ReadRange(i * MiB, MiB, crc32c=crc, out=memoryview(d))
            if into == "out"
            else ReadRange(i * MiB, MiB, crc32c=crc, sinks=((0, memoryview(d)),))
        )
    return ranges, dest


@pytest.mark.parametrize("into", ["out", "sinks"])
def test_a_block_failing_verification_is_read_once_more(backend, into):
    """Both backends: a block that fails verification is read again, alone, once; a damage that
    is gone on the second read (here the stored byte is repaired in between) costs nothing
    more; a damage that stays raises ChecksumError after that one re-read."""
    data = os.urandom(2 * MiB)
    backend.run(lambda store: store.put("ckpt/heal.bin", data))

    async def read(store, repair: bool):
        ranges, dest = _two_blocks(data, into)
        fetch = store._fetch_into if backend.kind == "local" else store._reader._fetch_into
        calls = []

        async def fetch_then_repair(*args, **kwargs):
            await fetch(*args, **kwargs)
            calls.append(args[2:4])  # (offsets, lengths)
            if repair and len(calls) == 1:
                await asyncio.to_thread(backend.flip_byte, "ckpt/heal.bin", MiB + 777)

        if backend.kind == "local":
            store._fetch_into = fetch_then_repair
        else:
            store._reader._fetch_into = fetch_then_repair
        store.stats.reset()
        try:
            await store.read_ranges("ckpt/heal.bin", ranges)
            error = None
        except ChecksumError as exc:
            error = exc
        return error, dest, calls, store.stats.requests.get("get")

    backend.flip_byte("ckpt/heal.bin", MiB + 777)
    error, dest, calls, gets = backend.run(lambda store: read(store, repair=True))
    assert error is None and bytes(dest[0]) + bytes(dest[1]) == data
    assert calls == [([0, MiB], [MiB, MiB]), ([MiB], [MiB])] and gets == 2

    backend.flip_byte("ckpt/heal.bin", MiB + 777)  # damaged again, for good this time
    error, dest, calls, gets = backend.run(lambda store: read(store, repair=False))
    assert isinstance(error, ChecksumError) and (error.offset, error.length) == (MiB, MiB)
    assert calls == [([0, MiB], [MiB, MiB]), ([MiB], [MiB])] and gets == 2
    assert bytes(dest[0]) == data[:MiB]
    if into == "sinks":
        assert bytes(dest[1]) == b"\x5a" * MiB  # neither read wrote the damaged block


def test_a_block_damaged_in_transit_is_read_again(s3_server, s3_url, fault_proxy):
    """S3 over a real HTTP hop: the first GET's body arrives with one bit flipped (the fault
    proxy), verification fails, the re-read of that block is clean: the read succeeds."""
    from tests.storage.conftest import s3_options

    data = os.urandom(2 * MiB)
    options = s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url)

    async def body(store):
        await store.put("t.bin", data)
        for into in ("out", "sinks"):
            ranges, dest = _two_blocks(data, into)
            store.stats.reset()
            fault_proxy.configure(schedule=["flip"])  # the next request: the first GET
            await store.read_ranges("t.bin", ranges)
            assert bytes(dest[0]) + bytes(dest[1]) == data
            assert store.stats.requests["get"] == 2  # the whole object, then the bad block

    async def main():
        store = open_store(s3_url, options)
        try:
            await body(store)
        finally:
            await store.close()

    asyncio.run(main())
    assert fault_proxy.counters["flip"] == 2


def test_list_paginates_past_1000_and_batched_delete(backend):
    keys = sorted(
        [f"many/k{i:05d}" for i in range(1050)]
        + ["many/sub/x", "many/sub/y/z", "many/run/data/a", "other"]
    )

    async def body(store):
        sem = asyncio.Semaphore(32)

        async def put(k):
            async with sem:
                await store.put(k, k.encode())

        await asyncio.gather(*(put(k) for k in keys))
        listed = [x async for x in store.list("many/")]
        assert all(isinstance(x, ObjectInfo) for x in listed)
        assert [x.key for x in listed] == [k for k in keys if k.startswith("many/")]
        assert listed[0].size == len(listed[0].key)
        everything = [x.key async for x in store.list()]
        assert everything == keys
        rolled = [x async for x in store.list("many/", delimiter="/")]
        assert [x.prefix for x in rolled if isinstance(x, CommonPrefix)] == [
            "many/run/",
            "many/sub/",
        ]
        assert len([x for x in rolled if isinstance(x, ObjectInfo)]) == 1050
        top = [x async for x in store.list("", delimiter="/")]
        assert top == [CommonPrefix("many/"), top[1]] and top[1].key == "other"
        multi = [x async for x in store.list("many/", delimiter="/data/")]
        assert CommonPrefix("many/run/data/") in multi
        assert [x async for x in store.list("many/k0000", delimiter="/")][0].key == "many/k00000"
        before = dict(store.stats.requests)
        await store.delete(keys + ["never/existed"])
        if isinstance(store, S3Store):
            assert store.stats.requests["delete"] - before.get("delete", 0) == 2  # 1000 + rest
        assert [x async for x in store.list()] == []
        await store.delete([])

    backend.run(body)


def test_create_mode_race_has_one_winner(backend):
    async def body(store):
        bodies = [bytes([i]) * 1000 for i in range(8)]
        results = await asyncio.gather(
            *(store.put("manifest", b, mode="create") for b in bodies), return_exceptions=True
        )
        winners = [i for i, r in enumerate(results) if isinstance(r, ObjectInfo)]
        assert len(winners) == 1, results
        assert all(isinstance(r, ObjectExists) for r in results if not isinstance(r, ObjectInfo))
        assert all(isinstance(r, FileExistsError) for r in results if isinstance(r, Exception))
        assert await store.get("manifest") == bodies[winners[0]]
        with pytest.raises(ObjectExists):
            await store.put("manifest", b"late", mode="create")
        assert await store.get("manifest") == bodies[winners[0]]

    backend.run(body)


def test_two_creates_race_exactly_one_wins(backend):
    async def body(store):
        a, b = os.urandom(5000), os.urandom(5000)
        results = await asyncio.gather(
            store.put("m", a, mode="create"),
            store.put("m", b, mode="create"),
            return_exceptions=True,
        )
        assert sorted(type(r).__name__ for r in results) == ["ObjectExists", "ObjectInfo"]

    backend.run(body)


def test_multipart_200_mib(backend):
    data = np.random.default_rng(0).integers(0, 256, 200 * MiB, dtype=np.uint8)

    async def body(store):
        info = await store.put("big/object.bin", data)
        assert info.size == data.nbytes
        if isinstance(store, S3Store):
            assert store.stats.requests["upload_part"] >= 13  # 16 MiB parts
            assert store.stats.requests["complete_multipart"] == 1
        assert (await store.head("big/object.bin")).size == data.nbytes
        back = np.empty_like(data)
        views = await store.read_ranges(
            "big/object.bin", [ReadRange(0, data.nbytes, out=memoryview(back), crc32c=crc32c(data))]
        )
        assert views[0].nbytes == data.nbytes
        assert np.array_equal(back, data)
        assert await store.list_uploads() == []

    backend.run(body)


def test_create_mode_above_the_multipart_threshold(backend):
    """A create larger than the multipart threshold is still exclusive; on S3 it is one
    PutObject (If-None-Match on CompleteMultipartUpload does not hold under a race everywhere)."""
    data = os.urandom(20 * MiB)

    async def body(store):
        await store.put("mp-create", data, mode="create")
        with pytest.raises(ObjectExists):
            await store.put("mp-create", data, mode="create")
        assert await store.get("mp-create") == data
        assert await store.list_uploads() == []
        if isinstance(store, S3Store):
            assert store.connection.create_strategy == "native"
            assert "create_multipart" not in store.stats.requests
            assert store.stats.requests["put"] >= 2

    backend.run(body, multipart_threshold=8 * MiB)


def test_unfinished_uploads_listed_and_aborted(backend):
    backend.start_unfinished_upload("ckpt/part.bin")
    backend.start_unfinished_upload("other/thing.bin")

    async def body(store):
        uploads = await store.list_uploads("ckpt/")
        assert [u.key for u in uploads] == ["ckpt/part.bin"]
        assert [x async for x in store.list()] == []  # never visible as objects
        await store.abort_upload(uploads[0])
        await store.abort_upload(uploads[0])  # already gone: fine
        assert await store.list_uploads("ckpt/") == []
        assert [u.key for u in await store.list_uploads()] == ["other/thing.bin"]
        with pytest.raises(ObjectNotFound):
            await store.head("ckpt/part.bin")

    backend.run(body)


def test_child_stores_share_stats_and_nest_keys(backend):
    async def body(store):
        run = store.child("run")
        step = run.child("step-000000000001/")
        await step.put("manifest.msgpack", b"m")
        assert await store.get("run/step-000000000001/manifest.msgpack") == b"m"
        assert [x.prefix async for x in run.list(delimiter="/")] == ["step-000000000001/"]
        assert [x.key async for x in step.list()] == ["manifest.msgpack"]
        assert step.url.endswith("/run/step-000000000001")
        assert step.stats is store.stats and store.stats.requests["put"] >= 1
        await step.close()  # a child's close leaves the shared connection open
        assert await run.get("step-000000000001/manifest.msgpack") == b"m"

    backend.run(body)


def test_capabilities_say_what_the_store_is(backend):
    store = backend.open()
    child = store.child("run/step")
    assert isinstance(store, ObjectStore) and isinstance(child, ObjectStore)
    if backend.kind == "local":
        assert store.remote is False and child.remote is False
        assert store.local_root == os.path.abspath(backend.url)
        assert child.local_root == os.path.join(os.path.abspath(backend.url), "run", "step")
    else:
        assert store.remote is True and child.remote is True
        assert store.local_root is None and child.local_root is None


# --- streams (open_writer) ----------------------------------------------------------------------

STREAM = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "concurrency": 3}
STREAM_DATA = np.random.default_rng(7).integers(0, 256, 13 * MiB, dtype=np.uint8)


async def _stream(store, key, data, sizes, *, mode="overwrite", size_hint=None):
    """Write ``data`` through a stream in pieces of ``sizes`` (cycled), then commit."""
    w = store.open_writer(key, mode=mode, size_hint=size_hint)
    pos, i = 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        await w.write(data[pos : pos + n])
        pos, i = pos + n, i + 1
    assert w.size == len(data)
    return await w.commit()


def _sent_parts(store) -> int:
    return store.stats.requests.get("upload_part", 0) if isinstance(store, S3Store) else 0


def test_a_stream_stores_what_was_written(backend):
    """Sizes 0, 1, below the threshold, exactly one part, several parts in uneven writes (a
    numpy array, bytes, lists of buffers), with and without a size hint."""
    part = STREAM["part_size"]
    data = memoryview(STREAM_DATA)
    cases = [
        ("empty", 0, [1], None),
        ("one", 1, [1], 1),
        ("small", 100_000, [7, 65_536], None),
        ("part", part, [MiB], part),
        ("part+1, low hint", part + 1, [part, 1], 1000),
        ("parts", 2 * part + 12_345, [3 * MiB + 1, 17, 2 * MiB], None),
        ("high hint", 3 * MiB, [MiB], 12 * MiB),
    ]

    async def body(store):
        for name, size, sizes, hint in cases:
            parts_before = _sent_parts(store)
            info = await _stream(store, f"s/{name}", data[:size], sizes, size_hint=hint)
            assert info.size == size and info.key == f"s/{name}" and info.etag, name
            assert await store.get(f"s/{name}") == data[:size], name
            assert (await store.head(f"s/{name}")).size == size, name
            if isinstance(store, S3Store):  # one PutObject while it fits one part
                assert (_sent_parts(store) > parts_before) == (size > part), name
        w = store.open_writer("s/list")
        await w.write([b"ab", bytearray(b"cd"), np.arange(3, dtype=np.uint16)])
        await w.write(memoryview(b"xyz")[1:])
        await w.commit()
        assert (
            await store.get("s/list") == b"abcd" + np.arange(3, dtype=np.uint16).tobytes() + b"yz"
        )
        await store.put("s/old", b"old")  # overwrite mode replaces
        await _stream(store, "s/old", data[:1000], [300])
        assert await store.get("s/old") == data[:1000]
        assert await store.list_uploads() == []

    backend.run(body, **STREAM)


@pytest.mark.parametrize("backend", ["local", "s3"], indirect=True)
@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(1, 3 * MiB), min_size=1, max_size=8),
    total=st.integers(0, 12 * MiB),
    hint=st.sampled_from([None, "exact", "low"]),
    mode=st.sampled_from(["overwrite", "create"]),
)
def test_any_sequence_of_writes_is_stored_exactly(backend, sizes, total, hint, mode):
    data = memoryview(STREAM_DATA)[:total]
    size_hint = {None: None, "exact": total, "low": total // 3}[hint]
    key = f"h/{os.urandom(4).hex()}"

    async def body(store):
        info = await _stream(store, key, data, sizes, mode=mode, size_hint=size_hint)
        assert info.size == total
        got = np.empty(total, dtype=np.uint8)
        if total:
            await store.read_ranges(key, [ReadRange(0, total, out=memoryview(got))])
        assert np.array_equal(got, STREAM_DATA[:total])
        assert await store.list_uploads("h/") == []

    backend.run(body, **STREAM)


def test_a_create_stream_never_writes_over_an_object(backend):
    """An existing key: ``ObjectExists`` (at the commit of a short stream, at the first part of
    a long one), the object untouched, nothing left behind."""
    data = memoryview(STREAM_DATA)[: 12 * MiB]

    async def body(store):
        for size in (10, 12 * MiB):
            key = f"c/{size}"
            await store.put(key, b"theirs")
            with pytest.raises(ObjectExists) as err:
                await _stream(store, key, data[:size], [MiB], mode="create")
            assert isinstance(err.value, FileExistsError)
            assert await store.get(key) == b"theirs"
        w = store.open_writer("c/new", mode="create")
        await w.write(data)  # claims the key and sends parts
        await store.put("c/new", b"first", mode="create")  # lands while the stream streams
        with pytest.raises(ObjectExists):
            await w.commit()
        assert await store.get("c/new") == b"first"
        with pytest.raises(StorageError, match="aborted"):
            await w.write(b"more")
        assert await store.list_uploads() == []

    backend.run(body, **STREAM)


def test_two_create_streams_race_and_exactly_one_wins(backend):
    """Two stores (two connections) stream the same key in create mode at once, two parts each;
    and a short stream against a put."""
    bodies = [STREAM_DATA[: 7 * MiB], STREAM_DATA[6 * MiB : 13 * MiB]]

    async def race(store):
        other = backend.open(**STREAM)
        try:
            results = await asyncio.gather(
                *(
                    _stream(s, "r/big", b, [MiB + 7], mode="create")
                    for s, b in zip((store, other), bodies)
                ),
                return_exceptions=True,
            )
            winners = [i for i, r in enumerate(results) if isinstance(r, ObjectInfo)]
            assert len(winners) == 1, results
            assert all(isinstance(r, ObjectExists) for r in results if r is not results[winners[0]])
            assert await store.get("r/big") == bodies[winners[0]].tobytes()
            small = await asyncio.gather(
                _stream(store, "r/small", b"a" * 100, [7], mode="create"),
                other.put("r/small", b"b" * 100, mode="create"),
                return_exceptions=True,
            )
            assert sorted(type(r).__name__ for r in small) == ["ObjectExists", "ObjectInfo"]
            assert await store.list_uploads() == []
        finally:
            await other.close()

    backend.run(race, **STREAM)


def test_an_aborted_stream_leaves_nothing(backend):
    data = memoryview(STREAM_DATA)[: 12 * MiB]

    async def body(store):
        for mode in ("overwrite", "create"):
            w = store.open_writer(f"a/{mode}", mode=mode)
            await w.write(data)  # parts sent (S3)
            await w.abort()
            await w.abort()  # idempotent
            with pytest.raises(StorageError, match="aborted"):
                await w.commit()
        async with store.open_writer("a/ctx") as w:  # left without commit: aborted
            await w.write(data[:100])
        with pytest.raises(KeyError):
            async with store.open_writer("a/raised", mode="create") as w:
                await w.write(data)
                raise KeyError("the caller failed")
        async with store.open_writer("a/kept") as w:
            await w.write(b"kept")
            await w.commit()
        assert [x.key async for x in store.list("a/")] == ["a/kept"]
        assert await store.list_uploads() == []
        with pytest.raises(ConfigError):
            store.open_writer("a/bad", mode="append")
        with pytest.raises(ConfigError):
            store.open_writer("a//bad")
        with pytest.raises(ConfigError):
            store.open_writer("a/bad", size_hint=-1)

    backend.run(body, **STREAM)
