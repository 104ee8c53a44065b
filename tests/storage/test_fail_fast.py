"""Failing fast and saying why (issue 15): a closed port or an endpoint that never answers fails an
operation with one WARNING at most, well before the deadline, and the error names the operation,
the object, the attempts, the seconds spent and the endpoint (and, with no endpoint configured,
that AWS S3 was used and how to point elsewhere). Timeouts are options, and ``--timeout``."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess

import pytest
import torch

import cloudckpt
from cloudckpt import CheckpointManager
from cloudckpt.errors import CheckpointError, RetriesExhausted
from cloudckpt.storage import RetryOptions, StorageOptions, open_store
from cloudckpt.storage.s3.client import _config
from cloudckpt.storage.s3.errors import Endpoint
from cloudckpt.testing.faults.deadend import SilentServer, TrickleServer, closed_port
from tests.cli_forkserver import run_cli
from tests.reliability.stores import cli_env

QUICK = RetryOptions(
    base_delay=0.01,
    max_delay=0.05,
    connect_timeout=1.0,
    read_timeout=0.5,
    max_stalls=2,
    deadline=120.0,
)
OPS = ("head", "get", "list", "put", "put_multipart", "delete")


def _options(endpoint_url: str | None, retry: RetryOptions = QUICK, **kw) -> StorageOptions:
    return StorageOptions(
        endpoint_url=endpoint_url,
        region="us-east-1",
        access_key_id="AKIDFAST",
        secret_access_key="fast-secret-not-shown",
        retry=retry,
        multipart_threshold=5 * 1024 * 1024,
        part_size=5 * 1024 * 1024,
        **kw,
    )


async def _one(store, op: str):
    if op == "head":
        return await store.head("k")
    if op == "get":
        return await store.get("k")
    if op == "list":
        return [x async for x in store.list()]
    if op == "put":
        return await store.put("k", b"x" * 1000)
    if op == "put_multipart":
        return await store.put("k", os.urandom(6 * 1024 * 1024))
    return await store.delete(["k"])


def _fail(url: str, options: StorageOptions, op: str) -> RetriesExhausted:
    async def main():
        store = open_store(url, options)
        try:
            with pytest.raises(RetriesExhausted) as err:
                await _one(store, op)
            return err.value
        finally:
            await store.close()

    return asyncio.run(main())


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("cloudckpt") and r.levelno >= logging.WARNING
    ]


@pytest.mark.parametrize("op", OPS)
def test_closed_port_one_warning_and_an_error_that_says_where(op, caplog):
    port = closed_port()
    caplog.set_level(logging.DEBUG, logger="cloudckpt")
    err = _fail("s3://bucket/run", _options(f"http://127.0.0.1:{port}"), op)
    text = str(err)
    assert err.attempts == QUICK.max_attempts and err.last_cause is not None
    assert text.startswith(f"{'create_multipart' if op == 'put_multipart' else op} s3://bucket/run")
    assert f"gave up after {QUICK.max_attempts} attempts in " in text and " s, " in text
    assert f"endpoint http://127.0.0.1:{port} (from StorageOptions.endpoint_url)" in text
    assert "fast-secret-not-shown" not in text
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "; retrying in" in warnings[0], warnings
    debug = [
        r for r in caplog.records if r.levelno == logging.DEBUG and "retrying" in r.getMessage()
    ]
    assert len(debug) == QUICK.max_attempts - 2  # every later retry, at DEBUG


@pytest.mark.parametrize("op", OPS)
def test_silent_endpoint_gives_up_after_max_stalls(op, caplog):
    caplog.set_level(logging.DEBUG, logger="cloudckpt")
    with SilentServer() as server:
        err = _fail("s3://bucket/run", _options(server.endpoint_url), op)
        assert server.accepted >= QUICK.max_stalls
    text = str(err)
    assert err.attempts == QUICK.max_stalls  # not max_attempts, not the deadline
    assert (
        "no answer: 2 attempts in a row timed out (connect timeout 1 s, read timeout 0.5 s)" in text
    ), text
    assert f"endpoint {server.endpoint_url} (from StorageOptions.endpoint_url)" in text
    assert len(_warnings(caplog)) == 1


def test_env_endpoint_is_named_with_its_variable(monkeypatch):
    port = closed_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    err = _fail(
        "s3://bucket/run",
        _options(None, retry=RetryOptions(max_attempts=2, base_delay=0.01, max_delay=0.01)),
        "head",
    )
    assert f"endpoint http://127.0.0.1:{port} (from AWS_ENDPOINT_URL)" in str(err)


def test_no_endpoint_configured_says_aws_s3_and_how_to_point_elsewhere(monkeypatch):
    """With no endpoint anywhere, botocore goes to AWS S3: the error says so. The requests go
    through a proxy on a closed port, so nothing leaves the machine."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{closed_port()}")
    err = _fail(
        "s3://bucket/run",
        _options(None, retry=RetryOptions(max_attempts=2, base_delay=0.01, max_delay=0.01)),
        "head",
    )
    text = str(err)
    assert "endpoint https://s3.amazonaws.com: AWS S3, as no endpoint is configured" in text
    assert "AWS_ENDPOINT_URL or StorageOptions(endpoint_url=...)" in text
    assert Endpoint().describe().startswith("the default endpoint: AWS S3")


