"""S3 servers other than SeaweedFS (issue 16), at the storage layer: DeleteObjects with
Content-MD5 and the single-delete fallback, servers without ListMultipartUploads, exclusive creates
under a race on every S3 implementation of the suite (SeaweedFS and moto), and the single-PUT
limit of a create. Server behaviours the suite cannot run are reproduced by the fault proxy in
front of the real SeaweedFS (a refused request form, a dropped If-None-Match)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import logging
import os
import threading

import pytest

from cloudckpt.errors import ConfigError, ObjectExists, ObjectNotFound, StorageError
from cloudckpt.storage import ObjectInfo, open_store
from cloudckpt.storage.s3 import write as s3_write
from cloudckpt.storage.s3.client import add_content_md5

from .conftest import run_on_store, s3_options

MiB = 1024 * 1024


_run = run_on_store


async def _put_all(store, keys):
    await asyncio.gather(*(store.put(k, k.encode()) for k in keys))


def _warnings(caplog, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


# --- DeleteObjects ------------------------------------------------------------------------------


def test_content_md5_is_the_base64_md5_of_the_body():
    body = b'<Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Object><Key>a</Key>'
    params = {"body": body, "headers": {"User-Agent": "x"}}
    add_content_md5(params)
    assert params["headers"]["Content-MD5"] == base64.b64encode(hashlib.md5(body).digest()).decode()
    given = {"body": body, "headers": {"content-md5": "kept"}}
    add_content_md5(given)
    assert given["headers"] == {"content-md5": "kept"}


def test_delete_objects_carries_content_md5(s3_server, s3_url, fault_proxy):
    """Behind a proxy that refuses a DeleteObjects without Content-MD5 (as MinIO before 2025-01
    and the JuiceFS gateway do), batches still go through as batches; SeaweedFS behind it checks
    the digest itself (a wrong one is 400 BadDigest)."""
    fault_proxy.configure(require_content_md5=True, record=True)
    keys = [f"d/k{i:02d}" for i in range(30)]

    async def body(store):
        await _put_all(store, keys)
        await store.delete(keys + ["d/never-existed"])
        assert [x async for x in store.list()] == []
        assert store.connection.batch_delete is not False
        return dict(store.stats.requests)

    requests = _run(s3_url, s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url), body)
    deletes = [h for m, path, h in fault_proxy.requests if m == "POST" and path.endswith("?delete")]
    assert len(deletes) == 1 and "Content-MD5" in deletes[0]
    assert fault_proxy.counters.get("refused", 0) == 0
    assert requests["delete"] == 1 and "delete_object" not in requests
    # the proxy does refuse a DeleteObjects without the header (botocore alone sends none)
    plain = dataclasses.replace(s3_server, endpoint_url=fault_proxy.endpoint_url).boto3_client()
    with pytest.raises(Exception, match="MissingContentMD5"):
        plain.delete_objects(Bucket=s3_server.bucket, Delete={"Objects": [{"Key": "x"}]})


@pytest.mark.parametrize("status,code", [(501, "NotImplemented"), (400, "MissingContentMD5")])
def test_refused_batch_delete_falls_back_to_single_deletes(
    s3_server, s3_url, fault_proxy, caplog, status, code
):
    fault_proxy.configure(refuse=[("POST", "delete", status, code)])
    keys = [f"d/k{i:02d}" for i in range(25)]

    async def body(store):
        await _put_all(store, keys)
        await store.delete(keys[:20] + ["d/never-existed"])
        assert [x.key async for x in store.list()] == keys[20:]
        assert store.connection.batch_delete is False
        await store.delete(keys[20:])  # remembered: no second DeleteObjects
        assert [x async for x in store.list()] == []
        return dict(store.stats.requests)

    with caplog.at_level(logging.WARNING, logger="cloudckpt.storage"):
        requests = _run(
            s3_url,
            s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url, concurrency=4),
            body,
        )
    assert fault_proxy.counters["refused"] == 1 and requests["delete"] == 1
    assert requests["delete_object"] == 26
    assert len(_warnings(caplog, "refuses DeleteObjects")) == 1


def test_small_delete_batches_on_every_server(s3_like, monkeypatch):
    """Several DeleteObjects batches (batch size lowered to 10) on SeaweedFS and moto."""
    from cloudckpt.storage.s3 import store as s3_module

    monkeypatch.setattr(s3_module, "DELETE_BATCH", 10)
    keys = [f"b/k{i:02d}" for i in range(25)] + ["keep"]

    async def body(store):
        await _put_all(store, keys)
        before = store.stats.requests.get("delete", 0)
        await store.delete(keys[:-1] + ["b/never-existed"])
        assert store.stats.requests["delete"] - before == 3
        assert [x.key async for x in store.list()] == ["keep"]
        assert "delete_object" not in store.stats.requests

    s3_like.run(body)


# --- ListMultipartUploads -----------------------------------------------------------------------


def test_store_without_list_multipart_uploads(s3_server, s3_url, fault_proxy, caplog):
    """Listing uploads is clean-up only: a 501 makes it empty (one WARNING, not asked again),
    and puts of every kind, creates included, work; so do create streams (where the server
    honours If-None-Match)."""
    fault_proxy.configure(refuse=[("GET", "uploads", 501, "NotImplemented")])
    big = os.urandom(6 * MiB)

    async def body(store):
        assert await store.list_uploads() == []
        assert await store.list_uploads("x/") == []
        await store.put("big", big)  # multipart
        await store.put("m", b"manifest", mode="create")
        with pytest.raises(ObjectExists):
            await store.put("m", b"again", mode="create")
        assert await store.get("big") == big and await store.get("m") == b"manifest"
        w = store.open_writer("streamed", mode="create")  # three parts, unclaimed
        await w.write(big + big)
        late = store.open_writer("streamed", mode="create")
        await late.write(big)  # one part out, the key still free
        await w.commit()
        with pytest.raises(ObjectExists):  # the check before the completion, and its header
            await late.commit()
        assert await store.get("streamed") == big + big
        assert fault_proxy.counters["refused"] == 1

    with caplog.at_level(logging.WARNING, logger="cloudckpt.storage"):
        _run(
            s3_url,
            s3_options(
                s3_server,
                endpoint_url=fault_proxy.endpoint_url,
                multipart_threshold=5 * MiB,
                part_size=5 * MiB,
            ),
            body,
        )
    assert fault_proxy.counters["refused"] == 1
    assert len(_warnings(caplog, "does not implement ListMultipartUploads")) == 1


def test_no_exclusive_create_without_if_none_match_and_upload_listing(
    s3_server, s3_url, fault_proxy, s3_backend
):
    """A server that ignores If-None-Match and lacks ListMultipartUploads (as s3rver): the
    fallback protocol cannot work there, so a create fails with a clear error, never silently
    without exclusivity; nothing is left behind."""
    fault_proxy.configure(
        ignore_conditional_writes=True, refuse=[("GET", "uploads", 501, "NotImplemented")]
    )

    async def body(store):
        for _ in range(2):
            with pytest.raises(StorageError, match="no create can be exclusive") as err:
                await store.put("m", b"manifest", mode="create")
            assert not isinstance(err.value, ObjectExists)
        assert store.connection.create_strategy == "fallback"
        with pytest.raises(ObjectNotFound):
            await store.head("m")

    _run(s3_url, s3_options(s3_server, endpoint_url=fault_proxy.endpoint_url), body)
    assert fault_proxy.counters["refused"] == 1  # the second create did not even try
    bucket, phys = s3_backend._s3_key("m")
    uploads = s3_server.boto3_client().list_multipart_uploads(Bucket=bucket, Prefix=phys)
    assert uploads.get("Uploads", []) == []  # the claim upload was aborted


# --- create exclusivity ---------------------------------------------------------------------------

RACE_ROUNDS = 4


def _race_two_committers(url: str, options, rounds: list[tuple[str, list[bytes]]]):
    """Two stores (two connections, two threads, two event loops) create the same key at the
    same moment, once per round (``(key, [body0, body1])``); returns per round each one's
    result or exception, and each store's request counts."""
    barrier = threading.Barrier(2, timeout=120)
    results: list[list] = [[None, None] for _ in rounds]
    requests: list[dict] = [{}, {}]

    def committer(i: int) -> None:
        async def main():
            store = open_store(url, options)
            try:
                # connect (and probe, for "auto") before the first race
                await store.put(f"warm-{i}-{os.urandom(4).hex()}", b"w", mode="create")
                for n, (key, bodies) in enumerate(rounds):
                    await asyncio.to_thread(barrier.wait)
                    try:
                        results[n][i] = await store.put(key, bodies[i], mode="create")
                    except Exception as exc:  # noqa: BLE001 - the loser's error is the point
                        results[n][i] = exc
                requests[i] = dict(store.stats.requests)
            finally:
                await store.close()

        asyncio.run(main())

    threads = [threading.Thread(target=committer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(r is not None for pair in results for r in pair), results
    return results, requests


@pytest.mark.parametrize(
    "s3_like,strategy",
    [("s3", "auto"), ("s3", "fallback"), ("moto", "fallback")],
    indirect=["s3_like"],
)
def test_two_committers_race_one_wins_on_every_server(s3_like, strategy):
    """Bodies above the multipart threshold, created at the same moment by two stores: exactly
    one wins each round, the other gets ObjectExists, the stored body is the winner's. With the
    header (``auto`` picks it on both servers) a create is one PutObject: never multipart.

    moto runs the fallback protocol only: its If-None-Match on PutObject is a check, then a
    store, without a lock (two 5 MiB creates racing both won in 2 of 40 tries; none in 40 at
    256 KiB), which no probe can see; docs/compatibility.md tells moto users to pick
    ``conditional_create="fallback"`` when creates may race."""
    options = dataclasses.replace(
        s3_like.options, multipart_threshold=5 * MiB, part_size=5 * MiB, conditional_create=strategy
    )
    size = 5 * MiB + 4096
    rounds = [
        (f"race/{n}/manifest", [os.urandom(size), os.urandom(size)]) for n in range(RACE_ROUNDS)
    ]
    results, requests = _race_two_committers(s3_like.url, options, rounds)

    async def stored(store):
        return [await store.get(key) for key, _ in rounds]

    for (key, bodies), pair, body in zip(rounds, results, s3_like.run(stored)):
        winners = [i for i, r in enumerate(pair) if isinstance(r, ObjectInfo)]
        assert len(winners) == 1, (key, pair)
        loser = pair[1 - winners[0]]
        assert isinstance(loser, ObjectExists) and isinstance(loser, FileExistsError), loser
        assert body == bodies[winners[0]], key
    if strategy == "auto":
        assert all("create_multipart" not in r and r["put"] >= RACE_ROUNDS for r in requests)
    else:
        assert all(r["create_multipart"] >= RACE_ROUNDS for r in requests)
    assert s3_like.run(lambda store: store.list_uploads()) == []


def test_header_ignored_on_complete_multipart_cannot_overwrite(s3_server, s3_url, fault_proxy):
    """As Ceph RGW 16: If-None-Match honoured on PutObject, ignored on CompleteMultipartUpload.
    The probe says "native", and a second create of a body above the multipart threshold is
    still refused (it is one PutObject); the first body stays."""
    fault_proxy.configure(ignore_conditional_writes="complete")
    first, second = os.urandom(7 * MiB), os.urandom(7 * MiB)

    async def body(store):
        await store.put("m", first, mode="create")
        with pytest.raises(ObjectExists):
            await store.put("m", second, mode="create")
        assert store.connection.create_strategy == "native"
        assert await store.get("m") == first
        assert "create_multipart" not in store.stats.requests

    _run(
        s3_url,
        s3_options(
            s3_server,
            endpoint_url=fault_proxy.endpoint_url,
            multipart_threshold=5 * MiB,
            part_size=5 * MiB,
        ),
        body,
    )
    # the proxy does drop the header on a completion: an overwrite-mode multipart goes through
    client = dataclasses.replace(s3_server, endpoint_url=fault_proxy.endpoint_url).boto3_client()
    bucket, _, prefix = s3_url[len("s3://") :].partition("/")
    upload = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/m")
    etag = client.upload_part(
        Bucket=bucket, Key=f"{prefix}/m", UploadId=upload["UploadId"], PartNumber=1, Body=b"p"
    )["ETag"]
    client.complete_multipart_upload(
        Bucket=bucket,
        Key=f"{prefix}/m",
        UploadId=upload["UploadId"],
        IfNoneMatch="*",
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]},
    )
    assert fault_proxy.counters["resigned"] >= 1


def test_create_larger_than_one_put_is_refused(s3_server, s3_url, monkeypatch):
    """A create is one PutObject, which S3 caps at 5 GiB (here the cap is lowered to 1 MiB): a
    larger create raises ConfigError before sending anything."""
    monkeypatch.setattr(s3_write, "MAX_PUT_SIZE", 1 * MiB)

    async def body(store):
        with pytest.raises(ConfigError, match="more than one PutObject takes") as err:
            await store.put("m", os.urandom(MiB + 1), mode="create")
        assert isinstance(err.value, ValueError)
        assert sum(store.stats.requests.values()) == 0
        await store.put("m", os.urandom(MiB), mode="create")  # at the cap: fine
        await store.put("o", os.urandom(MiB + 1))  # overwrite mode has no such cap

    _run(s3_url, s3_options(s3_server), body)
