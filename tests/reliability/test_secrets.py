"""Secrets and access, through the public API on a real store with authentication on.

- Wrong credentials (a wrong secret, an unknown key, a read-only identity writing) give
  ``AccessDenied`` on every rank, with no retry storm: the requests are counted by the fault proxy
  (no faults injected) and by the store's own stats.
- Secret keys (and session tokens) never appear in the logs of cloudckpt, botocore, aiobotocore,
  aiohttp, urllib3 at DEBUG level (a save and a load, a save with retried faults, failing ones;
  in this process and on the ranks of a 2-rank job), in exception messages and their causes, in
  the reprs of options, stores and results, or in the CLI's output (``CLOUDCKPT_DEBUG=1``
  tracebacks included).
- TLS verification is on by default for https endpoints: against a local TLS server with a
  self-signed certificate the default options fail with a TLS error after one request, and only
  ``verify_tls=False`` gets through.
"""

from __future__ import annotations

import dataclasses
import http.server
import logging
import ssl
import subprocess
import threading
import traceback

import pytest
import torch

import cloudckpt
from cloudckpt import errors
from cloudckpt.storage import RetryOptions, StorageOptions, open_store
from tests.reliability.conftest import SAVE_OPTIONS, storage_for
from tests.reliability.ranks import capture_logs_during
from tests.reliability.stores import cli

pytestmark = pytest.mark.timeout(300)

WRONG_SECRET = "wrong-secret-Zq8vX2kP0sL4mN7bC1dE"
SESSION_TOKEN = "session-token-Hh3Jk9Ll2Mm5Nn8Pp1Qq"
LOGGERS = ("cloudckpt", "botocore", "aiobotocore", "aiohttp", "urllib3", "asyncio", "s3transfer")


def _state() -> dict:
    return {"w": torch.randn(64, 64), "big": torch.randn(3 << 20), "step": 3}


