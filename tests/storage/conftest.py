"""Fixtures of the storage tests: a ``backend`` parametrised over LocalStore and S3Store on two
S3 implementations (the session's SeaweedFS, ``s3``, and moto's server mode, ``moto``), S3
options for a server, and a fault proxy in front of SeaweedFS."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from cloudckpt.storage import RetryOptions, StorageOptions, open_store
from cloudckpt.testing.faults.faultproxy import FaultProxy
from cloudckpt.testing.servers.endpoint import S3ServerInfo

#: Conformance tests whose moto variant moves the most data (1,054 puts; 200 MiB): long mode only.
SLOW_ON_MOTO = frozenset(
    {"test_list_paginates_past_1000_and_batched_delete", "test_multipart_200_mib"}
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(item, "originalname", None) in SLOW_ON_MOTO and "[moto" in item.name:
            item.add_marker(pytest.mark.slow)


FAST_RETRY = RetryOptions(
    max_attempts=10, base_delay=0.01, max_delay=0.2, attempt_timeout=30.0, deadline=120.0
)


def run_on_store(url, options, fn):
    """Open a store for ``url``, run ``await fn(store)`` in a fresh event loop, close the store."""

    async def main():
        store = open_store(url, options)
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(main())


def s3_options(info: S3ServerInfo, **overrides) -> StorageOptions:
    """Options pointing at ``info`` (admin identity), with quick retries."""
    fields = dict(
        endpoint_url=info.endpoint_url,
        region=info.region,
        access_key_id=info.access_key,
        secret_access_key=info.secret_key,
        retry=FAST_RETRY,
    )
    fields.update(overrides)
    return StorageOptions(**fields)


@dataclasses.dataclass
class Backend:
    """One store under test: how to open it, and how to reach its bytes behind its back."""

    kind: str
    url: str
    options: StorageOptions
    server: S3ServerInfo | None = None

    def open(self, **overrides):
        return open_store(self.url, dataclasses.replace(self.options, **overrides))

    def run(self, fn: Callable[..., Awaitable], **overrides):
        """Run ``fn(store)`` on a fresh event loop with a fresh store, closing it afterwards."""

        async def main():
            store = self.open(**overrides)
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(main())

    def _s3_key(self, key: str) -> tuple[str, str]:
        bucket, _, prefix = self.url[len("s3://") :].partition("/")
        return bucket, f"{prefix}/{key}" if prefix else key

    def flip_byte(self, key: str, offset: int) -> None:
        """Corrupt one stored byte of ``key`` (S3: rewrite the object; local: patch the file)."""
        if self.kind == "local":
            with open(Path(self.url) / key, "r+b") as f:
                f.seek(offset)
                b = f.read(1)
                f.seek(offset)
                f.write(bytes([b[0] ^ 0x01]))
            return
        client = self.server.boto3_client()
        bucket, phys = self._s3_key(key)
        data = bytearray(client.get_object(Bucket=bucket, Key=phys)["Body"].read())
        data[offset] ^= 0x01
        client.put_object(Bucket=bucket, Key=phys, Body=bytes(data))

    def start_unfinished_upload(self, key: str) -> None:
        """Leave an unfinished upload of ``key`` behind, as a crashed writer would."""
        if self.kind == "local":
            path = Path(self.url) / key
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / f".{path.name}.cloudckpt-tmp-0123456789abcdef").write_bytes(b"partial")
            return
        client = self.server.boto3_client()
        bucket, phys = self._s3_key(key)
        upload = client.create_multipart_upload(Bucket=bucket, Key=phys)
        client.upload_part(
            Bucket=bucket,
            Key=phys,
            UploadId=upload["UploadId"],
            PartNumber=1,
            Body=os.urandom(1024),
        )


@pytest.fixture(params=["local", "s3", "moto"])
def backend(request, tmp_path) -> Backend:
    if request.param == "local":
        return Backend("local", str(tmp_path / "store"), StorageOptions(retry=FAST_RETRY))
    server, url = ("s3_server", "s3_url") if request.param == "s3" else ("moto_server", "moto_url")
    info = request.getfixturevalue(server)
    return Backend(request.param, request.getfixturevalue(url), s3_options(info), info)


@pytest.fixture(params=["s3", "moto"])
def s3_like(request) -> Backend:
    """Each real S3 implementation of the suite: SeaweedFS (``s3``) and moto (``moto``)."""
    server, url = ("s3_server", "s3_url") if request.param == "s3" else ("moto_server", "moto_url")
    info = request.getfixturevalue(server)
    return Backend(request.param, request.getfixturevalue(url), s3_options(info), info)


@pytest.fixture
def s3_backend(s3_server, s3_url) -> Backend:
    return Backend("s3", s3_url, s3_options(s3_server), s3_server)


@pytest.fixture
def fault_proxy(s3_server):
    """A FaultProxy in front of the session's SeaweedFS (no faults until configured)."""
    proxy = FaultProxy(
        s3_server.endpoint_url,
        seed=1234,
        credentials=(s3_server.access_key, s3_server.secret_key, s3_server.region),
    )
    proxy.start()
    yield proxy
    proxy.stop()
