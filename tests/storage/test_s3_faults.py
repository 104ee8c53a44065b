"""S3Store through the fault proxy: throttling, resets, truncation, lost responses, wrong keys,
servers that ignore conditional writes, and the concurrency / memory bounds."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from cloudckpt.checksum import crc32c
from cloudckpt.errors import (
    AccessDenied,
    ObjectExists,
    ObjectNotFound,
    RetriesExhausted,
)
from cloudckpt.storage import ObjectInfo, ReadRange, RetryOptions, open_store

from .conftest import run_on_store, s3_options

MiB = 1024 * 1024


_run = run_on_store


def test_200_mib_put_and_get_at_20_percent_faults(s3_server, s3_url, fault_proxy):
    data = np.random.default_rng(1).integers(0, 256, 200 * MiB, dtype=np.uint8)
    fault_proxy.configure(
        schedule=["503", "500", "reset", "truncate", "delay"],
        rate=0.2,
        kinds=("503", "500", "reset", "delay", "truncate"),
        delay_s=0.05,
    )
    options = s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url)

    async def body(store):
        await store.put("big.bin", data)
        back = np.empty_like(data)
        await store.read_ranges(
            "big.bin", [ReadRange(0, data.nbytes, out=memoryview(back), crc32c=crc32c(data))]
        )
        assert np.array_equal(back, data)
        whole = await store.get("big.bin")
        assert whole == data.tobytes()
        return store.stats

    stats = _run(s3_url, options, body)
    counters = fault_proxy.counters
    assert counters["injected"] >= 5 and stats.retries >= 5
    for kind in ("503", "500", "reset", "truncate", "delay"):
        assert counters[kind] >= 1


def test_every_request_failing_ends_at_the_deadline(s3_server, s3_url, fault_proxy):
    fault_proxy.configure(fail_all=True, kinds=("503", "500", "reset"))
    retry = RetryOptions(max_attempts=100_000, base_delay=0.01, max_delay=0.05, deadline=1.5)
    options = s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url, retry=retry)

    async def body(store):
        with pytest.raises(RetriesExhausted) as err:
            await store.get("anything")
        return err.value, store.stats

    err, stats = _run(s3_url, options, body)
    assert err.last_cause is not None and err.operation == "get"
    assert 1 <= err.attempts < retry.max_attempts  # the deadline, not the attempt count, ended it
    assert stats.requests["get"] == err.attempts
    assert fault_proxy.counters["requests"] >= err.attempts


@pytest.mark.timeout(120)  # without the deadline on waits these would wait forever
def test_waiting_for_a_request_slot_or_memory_counts_against_the_deadline(s3_server, s3_url):
    """Issue 13: with every request slot (or all buffer memory) taken, an operation stops
    waiting when its retry deadline passes and raises RetriesExhausted, having sent nothing;
    the wait leaves the slot and the budget as they were."""
    retry = RetryOptions(max_attempts=3, base_delay=0.01, max_delay=0.05, deadline=1.0)
    short = s3_options(s3_server, concurrency=1, max_buffer_bytes=MiB, retry=retry)
    data = os.urandom(1000)
    _run(s3_url, s3_options(s3_server), lambda store: store.put("k", data))

    async def listing(store):
        return [x.key async for x in store.list()]

    operations = {
        "head": lambda store: store.head("k"),
        "put": lambda store: store.put("other", data),
        "list": listing,
        "get": lambda store: store.read_ranges(
            "k", [ReadRange(0, 10, out=memoryview(bytearray(10)))]
        ),
    }

    async def waits(store):
        conn = store.connection
        await conn.client()  # connected: only the waits below can use up the deadline
        async with conn.slots:  # the one slot, held by a request that never ends
            for op, call in operations.items():
                with pytest.raises(RetriesExhausted) as err:
                    await asyncio.wait_for(call(store), 30)
                assert (err.value.operation, err.value.attempts) == (op, 0)
                assert "deadline passed while waiting for a request slot" in str(err.value)
        assert not conn.slots.locked()
        held = await conn.budget.acquire(conn.budget.limit)  # all the store's buffer memory
        try:
            for call in (store.get("k"), store.read_ranges("k", [ReadRange(0, 10)])):
                with pytest.raises(RetriesExhausted) as err:
                    await asyncio.wait_for(call, 30)
                assert (err.value.operation, err.value.attempts) == ("get", 0)
                assert "deadline passed while waiting for buffer memory" in str(err.value)
        finally:
            conn.budget.release(held)
        assert conn.budget.used == 0 and not conn.slots.locked()
        return store.stats.total_requests

    assert _run(s3_url, short, waits) == 0  # nothing was sent once out of time


def test_attempts_are_capped(s3_server, s3_url, fault_proxy):
    fault_proxy.configure(fail_all=True, kinds=("503",))
    options = s3_options(
        s3_server,
        endpoint_url=fault_proxy.endpoint_url,
        retry=RetryOptions(max_attempts=3, base_delay=0.0, max_delay=0.0),
    )

    async def body(store):
        with pytest.raises(RetriesExhausted) as err:
            await store.put("k", b"x")
        assert err.value.attempts == 3 and store.stats.requests["put"] == 3
        assert "SlowDown" in str(err.value.last_cause)

    _run(s3_url, options, body)
    assert fault_proxy.counters["requests"] == 3


def test_wrong_secret_is_access_denied_after_one_request(s3_server, s3_url, fault_proxy):
    options = s3_options(
        s3_server, endpoint_url=fault_proxy.endpoint_url, secret_access_key="not-the-secret"
    )

    async def body(store):
        with pytest.raises(AccessDenied) as err:
            await store.put("k", os.urandom(1000))
        assert isinstance(err.value, PermissionError)
        assert "not-the-secret" not in str(err.value)
        return store.stats.total_requests

    assert _run(s3_url, options, body) == 1
    assert fault_proxy.counters["requests"] == 1


def test_read_only_identity_cannot_write(s3_server, s3_url):
    options = s3_options(
        s3_server,
        access_key_id=s3_server.readonly_access_key,
        secret_access_key=s3_server.readonly_secret_key,
    )

    async def body(store):
        with pytest.raises(AccessDenied):
            await store.put("k", b"x")
        assert store.stats.total_requests == 1
        with pytest.raises(AccessDenied):
            await store.delete(["k"])
        assert [x async for x in store.list()] == []  # reading is allowed

    _run(s3_url, options, body)


def test_missing_credentials_is_a_config_error(s3_server, s3_url, monkeypatch, tmp_path):
    from cloudckpt.errors import ConfigError
    from cloudckpt.storage import StorageOptions

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")

    async def body(store):
        with pytest.raises(ConfigError, match="credentials"):
            await store.head("k")

    _run(s3_url, StorageOptions(endpoint_url=s3_server.endpoint_url), body)


@pytest.mark.parametrize("into", ["out", "sinks"])
def test_truncated_body_resumes_where_it_broke(s3_server, s3_url, fault_proxy, into):
    """A body cut mid-way is resumed from where it broke, whether the bytes go to ``out`` as they
    arrive or to verified sinks (block by block, each delivered once)."""
    data = os.urandom(8 * MiB)
    options = s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url)

    async def body(store):
        await store.put("obj", data)
        store.stats.reset()
        fault_proxy.configure(schedule=["truncate"])
        if into == "out":
            views = await store.read_ranges("obj", [ReadRange(0, len(data), crc32c=crc32c(data))])
            got = bytes(views[0])
        else:
            dest = bytearray(len(data))
            await store.read_ranges(
                "obj",
                [
                    ReadRange(
                        o,
                        MiB,
                        crc32c=crc32c(data[o : o + MiB]),
                        sinks=((0, memoryview(dest)[o : o + MiB]),),
                    )
                    for o in range(0, len(data), MiB)
                ],
            )
            got = bytes(dest)
        assert got == data
        assert store.stats.retries == 1
        assert store.stats.bytes_received < 1.6 * len(data)  # the retry fetched the rest only

    _run(s3_url, options, body)
    assert fault_proxy.counters["truncate"] == 1


def test_lost_create_response_is_recognised(s3_server, s3_url, fault_proxy):
    options = s3_options(
        s3_server, endpoint_url=fault_proxy.endpoint_url, conditional_create="native"
    )

    async def body(store):
        fault_proxy.configure(schedule=["truncate"])  # the server stores it, the answer is lost
        info = await store.put("manifest", b"mine", mode="create")
        # aiohttp re-sends a PUT once on a reset connection (uncounted by the store) or the store
        # retries: either way the second try meets 412 and the ownership check (a HEAD) wins.
        assert info.size == 4 and store.stats.requests["head"] == 1
        with pytest.raises(ObjectExists):
            await store.put("manifest", b"theirs", mode="create")
        assert await store.get("manifest") == b"mine"

    _run(s3_url, options, body)
    assert fault_proxy.counters["requests"] >= 2 and fault_proxy.counters["truncate"] == 1


def test_failed_multipart_is_aborted(s3_server, s3_url, fault_proxy):
    options = s3_options(
        s3_server,
        endpoint_url=fault_proxy.endpoint_url,
        multipart_threshold=8 * MiB,
        part_size=5 * MiB,
        retry=RetryOptions(max_attempts=2, base_delay=0.0, max_delay=0.0),
    )
    fault_proxy.configure(fail_all=True, methods={"PUT"}, kinds=("503",))  # parts fail

    async def failing(store):
        with pytest.raises(RetriesExhausted):
            await store.put("mp.bin", os.urandom(20 * MiB))
        assert store.stats.requests["create_multipart"] == 1

    _run(s3_url, options, failing)  # close() waits for the background abort
    fault_proxy.configure(fail_all=False)

    async def check(store):
        assert await store.list_uploads() == []
        with pytest.raises(ObjectNotFound):
            await store.head("mp.bin")

    _run(s3_url, s3_options(s3_server), check)


def test_cancelled_multipart_is_aborted(s3_server, s3_url):
    async def body(store):
        task = asyncio.ensure_future(store.put("cancelled.bin", os.urandom(64 * MiB)))
        while not store.stats.requests.get("upload_part"):
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(s3_url, s3_options(s3_server, part_size=5 * MiB, concurrency=2), body)

    async def check(store):
        assert await store.list_uploads() == []
        with pytest.raises(ObjectNotFound):
            await store.head("cancelled.bin")

    _run(s3_url, s3_options(s3_server), check)


def test_server_ignoring_if_none_match_needs_the_fallback(s3_server, s3_url, fault_proxy):
    fault_proxy.configure(ignore_conditional_writes=True)
    ignoring = s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url)

    async def native_is_fooled(store):
        await store.put("n/manifest", b"first", mode="create")
        await store.put("n/manifest", b"second", mode="create")  # not refused: no protection
        assert await store.get("n/manifest") == b"second"

    _run(
        s3_url,
        s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url, conditional_create="native"),
        native_is_fooled,
    )

    async def auto_detects(store):
        bodies = [bytes([i]) * 3000 for i in range(6)]
        results = await asyncio.gather(
            *(store.put("a/manifest", b, mode="create") for b in bodies), return_exceptions=True
        )
        assert store.connection.create_strategy == "fallback"
        winners = [i for i, r in enumerate(results) if isinstance(r, ObjectInfo)]
        assert len(winners) == 1, results
        assert all(isinstance(r, ObjectExists) for i, r in enumerate(results) if i not in winners)
        assert await store.get("a/manifest") == bodies[winners[0]]
        with pytest.raises(ObjectExists):
            await store.put("a/manifest", b"late", mode="create")
        assert await store.list_uploads() == []

    _run(s3_url, ignoring, auto_detects)
    assert fault_proxy.counters["resigned"] >= 2


def test_fallback_protocol_on_a_real_server(s3_server, s3_url):
    async def body(store):
        results = await asyncio.gather(
            *(store.put("manifest", bytes([i]) * 10, mode="create") for i in range(4)),
            return_exceptions=True,
        )
        assert sum(isinstance(r, ObjectInfo) for r in results) == 1, results
        assert sum(isinstance(r, ObjectExists) for r in results) == 3
        big = os.urandom(12 * MiB)  # several parts
        await store.put("big", big, mode="create")
        assert await store.get("big") == big
        await store.put("empty", b"", mode="create")
        assert await store.get("empty") == b""
        for key in ("big", "streamed"):  # a create stream claims the key the same way
            w = store.open_writer(key, mode="create")
            try:
                await w.write(big)
                await w.commit()
            except ObjectExists:
                assert key == "big"
            else:
                assert key == "streamed"
        assert await store.get("streamed") == big and await store.get("big") == big
        assert await store.list_uploads() == []

    _run(s3_url, s3_options(s3_server, conditional_create="fallback", part_size=5 * MiB), body)


def test_concurrency_and_buffer_bounds(s3_server, s3_url, fault_proxy):
    options = s3_options(
        s3_server,
        endpoint_url=fault_proxy.endpoint_url,
        concurrency=3,
        max_buffer_bytes=4 * MiB,
        multipart_threshold=8 * MiB,
        part_size=5 * MiB,
    )

    async def body(store):
        data = os.urandom(2 * MiB)
        await asyncio.gather(
            *(store.put(f"o{i}", data) for i in range(8)), store.put("mp", os.urandom(30 * MiB))
        )
        results = await asyncio.gather(
            *(store.read_ranges(f"o{i}", [ReadRange(0, len(data))]) for i in range(8)),
            *(store.get(f"o{i}") for i in range(8)),
        )
        assert all(bytes(r[0]) == data for r in results[:8])
        assert all(r == data for r in results[8:])
        assert store.connection.budget.peak <= 4 * MiB

    _run(s3_url, options, body)
    assert fault_proxy.counters["max_inflight"] <= 3


def test_transport_checksum_is_sent(s3_server, s3_url, s3_backend):
    import base64

    data = os.urandom(3 * MiB)
    _run(s3_url, s3_options(s3_server), lambda store: store.put("c.bin", data))
    bucket, phys = s3_backend._s3_key("c.bin")
    head = s3_server.boto3_client().head_object(Bucket=bucket, Key=phys, ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == base64.b64encode(crc32c(data).to_bytes(4, "big")).decode()


def test_prefix_spreading(s3_server, s3_url, s3_backend):
    keys = sorted(f"run/step-{i}/data/r{i}.bin" for i in range(12)) + ["run/top"]
    keys.sort()

    async def body(store):
        await asyncio.gather(*(store.put(k, k.encode()) for k in keys))
        assert [x.key async for x in store.list()] == keys
        assert [
            x.prefix async for x in store.list("run/", delimiter="/") if hasattr(x, "prefix")
        ] == sorted({k.rsplit("/", 2)[0] + "/" for k in keys if k != "run/top"})
        step = store.child("run/step-3")
        assert await step.get("data/r3.bin") == b"run/step-3/data/r3.bin"
        assert [x.key async for x in step.list()] == ["data/r3.bin"]
        await store.delete(keys[:5])
        assert [x.key async for x in store.list()] == keys[5:]

    _run(s3_url, s3_options(s3_server, prefix_spreading=4), body)
    bucket, root = s3_backend._s3_key("")
    listed = s3_server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=root)["Contents"]
    hashed_dirs = {o["Key"][len(root) :].split("/")[0] for o in listed}
    assert len(hashed_dirs) >= 2 and hashed_dirs <= {"0", "1", "2", "3"}


def test_large_gets_share_a_small_budget_without_deadlock(s3_server, s3_url):
    options = s3_options(s3_server, concurrency=4, max_buffer_bytes=16 * MiB, part_size=5 * MiB)
    objects = {f"g{i}": os.urandom(12 * MiB) for i in range(6)}

    async def body(store):
        await asyncio.gather(*(store.put(k, v) for k, v in objects.items()))
        got = await asyncio.wait_for(asyncio.gather(*(store.get(k) for k in objects)), 120)
        assert got == list(objects.values())
        assert store.connection.budget.peak <= 16 * MiB and store.connection.budget.used == 0
        # 5 MiB first piece + two more pieces each; a get that found no room dropped its first
        # piece and read it again
        assert store.stats.requests["get"] >= 6 * 3

    _run(s3_url, options, body)


# --- streams (open_writer) ----------------------------------------------------------------------

STREAM = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}


async def _nothing_left(store, *keys):
    assert await store.list_uploads() == []
    for key in keys:
        with pytest.raises(ObjectNotFound):
            await store.head(key)


@pytest.mark.parametrize("mode", ["overwrite", "create"])
def test_a_stream_failing_mid_way_is_aborted(s3_server, s3_url, fault_proxy, mode):
    """Parts refused (503 on every PUT) after the upload started, then a refused completion
    (every POST): each stream fails typed, its upload is aborted, no object appears."""
    options = s3_options(
        s3_server,
        endpoint_url=fault_proxy.endpoint_url,
        **STREAM,
        conditional_create="native",  # no probe (a PUT)
        retry=RetryOptions(max_attempts=2, base_delay=0.0, max_delay=0.0),
    )
    data = np.random.default_rng(3).integers(0, 256, 12 * MiB, dtype=np.uint8)

    async def failing(store):
        fault_proxy.configure(fail_all=True, methods={"PUT"}, kinds=("503",))
        w = store.open_writer("parts.bin", mode=mode)
        with pytest.raises(RetriesExhausted):
            await w.write(data[: 6 * MiB])  # the first part goes out
            await w.write(data[6 * MiB :])  # the second waits for room or fails here
            await w.commit()
        assert store.stats.requests["create_multipart"] == 1
        assert store.stats.requests["upload_part"] >= 2
        fault_proxy.configure(fail_all=False)
        w = store.open_writer("complete.bin", mode=mode)
        await w.write(data)
        fault_proxy.configure(fail_all=True, methods={"POST"}, kinds=("503",))
        with pytest.raises(RetriesExhausted):
            await w.commit()
        fault_proxy.configure(fail_all=False)
        await _nothing_left(store, "parts.bin", "complete.bin")

    _run(s3_url, options, failing)
    _run(
        s3_url,
        s3_options(s3_server),
        lambda store: _nothing_left(store, "parts.bin", "complete.bin"),
    )


def test_a_cancelled_stream_is_aborted(s3_server, s3_url):
    data = np.random.default_rng(4).integers(0, 256, 48 * MiB, dtype=np.uint8)

    async def body(store):
        async def stream():
            w = store.open_writer("cancelled.bin", mode="create")
            for i in range(0, len(data), MiB):
                await w.write(data[i : i + MiB])
            await w.commit()

        task = asyncio.ensure_future(stream())
        while not store.stats.requests.get("upload_part"):
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(s3_url, s3_options(s3_server, concurrency=2, **STREAM), body)  # close waits for aborts
    _run(s3_url, s3_options(s3_server), lambda store: _nothing_left(store, "cancelled.bin"))


def test_a_stream_holds_its_parts_within_the_budget(s3_server, s3_url, fault_proxy):
    """At most ``concurrency`` parts in flight and never more budget than ``max_buffer_bytes``
    (here room for one 5 MiB part at a time), whatever the object's size."""
    options = s3_options(
        s3_server,
        endpoint_url=fault_proxy.endpoint_url,
        concurrency=2,
        max_buffer_bytes=8 * MiB,
        **STREAM,
    )
    data = np.random.default_rng(5).integers(0, 256, 26 * MiB, dtype=np.uint8)

    async def body(store):
        info = await store.open_writer("bounded.bin").__aenter__()
        for i in range(0, len(data), 3 * MiB):
            await info.write(data[i : i + 3 * MiB])
        await info.commit()
        assert store.stats.requests["upload_part"] == 6
        assert 5 * MiB <= store.connection.budget.peak <= 8 * MiB
        assert await store.get("bounded.bin") == data.tobytes()

    _run(s3_url, options, body)
    assert fault_proxy.counters["max_inflight"] <= 2


