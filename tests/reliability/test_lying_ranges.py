"""A server that labels its bytes wrongly never makes a read silently wrong (docs/reliability.md,
section 32): every ranged read, through the direct reader and through aiobotocore, checks that
the answer covers exactly the range asked, parses header numbers as HTTP defines them (ASCII
digits), drops a kept-alive connection with bytes waiting, and raises a retriable error
otherwise; such an answer never turns the direct reader off; every error message names the
object and the range. The lies come from ``cloudckpt.testing.faults.lyingproxy`` in front of the
session's SeaweedFS."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from botocore.exceptions import HTTPClientError

import cloudckpt
from cloudckpt.checksum import crc32c
from cloudckpt.errors import ChecksumError, InvalidRange, RetriesExhausted
from cloudckpt.http_numbers import http_int
from cloudckpt.storage import ReadRange, RetryOptions, open_store
from cloudckpt.storage.ranges import checksum_error
from cloudckpt.storage.s3.answers import BadAnswer, check_answer, parse_content_range
from cloudckpt.storage.s3.errors import TruncatedBody, classify
from cloudckpt.testing.faults.lyingproxy import LIES, LyingProxy
from tests.reliability.conftest import storage_for
from tests.storage.conftest import run_on_store

MiB = 1 << 20
DATA = os.urandom(3 * MiB + 4321)
OFFSET, LENGTH = 1000, 200_000  # not at 0: the whole object is never the range asked
READERS = {"direct": {}, "fallback": {"direct_range_reads": False}}
#: Lies told on every request: the answer is refused each time (and never read as data).
FIRM_LIES = [lie for lie in LIES if lie != "late"]
TWO_TRIES = RetryOptions(
    max_attempts=2, base_delay=0.01, max_delay=0.02, attempt_timeout=20.0, deadline=60.0
)
QUICK = RetryOptions(
    max_attempts=6, base_delay=0.01, max_delay=0.05, attempt_timeout=20.0, deadline=60.0
)


@pytest.fixture(scope="module")
def stored(s3_server) -> str:
    """DATA stored once, straight to the server: the URL of the store holding it as ``obj``."""
    url = s3_server.url(f"lying-{os.urandom(4).hex()}")

    async def put():
        store = open_store(url, storage_for(s3_server))
        try:
            await store.put("obj", DATA)
        finally:
            await store.close()

    asyncio.run(put())
    return url


@pytest.fixture(scope="module")
def liar(s3_server):
    with LyingProxy(
        s3_server.endpoint_url,
        credentials=(s3_server.access_key, s3_server.secret_key, s3_server.region),
    ) as proxy:
        yield proxy


@pytest.fixture
def lies(liar):
    liar.configure(lie=None, schedule=[], only=None)
    yield liar
    liar.configure(lie=None, schedule=[], only=None)


def _through(s3_server, liar, reader, **kw):
    return storage_for(s3_server, endpoint_url=liar.endpoint_url, **READERS[reader], **kw)


# -- every reader x every lie: a retriable typed error, never wrong bytes --------------------------


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("lie", FIRM_LIES)
@pytest.mark.parametrize("checked", [False, True], ids=["no-crc", "crc"])
def test_a_lying_answer_is_a_retriable_error_naming_object_and_range(
    s3_server, stored, lies, reader, lie, checked
):
    lies.configure(lie=lie)
    dest = bytearray(LENGTH)
    want = DATA[OFFSET : OFFSET + LENGTH]
    rng = (
        ReadRange(OFFSET, LENGTH, crc32c=crc32c(want), sinks=((0, memoryview(dest)),))
        if checked
        else ReadRange(OFFSET, LENGTH, out=memoryview(dest))
    )

    async def body(store):
        with pytest.raises(RetriesExhausted) as info:
            await store.read_ranges("obj", [rng])
        return info.value, store.connection.range_getter.disabled

    error, disabled = run_on_store(stored, _through(s3_server, lies, reader, retry=TWO_TRIES), body)
    cause = error.last_cause
    assert error.attempts == 2  # retried: a later answer may be true
    assert classify(cause, "get", "obj", stored).retry
    assert f"{stored}/obj" in str(error)
    if reader == "fallback" and lie.endswith("-digits"):  # aiohttp refuses the head itself
        assert isinstance(cause, (BadAnswer, HTTPClientError)), f"{type(cause).__name__}: {cause}"
    else:
        assert isinstance(cause, BadAnswer), f"{type(cause).__name__}: {cause}"
        assert f"{stored}/obj" in str(cause) and f"[{OFFSET}, {OFFSET + LENGTH})" in str(cause)
    assert not disabled  # a lie turns nothing off
    assert lies.counters.get("lied", 0) >= 2
    assert bytes(dest) in (bytes(LENGTH), want)  # nothing, or only true bytes, landed


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("lie", FIRM_LIES)
def test_a_lie_once_then_the_truth_reads_true_bytes_and_keeps_the_reader_on(
    s3_server, stored, lies, reader, lie
):
    dest = bytearray(LENGTH)

    async def body(store):
        await store.read_ranges("obj", [ReadRange(OFFSET, LENGTH, out=memoryview(dest))])
        whole = await store.get("obj")  # the first GET of get() is lied to too
        return whole, store.stats.retries, store.connection.range_getter.disabled

    lies.configure(schedule=[lie, None, lie])
    whole, retries, disabled = run_on_store(
        stored, _through(s3_server, lies, reader, retry=QUICK), body
    )
    assert bytes(dest) == DATA[OFFSET : OFFSET + LENGTH]
    assert whole == DATA
    assert retries == (1 if lie == "whole" else 2)  # get() asks for the whole object anyway
    assert not disabled


@pytest.mark.parametrize("reader", READERS)
def test_bytes_sent_after_an_answer_never_become_the_next_answer(s3_server, stored, lies, reader):
    """The lie "late" sends, 50 ms after a true answer, a second one for the same range with
    every byte inverted. The event loop is kept busy meanwhile (as a training step would), so
    the bytes wait unread in the socket when the next request wants the connection."""
    lies.configure(lie="late")

    async def body(store):
        got = []
        for _ in range(3):
            views = await store.read_ranges("obj", [ReadRange(OFFSET, LENGTH)])
            got.append(bytes(views[0]))
            time.sleep(0.3)  # the loop blocked: the late bytes arrive, unread
        return got

    got = run_on_store(stored, _through(s3_server, lies, reader, retry=QUICK), body)
    assert got == [DATA[OFFSET : OFFSET + LENGTH]] * 3


def test_a_checkpoint_load_through_a_liar_is_right_after_retries_or_fails_typed(
    s3_server, s3_url, lies
):
    import torch

    state = {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}
    cloudckpt.save(state, s3_url, storage=storage_for(s3_server))
    for reader in READERS:
        lies.configure(schedule=list(FIRM_LIES) + ["late"])
        full = cloudckpt.load_full(s3_url, storage=_through(s3_server, lies, reader, retry=QUICK))
        assert torch.equal(full["w"], state["w"]) and torch.equal(full["b"], state["b"])
    lies.configure(only="/data/")  # the manifest is read true: the lies are about the tensors
    for reader in READERS:
        for lie in FIRM_LIES:
            lies.configure(lie=lie)
            options = _through(s3_server, lies, reader, retry=TWO_TRIES)
            if lie == "whole":  # the load reads each (small) data object whole: the truth
                assert torch.equal(cloudckpt.load_full(s3_url, storage=options)["w"], state["w"])
                continue
            with pytest.raises(RetriesExhausted) as info:
                cloudckpt.load_full(s3_url, storage=options)
            assert "/data/" in str(info.value), lie


# -- header numbers as HTTP defines them -----------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["²", "1²", "٣", "１", "12a", "-1", "+1", "", " ", "1 2", "1_000", "9" * 20, None, 1.5, True],
)
def test_header_numbers_are_ascii_digits_only(text):
    assert http_int(text) is None
    assert parse_content_range(f"bytes {text}-9/10") is None
    assert parse_content_range(f"bytes 0-{text}/10") is None


def test_header_numbers_that_are_numbers():
    assert http_int("0") == 0 and http_int(" 123 ") == 123 and http_int(77) == 77
    assert parse_content_range("bytes 5-9/10") == (5, 10, 10)
    assert parse_content_range("bytes 5-9/*") == (5, 10, None)
    assert parse_content_range("bytes 5-9/10x") is None


# -- the range check, every branch, and every message ----------------------------------------------

WHERE = "s3://bkt/run/obj"


@pytest.mark.parametrize(
    "status, crange, length",
    [
        (206, "bytes 11-20/100", 10),  # shifted
        (206, "bytes 10-18/100", 9),  # short
        (206, "bytes 10-20/100", 11),  # long
        (206, "bytes 10-19/15", 10),  # a total that ends inside the range
        (206, "bytes 10-19/100", 9),  # Content-Length disagrees with Content-Range
        (206, "bytes 10-19/100", None),  # no Content-Length, and the range is not the one asked
        (206, None, 10),  # no Content-Range
        (206, "bytes 19-10/100", 10),  # backwards
        (206, "bytes 1²-19/100", 10),
        (200, None, 100),  # the whole object, not the range asked
        (200, None, None),
        (204, None, 0),
    ],
)
def test_every_answer_other_than_the_range_asked_is_refused_with_object_and_range(
    status, crange, length
):
    if crange == "bytes 10-19/100" and length is None:
        crange = "bytes 10-18/100"
    with pytest.raises(BadAnswer) as info:
        check_answer(status, crange, length, 10, 20, where=WHERE)
    assert WHERE in str(info.value) and "[10, 20)" in str(info.value)


def test_answers_that_are_the_range_asked():
    check_answer(206, "bytes 10-19/100", 10, 10, 20, where=WHERE)
    check_answer(206, "bytes 10-19/*", 10, 10, 20, where=WHERE)
    check_answer(206, "bytes 10-19/20", None, 10, 20, where=WHERE)  # chunked
    check_answer(200, None, 20, 0, 20, where=WHERE)  # the whole object was asked
    with pytest.raises(InvalidRange, match=r"s3://bkt/run/obj: range \[10, 20\) is past the end"):
        check_answer(206, "bytes 10-14/15", 5, 10, 20, where=WHERE, key="obj")


@pytest.mark.parametrize("expected", [0, 0x1234ABCD, None])
@pytest.mark.parametrize("actual", [0, 0xFFFFFFFF, None])
def test_every_checksum_error_message_names_object_and_range(expected, actual):
    error = checksum_error("s3://bkt/run/", "obj", 4096, 100, expected, actual)
    text = str(error)
    assert isinstance(error, ChecksumError) and isinstance(error, ValueError)
    assert "s3://bkt/run/obj bytes [4096, 4196)" in text
    assert (error.key, error.offset, error.length) == ("obj", 4096, 100)
    assert ("incomplete" in text) == (actual is None)


def test_a_short_file_in_a_local_store_is_a_typed_error_naming_object_and_range(tmp_path):
    async def body(store):
        await store.put("obj", DATA[:5000])
        with pytest.raises(InvalidRange) as info:
            await store.read_ranges("obj", [ReadRange(4000, 2000)])
        return str(info.value)

    text = run_on_store(str(tmp_path), None, body)
    assert "obj" in text and "[4000, 6000)" in text


def test_a_local_file_that_shrinks_during_a_read_is_a_typed_error_naming_object_and_range(
    tmp_path, monkeypatch
):
    import types

    from cloudckpt.storage.local import store as local

    class Stat:  # the size the file had when the read was planned
        st_size = 10_000

    shim = types.SimpleNamespace(**vars(os))
    shim.fstat = lambda fd: Stat
    monkeypatch.setattr(local, "os", shim)

    async def body(store):
        await store.put("run/obj", DATA[:5000])
        with pytest.raises(InvalidRange) as info:
            await store.read_ranges("run/obj", [ReadRange(4000, 2000)])
        return info.value

    error = run_on_store(str(tmp_path), None, body)
    assert "run/obj: range [4000, 6000)" in str(error) and "ended at byte 5000" in str(error)
    assert error.key == "run/obj"


ONE_TRY = RetryOptions(max_attempts=1, attempt_timeout=20.0, deadline=60.0)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("read", ["ranges", "get"])
def test_every_truncated_body_message_names_object_and_range(
    s3_server, stored, fault_proxy, reader, read
):
    """A body cut halfway (the fault proxy's "truncate"), on each reader and each kind of GET:
    the ``TruncatedBody`` under ``RetriesExhausted`` names the object and the byte range."""
    fault_proxy.configure(schedule=["truncate"])
    options = storage_for(
        s3_server, endpoint_url=fault_proxy.endpoint_url, retry=ONE_TRY, **READERS[reader]
    )

    async def body(store):
        with pytest.raises(RetriesExhausted) as info:
            if read == "get":
                await store.get("obj")
            else:
                await store.read_ranges("obj", [ReadRange(OFFSET, LENGTH)])
        return info.value.last_cause

    cause = run_on_store(stored, options, body)
    assert isinstance(cause, TruncatedBody), f"{type(cause).__name__}: {cause}"
    asked = f"[0, {len(DATA)})" if read == "get" else f"[{OFFSET}, {OFFSET + LENGTH})"
    assert f"{stored}/obj" in str(cause) and asked in str(cause), str(cause)


def test_a_connection_closed_before_an_answer_names_object_and_range():
    from cloudckpt.storage.ranges import LandingPool
    from cloudckpt.storage.s3.exchange import Cursor, Exchange

    async def main():
        texts = []
        for answered in (False, True):
            ex = Exchange(
                asyncio.get_running_loop().create_future(),
                Cursor(10),
                20,
                [],
                LandingPool(1),
                memoryview(bytearray(16)),
                None,
                None,
                where=f"{WHERE}",
            )
            ex.answered = answered
            ex.fail(None)
            with pytest.raises(TruncatedBody) as info:
                ex.future.result()
            texts.append(str(info.value))
        return texts

    for text in asyncio.run(main()):
        assert WHERE in text and "[10, 20)" in text, text