def _all_text(exc: BaseException) -> str:
    """Everything an exception would show: message, repr, causes, rank failures, traceback."""
    parts = []
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts += [str(exc), repr(exc)]
        for failure in getattr(exc, "failures", {}).values():
            parts += [failure.message, failure.traceback, repr(failure)]
        last = getattr(exc, "last_cause", None)
        if last is not None:
            parts += [str(last), repr(last)]
        parts.append("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def _secrets(s3_server, *, tokens: bool = True) -> list[str]:
    keys = [s3_server.secret_key, s3_server.readonly_secret_key, WRONG_SECRET]
    return keys + [SESSION_TOKEN] if tokens else keys


def _assert_clean(text: str, s3_server, what: str, *, tokens: bool = True) -> None:
    for secret in _secrets(s3_server, tokens=tokens):
        assert secret not in text, f"a secret appears in {what}"


# -- wrong credentials ----------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["wrong secret", "unknown key"])
def test_wrong_credentials_are_access_denied_after_one_request(
    s3_server, s3_url, fault_proxy, who, figures
):
    fields = (
        {"secret_access_key": WRONG_SECRET}
        if who == "wrong secret"
        else {"access_key_id": "AKIDUNKNOWN000000000"}
    )
    options = storage_for(s3_server, endpoint_url=fault_proxy.endpoint_url, **fields)
    with pytest.raises(errors.AccessDenied) as denied:
        cloudckpt.save(_state(), s3_url, storage=options)
    assert isinstance(denied.value, PermissionError)
    _assert_clean(_all_text(denied.value), s3_server, "the save's error")
    # one HEAD, and one GET asking why (a HEAD's 403 carries no reason); no retry
    assert fault_proxy.counters["requests"] == 2, fault_proxy.counters
    assert "credentials were refused" in str(denied.value)

    cloudckpt.save(_state(), s3_url, storage=storage_for(s3_server))  # a real checkpoint
    fault_proxy.reset_counters()
    with pytest.raises(errors.AccessDenied) as denied:
        cloudckpt.load_full(s3_url, storage=options)
    _assert_clean(_all_text(denied.value), s3_server, "the load's error")
    assert fault_proxy.counters["requests"] == 1, fault_proxy.counters  # one GET, no retry
    figures.add("access denied checks")


def test_read_only_identity_cannot_save_and_does_not_retry(s3_server, s3_url, fault_proxy):
    options = storage_for(
        s3_server,
        endpoint_url=fault_proxy.endpoint_url,
        access_key_id=s3_server.readonly_access_key,
        secret_access_key=s3_server.readonly_secret_key,
    )
    with pytest.raises(errors.AccessDenied) as denied:
        cloudckpt.save(_state(), s3_url, storage=options, options=SAVE_OPTIONS)
    _assert_clean(_all_text(denied.value), s3_server, "the error")
    requests = fault_proxy.counters["requests"]
    # the existence check, then the data uploads that were in flight when the first 403 came
    # back (each refused once, never retried): nothing like an exponential storm
    assert requests <= 1 + 16, fault_proxy.counters
    with pytest.raises(errors.CheckpointNotFound):
        cloudckpt.read_manifest(s3_url, storage=storage_for(s3_server))


def test_two_ranks_with_a_wrong_secret_both_raise_access_denied(
    world2, s3_server, s3_url, fault_proxy
):
    options = storage_for(
        s3_server, endpoint_url=fault_proxy.endpoint_url, secret_access_key=WRONG_SECRET
    )
    results = world2.run(
        capture_logs_during, "save_step", s3_url, 1, 1, storage=options, options=SAVE_OPTIONS
    )
    for r in results:
        outcome = r["result"]
        assert not outcome["ok"] and "AccessDenied" in outcome["error"], outcome
        _assert_clean(outcome["message"], s3_server, "a rank's error")
        _assert_clean(r["log"], s3_server, f"the DEBUG log of rank pid {r['pid']}")
        assert "; retrying in" not in r["log"]  # cloudckpt's retry warning: none
    assert fault_proxy.counters["requests"] <= 2, fault_proxy.counters


# -- logs ------------------------------------------------------------------------------------------


@pytest.fixture
def debug_log(caplog):
    """Every record of every logger at DEBUG, formatted with exception text."""
    caplog.set_level(logging.DEBUG)
    for name in LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")

    def text() -> str:
        return "\n".join(formatter.format(r) for r in caplog.records)

    return text


def _save_load_retries_and_failures(s3_server, s3_url, fault_proxy) -> None:
    """A save and a load; the same through faults (retries logged); failing ones: a wrong secret,
    a session token the server does not know, a store that is down. Errors are checked."""
    good = storage_for(s3_server)
    cloudckpt.save(_state(), s3_url + "/a", storage=good, options=SAVE_OPTIONS)
    cloudckpt.load_full(s3_url + "/a", storage=good)
    fault_proxy.configure(
        rate=0.2, kinds=("503", "500", "reset", "truncate"), schedule=["503", "reset", "truncate"]
    )
    faulty = storage_for(s3_server, endpoint_url=fault_proxy.endpoint_url)
    cloudckpt.save(_state(), s3_url + "/b", storage=faulty, options=SAVE_OPTIONS)
    cloudckpt.load_full(s3_url + "/b", storage=faulty)
    fault_proxy.configure(rate=0.0, schedule=[])
    failing = [
        storage_for(s3_server, secret_access_key=WRONG_SECRET),
        storage_for(s3_server, session_token=SESSION_TOKEN),
        storage_for(
            s3_server,
            endpoint_url=fault_proxy.endpoint_url,
            retry=RetryOptions(max_attempts=3, base_delay=0.01),
        ),
    ]
    fault_proxy.configure(fail_all=True)
    for options in failing:
        for fn in (
            lambda options=options: cloudckpt.save(_state(), s3_url + "/c", storage=options),
            lambda options=options: cloudckpt.load_full(s3_url + "/a", storage=options),
        ):
            with pytest.raises(errors.CloudCkptError) as failed:
                fn()
            _assert_clean(_all_text(failed.value), s3_server, "an error")


def test_no_secret_key_in_debug_logs_of_save_load_retries_and_failures(
    s3_server, s3_url, fault_proxy, debug_log, figures
):
    _save_load_retries_and_failures(s3_server, s3_url, fault_proxy)
    text = debug_log()
    assert "botocore" in text and "cloudckpt" in text, "the DEBUG logs were not captured"
    assert s3_server.access_key in text  # the key id is not secret: shows the capture works
    _assert_clean(text, s3_server, "the DEBUG logs", tokens=False)
    figures.add("log records checked for secrets", text.count("\n") + 1)


def test_no_session_token_in_debug_logs(s3_server, s3_url, fault_proxy, debug_log):
    _save_load_retries_and_failures(s3_server, s3_url, fault_proxy)
    _assert_clean(debug_log(), s3_server, "the DEBUG logs", tokens=True)


def test_no_secret_in_the_debug_logs_of_a_two_rank_job(world2, s3_server, s3_url):
    results = world2.run(
        capture_logs_during,
        "save_step",
        s3_url,
        1,
        1,
        storage=storage_for(s3_server),
        options=SAVE_OPTIONS,
    )
    loads = world2.run(
        capture_logs_during, "load_step", s3_url, 1, 1, storage=storage_for(s3_server)
    )
    for r in results + loads:
        assert r["result"]["ok"], r["result"]
        assert r["records"] > 10
        _assert_clean(r["log"], s3_server, f"the DEBUG log of rank pid {r['pid']}")


# -- reprs -----------------------------------------------------------------------------------------


def test_no_secret_in_reprs(s3_server, s3_url):
    options = storage_for(s3_server, session_token=SESSION_TOKEN)
    store = open_store(s3_url, options)
    mgr = cloudckpt.CheckpointManager(s3_url, storage=options)
    texts = [
        repr(options),
        str(options),
        f"{options!r:>10}",
        repr(dataclasses.replace(options)),
        repr(store),
        repr(mgr),
        repr(s3_server),
        str(s3_server),
        repr(options.retry),
    ]
    result = cloudckpt.save({"w": torch.arange(3)}, s3_url, storage=storage_for(s3_server))
    texts.append(repr(result))
    for text in texts:
        _assert_clean(text, s3_server, f"a repr: {text[:60]}")
    assert "secret_access_key" not in repr(options) and "session_token" not in repr(options)
    with pytest.raises(errors.ConfigError) as half:
        StorageOptions(secret_access_key=WRONG_SECRET)  # no key id: refused, secret not echoed
    _assert_clean(_all_text(half.value), s3_server, "a ConfigError")


# -- the command line ----------------------------------------------------------------------------


def test_no_secret_in_cli_output(s3_server, s3_url):
    mgr = cloudckpt.CheckpointManager(s3_url, storage=storage_for(s3_server))
    mgr.save(1, {"w": torch.arange(10), "v": "x"})
    ok = [cli(s3_server, "show", s3_url, "--step", "1")]
    assert all(r.returncode == 0 for r in ok), [r.stderr for r in ok]
    failed = [
        cli(s3_server, "ls", s3_url, AWS_SECRET_ACCESS_KEY=WRONG_SECRET, CLOUDCKPT_DEBUG="1"),
        cli(
            s3_server,
            "verify",
            s3_url,
            "--step",
            "1",
            AWS_SECRET_ACCESS_KEY=WRONG_SECRET,
            AWS_SESSION_TOKEN=SESSION_TOKEN,
        ),
    ]
    assert all(r.returncode != 0 for r in failed), [r.stdout for r in failed]
    assert "Traceback" in failed[0].stderr, "CLOUDCKPT_DEBUG=1 shows a traceback"
    for r in ok + failed:
        _assert_clean(r.stdout + r.stderr, s3_server, f"cloudckpt {r.args[3]}'s output")


# -- TLS -----------------------------------------------------------------------------------------


class _NotFound(http.server.BaseHTTPRequestHandler):
    """Answers every request like S3 for a missing key."""

    body = (
        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>'
        b"<Message>no</Message></Error>"
    )

    def _answer(self, with_body: bool) -> None:
        self.server.requests += 1
        self.send_response(404)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        if with_body:
            self.wfile.write(self.body)

    def do_GET(self):  # noqa: N802 - http.server's naming
        self._answer(True)

    def do_HEAD(self):  # noqa: N802
        self._answer(False)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """An https server on 127.0.0.1 with a self-signed certificate (nobody's trusted CA)."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    server.requests = 0
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(d / "cert.pem", d / "key.pem")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"https://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_tls_verification_is_on_by_default(tls_server, s3_server):
    server, endpoint = tls_server
    assert StorageOptions().verify_tls is None  # verify, with the AWS chain of CA bundles
    base = dict(
        endpoint_url=endpoint,
        access_key_id="AKIDTLS",
        secret_access_key=WRONG_SECRET,
        region="us-east-1",
        retry=RetryOptions(max_attempts=5, base_delay=0.01),
    )
    server.requests = 0
    with pytest.raises(errors.ConfigError) as refused:  # untrusted: say how to trust a CA
        cloudckpt.read_manifest("s3://bucket/ckpt", storage=StorageOptions(**base))
    text = _all_text(refused.value)
    assert "TLS" in text or "certificate" in text.lower(), text
    assert not isinstance(refused.value, errors.RetriesExhausted)  # a TLS failure is final
    assert server.requests == 0  # the handshake failed: no request was ever served
    _assert_clean(text, s3_server, "the TLS error")
    with pytest.raises(errors.CheckpointNotFound):  # verification off: the server is reached
        cloudckpt.read_manifest(
            "s3://bucket/ckpt", storage=StorageOptions(**base, verify_tls=False)
        )
    assert server.requests >= 1