def test_create_streams_stay_exclusive_where_the_completion_ignores_if_none_match(
    s3_server, s3_url, fault_proxy
):
    """A server that honours If-None-Match on PutObject but not on CompleteMultipartUpload (as
    Ceph RGW 16): the claim alone keeps a create stream from writing over an object, or over
    another create stream racing it."""
    fault_proxy.configure(ignore_conditional_writes="complete")
    options = s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url, **STREAM)
    data = np.random.default_rng(6).integers(0, 256, 13 * MiB, dtype=np.uint8)
    bodies = [data[: 11 * MiB], data[2 * MiB :]]

    async def stream(store, key, body):
        w = store.open_writer(key, mode="create")
        for i in range(0, len(body), 2 * MiB):
            await w.write(body[i : i + 2 * MiB])
        return await w.commit()

    async def body(store):
        await store.put("taken.bin", b"theirs")
        with pytest.raises(ObjectExists):
            await stream(store, "taken.bin", bodies[0])
        assert await store.get("taken.bin") == b"theirs"
        other = open_store(s3_url, options)
        try:
            results = await asyncio.gather(
                stream(store, "raced.bin", bodies[0]),
                stream(other, "raced.bin", bodies[1]),
                return_exceptions=True,
            )
        finally:
            await other.close()
        winners = [i for i, r in enumerate(results) if isinstance(r, ObjectInfo)]
        assert len(winners) == 1, results
        assert isinstance(results[1 - winners[0]], ObjectExists)
        assert await store.get("raced.bin") == bodies[winners[0]].tobytes()
        assert store.connection.create_strategy == "native"
        assert await store.list_uploads() == []

    _run(s3_url, options, body)
    assert fault_proxy.counters["resigned"] >= 1