def test_api_and_manager_fail_on_a_silent_endpoint():
    with SilentServer() as server:
        options = _options(server.endpoint_url)
        for call in (
            lambda: cloudckpt.load({"w": torch.zeros(2)}, "s3://bucket/run/ck", storage=options),
            lambda: cloudckpt.save({"w": torch.zeros(2)}, "s3://bucket/run/ck2", storage=options),
            lambda: cloudckpt.load_full("s3://bucket/run/ck", storage=options),
            lambda: CheckpointManager("s3://bucket/run", storage=options).list(),
        ):
            with pytest.raises((RetriesExhausted, CheckpointError)) as err:
                call()
            text = str(err.value)
            assert "no answer" in text and server.endpoint_url in text, text
            assert "planning" not in text


def _cli_run(args: list[str], endpoint: str, cwd) -> subprocess.CompletedProcess:
    env = cli_env(
        None,
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="AKIDFAST",
        AWS_SECRET_ACCESS_KEY="fast-secret-not-shown",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return run_cli(args, cwd=str(cwd), env=env, timeout=240)


def test_cli_ls_on_a_closed_port_prints_one_warning_then_the_error(tmp_path):
    port = closed_port()
    res = _cli_run(["ls", "s3://bucket/run"], f"http://127.0.0.1:{port}", tmp_path)
    assert res.returncode == 1, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2, lines  # before: a line per retry
    assert "; retrying in" in lines[0]
    assert lines[1].startswith(
        "cloudckpt ls: error: list s3://bucket/run: gave up after 8 attempts"
    )
    assert f"endpoint http://127.0.0.1:{port} (from AWS_ENDPOINT_URL)" in lines[1]
    assert "Traceback" not in res.stderr and "fast-secret" not in res.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["ls", "s3://bucket/run"],
        ["show", "s3://bucket/run/ck"],
        ["verify", "s3://bucket/run", "--step", "1"],
    ],
)
def test_cli_timeout_gives_up_on_a_silent_endpoint(command, tmp_path):
    with SilentServer() as server:
        res = _cli_run(["--timeout", "2", *command], server.endpoint_url, tmp_path)
    assert res.returncode == 1, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) <= 2 and lines[-1].startswith(f"cloudckpt {command[0]}: error: "), lines
    assert "no answer: 3 attempts in a row timed out" in lines[-1]
    assert f"read timeout {2 / 3:g} s" in lines[-1] and server.endpoint_url in lines[-1]


