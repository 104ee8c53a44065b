"""The fallback create's last check, in the window of a non-atomic completion (deterministic).

On a server that ignores ``If-None-Match`` (the fallback claim protocol) and whose
CompleteMultipartUpload is not atomic (moto: the upload leaves the listing before the object
appears), a second creator can pass every step of the claim inside that window: no object yet,
no rival upload listed. What stops it is the HEAD after its parts are up, before it completes
(``S3Uploads.complete(create=True)``, through which a put and a create stream both complete).
A HoldingProxy in front of the session's SeaweedFS freezes the window: the first creator's
completion is held (its upload hidden from listings) while the second claims the key; the
second's parts are held until the first's object exists.
"""

from __future__ import annotations

import asyncio

import pytest

from cloudckpt.errors import ObjectExists
from cloudckpt.testing.faults.holdproxy import HoldingProxy

from .conftest import run_on_store, s3_options

MiB = 1 << 20


@pytest.fixture
def proxy(s3_server):
    with HoldingProxy(
        s3_server.endpoint_url,
        credentials=(s3_server.access_key, s3_server.secret_key, s3_server.region),
        ignore_conditional_writes=True,  # the server ignores If-None-Match: the fallback's case
    ) as p:
        yield p


async def _second_creator_in_the_window(store, proxy, second) -> None:
    """The first creator's put held at its completion; ``second()`` claims the same key with
    its parts held; the first completes, then the second's parts go on. The second must fail
    with ObjectExists and leave the first's bytes and no upload behind."""
    first = b"first" * 1000
    proxy.hold("complete")
    a = asyncio.ensure_future(store.put("k/manifest", first, mode="create"))
    await asyncio.to_thread(proxy.wait_held, "complete", 1)
    proxy.hold("part")  # from now on parts wait; the held completion keeps waiting
    b = asyncio.ensure_future(second())
    await asyncio.to_thread(proxy.wait_held, "part", 1)
    assert proxy.counters.get("hidden", 0) >= 1  # the second's claim listed no rival
    proxy.release("complete")
    await a
    proxy.release("part")
    with pytest.raises(ObjectExists):
        await b
    assert await store.get("k/manifest") == first
    for _ in range(100):  # the second's upload is aborted in the background
        if not await store.list_uploads():
            break
        await asyncio.sleep(0.05)
    assert await store.list_uploads() == []


def test_a_put_in_the_window_of_a_non_atomic_completion_loses(s3_server, s3_url, proxy):
    options = s3_options(s3_server, endpoint_url=proxy.endpoint_url, conditional_create="fallback")

    async def body(store):
        await _second_creator_in_the_window(
            store, proxy, lambda: store.put("k/manifest", b"second" * 1000, mode="create")
        )

    run_on_store(s3_url, options, body)


def test_a_create_stream_in_the_window_of_a_non_atomic_completion_loses(s3_server, s3_url, proxy):
    options = s3_options(
        s3_server,
        endpoint_url=proxy.endpoint_url,
        conditional_create="fallback",
        part_size=5 * MiB,
    )

    async def body(store):
        async def stream():
            w = store.open_writer("k/manifest", mode="create")
            await w.write(b"s" * (5 * MiB + 1))  # more than one part: a multipart stream
            return await w.commit()

        await _second_creator_in_the_window(store, proxy, stream)

    run_on_store(s3_url, options, body)
