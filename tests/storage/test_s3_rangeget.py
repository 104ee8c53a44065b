"""The direct ranged-GET reader (``storage/s3/rangeget.py``): the same bytes as the aiobotocore
path for every shape of range list, on SeaweedFS and moto; answers it does not read go to
aiobotocore (which then turns it off when it succeeds); kept-alive connections the server closed
are replaced silently; silence is a stall; a cancelled read lands nothing afterwards; 429/5xx
answers are retried. Servers that misbehave on purpose are small asyncio HTTP servers here."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.checksum import crc32c
from cloudckpt.errors import ObjectNotFound, RetriesExhausted
from cloudckpt.storage import ReadRange, RetryOptions, StorageOptions, open_store
from cloudckpt.storage.ranges import HeldRange, LandingPool

from .conftest import run_on_store, s3_options

MiB = 1024 * 1024
DATA = os.urandom(12 * MiB)


# -- the same bytes as aiobotocore, whatever the ranges --------------------------------------------


@st.composite
def range_lists(draw):
    """1-12 ranges of DATA (overlaps and gaps allowed): each read into ``out``, into verified
    ``sinks`` (the range cut in 1-3 sinks), or into a store-owned buffer."""
    specs = []
    for _ in range(draw(st.integers(1, 12))):
        offset = draw(st.integers(0, len(DATA) - 1))
        length = draw(st.one_of(st.integers(0, 4096), st.integers(1, 6 * MiB)))
        length = min(length, len(DATA) - offset)
        kind = draw(st.sampled_from(["out", "sinks", "buffer"]))
        cuts = (
            sorted(draw(st.sets(st.integers(1, max(1, length - 1)), max_size=2)))
            if kind == "sinks" and length > 1
            else []
        )
        specs.append((offset, length, kind, cuts))
    return specs


def _ranges(specs):
    """ReadRanges for ``specs`` and, per range, ``(buffer, expected bytes)`` of what it fills
    (buffer None: the view ``read_ranges`` returns)."""
    ranges, checks = [], []
    for offset, length, kind, cuts in specs:
        want = DATA[offset : offset + length]
        if kind == "out":
            buf = bytearray(length)
            ranges.append(ReadRange(offset, length, out=memoryview(buf)))
            checks.append([(buf, want)])
        elif kind == "sinks":
            bounds = [0, *cuts, length]
            sinks, check = [], []
            for a, b in zip(bounds, bounds[1:]):
                buf = bytearray(b - a)
                sinks.append((a, memoryview(buf)))
                check.append((buf, want[a:b]))
            ranges.append(ReadRange(offset, length, crc32c=crc32c(want), sinks=tuple(sinks)))
            checks.append(check)
        else:
            ranges.append(ReadRange(offset, length, crc32c=crc32c(want)))
            checks.append([(None, want)])
    return ranges, checks


@pytest.fixture(scope="module")
def objects(s3_server, moto_server):
    """DATA stored once on each server: (server info, store URL)."""
    out = {}
    for name, info in (("s3", s3_server), ("moto", moto_server)):
        url = info.url(f"rangeget-{os.urandom(4).hex()}")

        async def put(store):
            await store.put("obj", DATA)

        run_on_store(url, s3_options(info), put)
        out[name] = (info, url)
    return out


@pytest.mark.parametrize("server", ["s3", "moto"])
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(specs=range_lists(), gap=st.sampled_from([0, 1000, MiB]))
def test_direct_reads_match_the_aiobotocore_path(objects, server, specs, gap):
    info, url = objects[server]
    for direct in (True, False):
        ranges, checks = _ranges(specs)

        async def body(store, ranges=ranges):
            views = await store.read_ranges("obj", ranges)
            getter = store.connection.range_getter
            return [bytes(v) for v in views], getter.fetches, getter.disabled

        views, fetches, disabled = run_on_store(
            url,
            s3_options(info, direct_range_reads=direct, coalesce_gap=gap, part_size=5 * MiB),
            body,
        )
        for check, view in zip(checks, views):
            for buf, want in check:
                assert (view if buf is None else bytes(buf)) == want
        assert not disabled
        assert (fetches > 0) == (direct and any(length for _, length, _, _ in specs))


# -- answers left to aiobotocore -------------------------------------------------------------------


def test_a_refused_presigned_get_goes_through_aiobotocore_and_turns_the_reader_off(
    s3_server, s3_url, fault_proxy, caplog
):
    fault_proxy.configure(refuse=[("GET", "X-Amz-Signature", 403, "AccessDenied")])
    data = os.urandom(3 * MiB)

    async def body(store):
        await store.put("obj", data)
        with caplog.at_level("INFO", logger="cloudckpt.storage"):
            first = await store.read_ranges("obj", [ReadRange(0, len(data))])
        second = await store.read_ranges("obj", [ReadRange(5, 100)])
        return bytes(first[0]), bytes(second[0]), store.connection.range_getter.disabled

    first, second, disabled = run_on_store(
        s3_url, s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url), body
    )
    assert first == data and second == data[5:105]
    assert disabled
    assert fault_proxy.counters["refused"] == 1  # the second read went straight to aiobotocore
    assert "ranged reads go through aiobotocore" in caplog.text
    assert "X-Amz-Signature" not in caplog.text


def test_a_missing_object_is_not_found_and_the_reader_stays_on(s3_server, s3_url):
    async def body(store):
        with pytest.raises(ObjectNotFound):
            await store.read_ranges("missing", [ReadRange(0, 10)])
        return store.connection.range_getter.disabled, store.stats.requests["get"]

    disabled, gets = run_on_store(s3_url, s3_options(s3_server), body)
    assert not disabled
    assert gets == 2  # ours, then the authoritative one through aiobotocore


# -- servers that misbehave ------------------------------------------------------------------------


class FakeS3:
    """A tiny HTTP/1.1 server holding one object at ``/bucket/key`` (no authentication): ranged
    GETs answered 206; ``mode`` says how to misbehave:

    - ``close``: after every answer, waits for the next request on the connection and closes
      it unanswered (a kept-alive connection the server gave up on as the request went out);
    - ``stall``: sends the head and half the body of each answer, then nothing;
    - ``hold``: like ``stall``, but sends the rest once ``release`` is set;
    - ``chunked``: answers with ``Transfer-Encoding: chunked``;
    - ``503once``: answers the first request 503 SlowDown.
    """

    def __init__(self, data: bytes, mode: str = ""):
        self.data, self.mode = data, mode
        self.connections = self.requests = 0
        self.release = asyncio.Event()
        self._server = None

    async def __aenter__(self):
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    def options(self, **kw) -> StorageOptions:
        return StorageOptions(
            endpoint_url=f"http://127.0.0.1:{self.port}",
            region="us-east-1",
            access_key_id="AK",
            secret_access_key="SK",
            addressing_style="path",
            **kw,
        )

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests += 1
                match = re.search(rb"(?i)\r\nrange: bytes=(\d+)-(\d+)", head)
                a, b = (
                    (int(match.group(1)), int(match.group(2)) + 1) if match else (0, len(self.data))
                )
                body = self.data[a:b]
                if self.mode == "503once" and self.requests == 1:
                    xml = b"<Error><Code>SlowDown</Code><Message>slow</Message></Error>"
                    writer.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Length: %d\r\n\r\n%s" % (len(xml), xml)
                    )
                    continue
                if self.mode == "chunked":
                    writer.write(
                        b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
                        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                        % (a, b - 1, len(self.data), len(body), body)
                    )
                    continue
                writer.write(
                    b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes %d-%d/%d\r\n"
                    b"Content-Length: %d\r\n\r\n" % (a, b - 1, len(self.data), len(body))
                )
                if self.mode in ("stall", "hold"):
                    writer.write(body[: len(body) // 2])
                    await writer.drain()
                    await self.release.wait()
                    writer.write(body[len(body) // 2 :])
                    continue
                writer.write(body)
                await writer.drain()
                if self.mode == "close":
                    await reader.readuntil(b"\r\n\r\n")
                    self.requests += 1
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _fake_run(mode, fn, **options):
    async def main():
        async with FakeS3(DATA[:MiB], mode) as server:
            store = open_store("s3://bucket/p", server.options(**options))
            try:
                return await fn(store, server)
            finally:
                await store.close()

    return asyncio.run(main())


def test_a_kept_alive_connection_the_server_closed_is_replaced_silently():
    async def fn(store, server):
        for i in range(3):
            views = await store.read_ranges("key", [ReadRange(i, 1000)])
            assert bytes(views[0]) == DATA[i : i + 1000]
        return store.stats.retries, store.stats.requests["get"], server.connections

    retries, gets, connections = _fake_run("close", fn)
    assert retries == 0 and gets == 3  # the re-sends are not attempts
    assert connections == 3


def test_silence_mid_body_is_a_stall():
    retry = RetryOptions(read_timeout=0.3, max_stalls=2, max_attempts=5, base_delay=0.01)

    async def fn(store, server):
        with pytest.raises(RetriesExhausted, match="no answer") as info:
            await store.read_ranges("key", [ReadRange(0, 4096)])
        return info.value, server.requests

    error, requests = _fake_run("stall", fn, retry=retry)
    assert requests == 2
    assert "X-Amz" not in str(error) and "Signature" not in str(error)


@pytest.mark.parametrize("into", ["out", "sinks"])
def test_a_cancelled_read_lands_nothing_afterwards(into):
    n = 64 * 1024

    async def fn(store, server):
        dest = bytearray(n)
        rng = (
            ReadRange(0, n, out=memoryview(dest))
            if into == "out"
            else ReadRange(0, n, crc32c=crc32c(DATA[:n]), sinks=((0, memoryview(dest)),))
        )
        task = asyncio.ensure_future(store.read_ranges("key", [rng]))
        while server.requests == 0 or not any(dest) and into == "out":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        before = bytes(dest)
        server.release.set()
        await asyncio.sleep(0.2)
        return before, bytes(dest)

    before, after = _fake_run("hold", fn)
    assert after == before
    half = n // 2
    if into == "out":
        assert before[:half] == DATA[:half] and before[half:] == bytes(n - half)
    else:
        assert before == bytes(n)  # a sink gets only a whole verified range


def test_an_answer_the_reader_does_not_read_goes_to_aiobotocore():
    async def fn(store, server):
        views = await store.read_ranges("key", [ReadRange(10, 5000)])
        return bytes(views[0]), store.connection.range_getter.disabled

    got, disabled = _fake_run("chunked", fn)
    assert got == DATA[10:5010]
    assert disabled


def test_a_503_answer_is_retried():
    async def fn(store, server):
        views = await store.read_ranges("key", [ReadRange(0, 5000)])
        return bytes(views[0]), store.stats.retries, store.connection.range_getter.disabled

    got, retries, disabled = _fake_run(
        "503once", fn, retry=RetryOptions(base_delay=0.01, max_delay=0.05)
    )
    assert got == DATA[:5000] and retries == 1 and not disabled


# -- HeldRange's landing buffer --------------------------------------------------------------------


@pytest.mark.parametrize("good", [True, False])
def test_landed_bytes_reach_the_sinks_only_verified_and_the_buffer_is_reused(good):
    data = os.urandom(10_000)
    sink = bytearray(b"\xee" * 6000)
    pool = LandingPool(2)
    held = HeldRange(
        ReadRange(
            0,
            len(data),
            crc32c=crc32c(data) ^ (0 if good else 1),
            sinks=((3000, memoryview(sink)),),
        )
    )
    for a, b in ((4000, 7000), (0, 2500), (7000, 10_000)):  # out of order, mixed with add
        held.landing(a, b - a, pool)[:] = data[a:b]
        held.landed(a, b - a)
        if a == 0:
            held.add(2500, data[2500:4000])
    assert held.ok is good
    assert bytes(sink) == (data[3000:9000] if good else b"\xee" * 6000)
    assert pool.idle_bytes == len(data)  # back in the pool, taken by the next range
    assert len(pool.take(len(data))) == len(data) and pool.idle_bytes == 0
