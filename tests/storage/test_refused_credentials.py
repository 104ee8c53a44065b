"""Refused credentials say so on every call (issue 15), against the real SeaweedFS: a wrong secret
(403 SignatureDoesNotMatch), an unknown access key (403 InvalidAccessKeyId) and a read-only
identity (403 AccessDenied) on head, get, put, list and delete. HEAD answers carry no error code;
one GET of the object's first byte asks why. Messages name the access key id, never the secret."""

from __future__ import annotations

import asyncio

import pytest
import torch

import cloudckpt
from cloudckpt.errors import AccessDenied
from cloudckpt.storage import open_store
from tests.cli_forkserver import run_cli
from tests.reliability.stores import REPO, cli_env
from tests.storage.conftest import s3_options

WRONG_SECRET = "wrong-secret-Vb7Qm2Xn9Lp4"
UNKNOWN_KEY = "AKIDUNKNOWN0000H10"
OPS = ("head", "get", "put", "list", "delete")


async def _call(store, op: str):
    if op == "head":
        return await store.head("k")
    if op == "get":
        return await store.get("k")
    if op == "put":
        return await store.put("k", b"x" * 100)
    if op == "list":
        return [x async for x in store.list()]
    return await store.delete(["k"])


def _refusals(url: str, options) -> dict[str, tuple[AccessDenied, int]]:
    """Each operation's error, and the requests it cost."""

    async def main():
        out = {}
        for op in OPS:
            store = open_store(url, options)
            try:
                with pytest.raises(AccessDenied) as err:
                    await _call(store, op)
                out[op] = (err.value, store.stats.total_requests)
            finally:
                await store.close()
        return out

    return asyncio.run(main())


@pytest.mark.parametrize("who", ["wrong secret", "unknown key"])
def test_refused_credentials_on_every_call(s3_server, s3_url, who):
    if who == "wrong secret":
        options = s3_options(s3_server, secret_access_key=WRONG_SECRET)
        key_id, code = s3_server.access_key, "SignatureDoesNotMatch"
        check = "check AWS_SECRET_ACCESS_KEY"
    else:
        options = s3_options(s3_server, access_key_id=UNKNOWN_KEY)
        key_id, code = UNKNOWN_KEY, "InvalidAccessKeyId"
        check = "check AWS_ACCESS_KEY_ID or AWS_PROFILE"
    for op, (err, requests) in _refusals(s3_url, options).items():
        text = str(err)
        assert isinstance(err, PermissionError)
        assert text.startswith(f"{op} {s3_url}"), text
        assert f"the credentials were refused (403 {code})" in text, (op, text)
        assert f"access key id {key_id!r}" in text and check in text, (op, text)
        assert WRONG_SECRET not in text and s3_server.secret_key not in text
        assert requests == (2 if op == "head" else 1), (op, requests)  # never retried


def test_read_only_identity_is_access_denied_with_what_to_check(s3_server, s3_url):
    options = s3_options(
        s3_server,
        access_key_id=s3_server.readonly_access_key,
        secret_access_key=s3_server.readonly_secret_key,
    )

    async def main():
        store = open_store(s3_url, options)
        try:
            out = {}
            for op in ("put", "delete"):
                with pytest.raises(AccessDenied) as err:
                    await _call(store, op)
                out[op] = str(err.value)
            return out
        finally:
            await store.close()

    for op, text in asyncio.run(main()).items():
        assert "access denied (403 AccessDenied" in text, text
        assert f"access key id {s3_server.readonly_access_key!r} may not {op} here" in text
        assert "a read-only key cannot save or delete" in text
        assert "credentials were refused" not in text


def test_a_403_without_a_reason_says_both_causes_are_possible():
    """A bare 403 that the asking GET could not explain either (unit level: ``classify``)."""
    from botocore.exceptions import ClientError

    from cloudckpt.storage.s3.errors import Endpoint, classify

    bare = ClientError(
        {
            "Error": {"Code": "403", "Message": "Forbidden"},
            "ResponseMetadata": {"HTTPStatusCode": 403},
        },
        "HeadObject",
    )
    verdict = classify(
        bare,
        "head",
        "k",
        "s3://b/run/k",
        Endpoint(url="http://h:1", source="AWS_ENDPOINT_URL", access_key_id="AKX"),
    )
    text = str(verdict.error)
    assert not verdict.retry and isinstance(verdict.error, AccessDenied)
    assert "access denied or credentials refused (403 without a reason)" in text
    assert "access key id 'AKX'" in text and "endpoint http://h:1" in text


def test_save_load_and_cli_say_the_credentials_were_refused(s3_server, s3_url):
    cloudckpt.save({"w": torch.ones(3)}, s3_url, storage=s3_options(s3_server))
    wrong = s3_options(s3_server, secret_access_key=WRONG_SECRET)
    for call in (
        lambda: cloudckpt.save({"w": torch.ones(3)}, f"{s3_url}-2", storage=wrong),
        lambda: cloudckpt.load({"w": torch.zeros(3)}, s3_url, storage=wrong),
        lambda: cloudckpt.load_full(s3_url, storage=wrong),
    ):
        with pytest.raises(AccessDenied) as err:
            call()
        assert "the credentials were refused (403 SignatureDoesNotMatch)" in str(err.value)
        assert "planning" not in str(err.value)
    for command in (["ls", s3_url], ["show", s3_url], ["verify", s3_url]):
        res = run_cli(
            command,
            cwd=REPO,
            env=cli_env(s3_server, AWS_SECRET_ACCESS_KEY=WRONG_SECRET),
            timeout=120,
        )
        assert res.returncode == 2, res
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "the credentials were refused" in lines[0], lines
        assert s3_server.access_key in lines[0] and WRONG_SECRET not in lines[0]
