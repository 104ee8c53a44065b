"""TLS against a private CA, on a real SeaweedFS serving S3 over https (``S3Server(tls=True)``:
its certificate is signed by a CA made for the test, which nothing on the machine trusts).

- Each way of trusting the CA works: ``AWS_CA_BUNDLE``, ``ca_bundle`` in the AWS profile,
  ``REQUESTS_CA_BUNDLE``, ``StorageOptions(verify_tls=path)`` (which wins over the environment),
  ``verify_tls=True`` with ``AWS_CA_BUNDLE`` (True means "verify", not "ignore the bundle"), and
  ``verify_tls=False`` (no verification).
- Trusting nothing is a one-line ``ConfigError`` that says the certificate is not trusted and how
  to trust a private CA; it is final (no retry) and happens before any request is served, on
  aiobotocore's connections and on the direct ranged-GET reader's alike.
- The same holds through every entry point: ``cloudckpt.save``/``load``, ``CheckpointManager``
  and the ``cloudckpt`` command (exit 2 and one line on stderr when untrusted).
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import torch

import cloudckpt
from cloudckpt.errors import ConfigError
from cloudckpt.runtime.loop import drop_store
from cloudckpt.storage import ReadRange, RetryOptions, StorageOptions, open_store
from cloudckpt.testing.servers.seaweed.server import S3Server
from tests.reliability.stores import cli

pytestmark = pytest.mark.timeout(300)

RETRY = RetryOptions(
    max_attempts=4, base_delay=0.01, max_delay=0.1, attempt_timeout=30.0, deadline=60.0
)


@pytest.fixture(scope="module")
def tls_s3():
    with S3Server(tls=True) as info:
        yield info


@pytest.fixture
def clean_aws_env(monkeypatch, tmp_path):
    """No AWS variable and no CA bundle variable; empty config files (HOME is tmp_path)."""
    for key in list(os.environ):
        if key.startswith("AWS_") or key == "REQUESTS_CA_BUNDLE":
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


def _options(info, **overrides) -> StorageOptions:
    fields = dict(
        endpoint_url=info.https_endpoint_url,
        access_key_id=info.access_key,
        secret_access_key=info.secret_key,
        retry=RETRY,
    )
    fields.update(overrides)
    return StorageOptions(**fields)


def _round_trip(info, options: StorageOptions) -> tuple[bytes, int]:
    """Put, head, get and read a range of one object over https (the range through the direct
    reader, ``s3_rangeget``); (the bytes read, requests sent)."""

    async def main():
        store = open_store(info.url(f"tls-{uuid.uuid4().hex[:8]}"), options)
        try:
            await store.put("obj", b"private CA" * 100)
            assert (await store.head("obj")).size == 1000
            ranged = await store.read_ranges("obj", [ReadRange(10, 980)])
            assert bytes(ranged[0]) == (b"private CA" * 100)[10:990]
            assert store.connection.range_getter.fetches == 1
            assert not store.connection.range_getter.disabled
            return await store.get("obj"), store.stats.total_requests
        finally:
            await store.close()

    return asyncio.run(main())


@pytest.mark.parametrize(
    "trust",
    [
        "AWS_CA_BUNDLE",
        "profile ca_bundle",
        "REQUESTS_CA_BUNDLE",
        "verify_tls=path",
        "verify_tls=True + AWS_CA_BUNDLE",
        "verify_tls=False",
    ],
)
def test_a_private_ca_is_trusted_when_configured(tls_s3, clean_aws_env, monkeypatch, trust):
    overrides = {}
    if trust == "AWS_CA_BUNDLE":
        monkeypatch.setenv("AWS_CA_BUNDLE", tls_s3.ca_file)
    elif trust == "profile ca_bundle":
        (clean_aws_env / "config").write_text(f"[default]\nca_bundle = {tls_s3.ca_file}\n")
    elif trust == "REQUESTS_CA_BUNDLE":
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", tls_s3.ca_file)
    elif trust == "verify_tls=path":
        monkeypatch.setenv("AWS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")  # not ours
        overrides["verify_tls"] = tls_s3.ca_file
    elif trust == "verify_tls=True + AWS_CA_BUNDLE":
        monkeypatch.setenv("AWS_CA_BUNDLE", tls_s3.ca_file)
        overrides["verify_tls"] = True
    else:
        overrides["verify_tls"] = False
    data, _ = _round_trip(tls_s3, _options(tls_s3, **overrides))
    assert data == b"private CA" * 100


@pytest.mark.parametrize("options", [{}, {"verify_tls": True}])
def test_an_untrusted_certificate_is_a_one_line_config_error(tls_s3, clean_aws_env, options):
    store_options = _options(tls_s3, **options)

    async def main(first):
        store = open_store(tls_s3.url("untrusted"), store_options)
        try:
            with pytest.raises(ConfigError) as refused:
                if first == "put":
                    await store.put("obj", b"x")
                else:  # the direct reader's own connection
                    await store.read_ranges("obj", [ReadRange(0, 1)])
            return refused.value, store.stats
        finally:
            await store.close()

    for first in ("put", "read_ranges"):
        error, stats = asyncio.run(main(first))
        message = str(error)
        assert "\n" not in message
        assert f"TLS certificate of {tls_s3.https_endpoint_url} is not trusted" in message, message
        assert "AWS_CA_BUNDLE" in message and "verify_tls=" in message, message
        assert stats.retries == 0  # final: retrying cannot help


def test_every_entry_point_follows_aws_ca_bundle(tls_s3, clean_aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", tls_s3.https_endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", tls_s3.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", tls_s3.secret_key)
    run = tls_s3.url(f"tls-run-{uuid.uuid4().hex[:8]}")
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": 7}
    # The API shares one client per bucket and options, made from the environment of its first
    # use: start from none, and drop it whenever the environment changes (runtime.drop_store).
    drop_store(run)
    try:
        # Untrusted: the Python API and the command refuse with the same one-line advice.
        with pytest.raises(ConfigError, match="not trusted.*AWS_CA_BUNDLE"):
            cloudckpt.save(state, run + "/direct")
        refused = cli(tls_s3, "ls", run, AWS_ENDPOINT_URL=tls_s3.https_endpoint_url)
        assert refused.returncode == 2, refused
        assert "not trusted" in refused.stderr and "AWS_CA_BUNDLE" in refused.stderr, refused
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr

        # Trusted through AWS_CA_BUNDLE: save/load, the manager, the command.
        drop_store(run)
        monkeypatch.setenv("AWS_CA_BUNDLE", tls_s3.ca_file)
        cloudckpt.save(state, run + "/direct")
        target = {"w": torch.zeros(3, 4), "step": 0}
        cloudckpt.load(target, run + "/direct")
        assert torch.equal(target["w"], state["w"]) and target["step"] == 7
        with cloudckpt.CheckpointManager(run + "/managed") as manager:
            manager.save(1, state)
            assert manager.latest().step == 1
    finally:
        drop_store(run)
    listed = cli(
        tls_s3,
        "ls",
        run + "/managed",
        AWS_ENDPOINT_URL=tls_s3.https_endpoint_url,
        AWS_CA_BUNDLE=tls_s3.ca_file,
    )
    assert listed.returncode == 0, listed
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[0][0] == "step" and rows[1][0] == "1" and rows[1][-1] == "yes", listed.stdout