def test_cli_timeout_must_be_positive(tmp_path):
    res = _cli_run(["--timeout", "0", "ls", "s3://bucket/run"], "http://127.0.0.1:9", tmp_path)
    assert res.returncode == 2 and "--timeout" in res.stderr


def test_timeout_options():
    default = RetryOptions()
    assert (default.connect_timeout, default.read_timeout, default.max_stalls) == (5.0, 20.0, 3)
    assert default.max_stalls * default.read_timeout <= 60  # a dead endpoint: about a minute
    ten = StorageOptions(region="eu-west-1").with_timeout(9)
    assert ten.region == "eu-west-1"
    assert (ten.retry.read_timeout, ten.retry.connect_timeout) == (3.0, 3.0)
    assert ten.retry.deadline == default.deadline and ten.retry.max_attempts == 8
    assert RetryOptions().within(900).deadline == 900
    for bad in (0, -1):
        with pytest.raises(ValueError):
            RetryOptions().within(bad)
    with pytest.raises(ValueError):
        RetryOptions(read_timeout=0)
    with pytest.raises(ValueError):
        RetryOptions(max_stalls=0)
    with pytest.raises(TypeError):
        RetryOptions(8)  # keyword-only
    config = _config(StorageOptions(retry=RetryOptions(connect_timeout=2, read_timeout=7)), "path")
    assert (config.connect_timeout, config.read_timeout) == (2, 7)
    capped = _config(StorageOptions(retry=RetryOptions(attempt_timeout=1.5)), "path")
    assert (capped.connect_timeout, capped.read_timeout) == (1.5, 1.5)


def test_slow_transfers_are_not_cut_by_the_read_timeout(s3_server, s3_url, fault_proxy):
    """Each answer waits 1.2 s before it starts (under a 1 s read timeout it would fail); with a
    2 s read timeout every request succeeds, however long the whole transfer takes."""
    from tests.storage.conftest import s3_options

    fault_proxy.configure(rate=1.0, kinds=("delay",), delay_s=1.2)
    slow = RetryOptions(read_timeout=2.0, connect_timeout=2.0, max_attempts=1)
    options = s3_options(
        s3_server,
        endpoint_url=fault_proxy.endpoint_url,
        retry=slow,
        multipart_threshold=5 * 1024 * 1024,
        part_size=5 * 1024 * 1024,
    )
    body = os.urandom(11 * 1024 * 1024)

    async def main(opts):
        store = open_store(s3_url, opts)
        try:
            await store.put("big", body)
            return await store.get("big")
        finally:
            await store.close()

    assert asyncio.run(main(options)) == body
    too_short = s3_options(
        s3_server,
        endpoint_url=fault_proxy.endpoint_url,
        retry=RetryOptions(read_timeout=0.6, max_attempts=1),
    )
    with pytest.raises(RetriesExhausted, match="ReadTimeoutError|SendStall"):
        asyncio.run(main(too_short))


def test_a_body_that_keeps_moving_is_never_cut_by_the_read_timeout():
    """A GET whose body takes 3 s to arrive, a piece every 0.15 s, succeeds under a 0.5 s read
    timeout (the timeout is silence per read, not a bound on the transfer); pauses longer than
    the read timeout fail it as a stall."""
    body = os.urandom(20 * 4096)
    trickle = RetryOptions(read_timeout=0.5, connect_timeout=1.0, max_attempts=1)
    with TrickleServer(body, chunk=4096, pause=0.15) as server:

        async def main(retry):
            store = open_store("s3://bucket/run", _options(server.endpoint_url, retry=retry))
            try:
                return await store.get("k")
            finally:
                await store.close()

        assert asyncio.run(main(trickle)) == body
        server.pause = 0.8
        with pytest.raises(RetriesExhausted, match="timed out|Timeout"):
            asyncio.run(
                main(RetryOptions(read_timeout=0.5, max_attempts=3, max_stalls=1, base_delay=0.01))
            )
