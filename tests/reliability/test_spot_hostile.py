"""The spot notice poller against a metadata endpoint that misbehaves on purpose
(cloudckpt.testing.servers.imds: a real HTTP server on 127.0.0.1; the real 169.254.169.254 is never
contacted): answers dripped or stalled, bodies that never end, garbage, resets, redirects,
failures that come and go. Whatever it answers, every request ends at its deadline, ``stop()``
returns within a second, memory stays bounded, the thread never dies and a notice is still
acted on; a failure that flaps warns once per kind per unhealthy episode.
"""

from __future__ import annotations

import logging
import threading
import time
import tracemalloc

import pytest

from cloudckpt.runs.spot import RECOVERY_POLLS, SpotNoticeOptions, SpotNoticePoller
from cloudckpt.testing.servers.imds import DEFAULT_NOTICE as NOTICE
from cloudckpt.testing.servers.imds import FakeMetadataServer as FakeIMDS

FAST = dict(interval=0.02)


class Calls:
    def __init__(self):
        self.n = 0

    def __call__(self):
        self.n += 1


def wait_until(predicate, what: str, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def warnings_of(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "poll failed" in r.getMessage()
    ]


def timed_stop(poller: SpotNoticePoller) -> float:
    """Seconds ``stop()`` took; a stop still running after 10 s counts as 10 s (old code hung)."""
    began = time.monotonic()
    stopper = threading.Thread(target=poller.stop, daemon=True)
    stopper.start()
    stopper.join(10)
    return time.monotonic() - began


@pytest.mark.parametrize("answer", ["drip", "interim", "stall"])
def test_stop_returns_within_a_second_while_a_request_hangs(answer):
    """A request in progress that would last 30 s (its deadline) or forever (dripped bytes,
    endless ``100 Continue``): ``stop()`` returns within a second, the thread has ended."""
    with FakeIMDS(script=[answer]) as imds:
        poller = SpotNoticePoller(
            Calls(), options=SpotNoticeOptions(endpoint=imds.endpoint, timeout=30.0, **FAST)
        ).start()
        assert poller._thread.daemon, "the thread must never keep the process alive"
        wait_until(lambda: imds.count("GET", answer) == 1, "the GET to hang")
        time.sleep(0.2)  # well inside the request
        took = timed_stop(poller)
        assert took < 1.5, f"stop() took {took:.2f} s"
        assert not poller.running


@pytest.mark.parametrize("answer", ["drip", "interim", "stall"])
def test_a_hanging_answer_ends_at_the_deadline_and_the_notice_still_comes(answer, caplog):
    """Each request ends at its total deadline (0.3 s here), however the bytes come; the next
    polls go on and the notice is acted on."""
    calls = Calls()
    with FakeIMDS(script=[answer, answer], put_script=[answer], notice_after=1) as imds:
        options = SpotNoticeOptions(endpoint=imds.endpoint, timeout=0.3, **FAST)
        with SpotNoticePoller(calls, options=options) as poller:
            assert poller.wait_for_notice(15), "a hanging request held the poller up"
        assert calls.n == 1 and poller.notice == NOTICE
        assert imds.count("GET", answer) == 2 and imds.count("PUT", answer) == 1
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "timed out" in warned[0] and "0.3 s deadline" in warned[0]


def test_endless_bodies_cost_bounded_memory_and_a_200_is_still_a_notice():
    """A token answer and a notice answer whose bodies never end (1 TiB announced, sent as
    fast as they are read): the token is refused, the notice is acted on, each read stops at
    its limit (what crosses the socket is what the kernel's buffers take: about 8 MiB
    measured) and traced memory stays under 4 MiB (0.3 MiB measured)."""
    calls = Calls()
    with FakeIMDS(put_script=["huge"], script=["huge"]) as imds:
        tracemalloc.start()
        try:
            with SpotNoticePoller(
                calls, options=SpotNoticeOptions(endpoint=imds.endpoint, timeout=5.0, **FAST)
            ) as poller:
                assert poller.wait_for_notice(15)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        sent = imds.sent_bytes
    assert calls.n == 1 and imds.count("PUT", "huge") == 1
    assert poller.notice == {"raw": "0" * 1000}
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB traced"
    assert sent < 64 * 2**20, f"{sent / 2**20:.0f} MiB were sent: the reads did not stop"


def test_garbage_answers_never_end_the_thread_and_a_nested_body_is_still_a_notice(caplog):
    """An answer that is not HTTP, a token holding a line break and a header, then a notice
    whose body nests 100 000 ``[`` (past the JSON parser's stack: it ended the thread before):
    each failure is logged, the notice is acted on as ``{"raw": ...}``."""
    calls = Calls()
    with FakeIMDS(put_script=["garbage", "badtoken"], script=["garbage", "nested"]) as imds:
        with SpotNoticePoller(
            calls, options=SpotNoticeOptions(endpoint=imds.endpoint, timeout=5.0, **FAST)
        ) as poller:
            assert poller.wait_for_notice(15), "the poller thread died"
            wait_until(lambda: not poller.running, "the poller to end after the notice")
        assert imds.count("GET", "garbage") == 1 and imds.count("GET", "nested") == 1
        assert imds.count("PUT", "badtoken") == 1
    assert calls.n == 1 and poller.notice == {"raw": "[" * 1000}
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "not HTTP" in warned[0], warned
    assert not any("unexpected" in m for m in warned)


def test_a_reset_inside_a_200_is_still_a_notice():
    """The notice's answer cut by a TCP reset mid-body: the 200 was seen, the notice acted on."""
    calls = Calls()
    with FakeIMDS(script=["reset"]) as imds:
        with SpotNoticePoller(
            calls, options=SpotNoticeOptions(endpoint=imds.endpoint, timeout=5.0, **FAST)
        ) as poller:
            assert poller.wait_for_notice(15)
        assert imds.count("GET", "reset") == 1 and imds.count("GET") == 1
    assert calls.n == 1 and poller.notice == {"raw": '{"action": "term'}


def test_redirects_are_not_followed(caplog):
    """A 302 to another server: a failure, never a request (with the token) to that server."""
    with (
        FakeIMDS(notice_after=1) as elsewhere,
        FakeIMDS(script=["redirect"] * 3, redirect_to=elsewhere.endpoint) as imds,
    ):
        with SpotNoticePoller(
            Calls(), options=SpotNoticeOptions(endpoint=imds.endpoint, timeout=5.0, **FAST)
        ):
            wait_until(lambda: imds.count("GET", "redirect") == 3, "three redirects")
            wait_until(lambda: imds.count("GET", 404) >= 1, "a normal poll after them")
        assert elsewhere.count("GET") == 0 and elsewhere.count("PUT") == 0
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "HTTP 302" in warned[0]


def test_a_get_refused_with_a_4xx_drops_the_token():
    """A 400 or 431 to the notice GET (the token may be what is refused): the next poll asks
    for a new token instead of sending the same one for its six hours."""
    calls = Calls()
    with FakeIMDS(script=[400, 431], notice_after=1) as imds:
        with SpotNoticePoller(
            calls, options=SpotNoticeOptions(endpoint=imds.endpoint, timeout=5.0, **FAST)
        ) as poller:
            assert poller.wait_for_notice(15)
        assert imds.count("PUT", 200) == 3 and imds.count("GET") == 3
    assert calls.n == 1


def test_a_failure_that_flaps_warns_once_per_kind_per_episode(caplog):
    """Errors and dropped connections between good polls: one WARNING per kind, however often
    they come back, until RECOVERY_POLLS good polls in a row end the episode (one INFO); the
    next failure starts a new episode with a new WARNING."""
    caplog.set_level(logging.DEBUG, logger="cloudckpt.runs.spot")
    flaps = [500, "ok", 503, "ok", "drop", "ok", 500, "ok", "drop", 502, "ok"] * 3
    script = flaps + ["ok"] * RECOVERY_POLLS + [500, "drop"]
    good = script.count("ok")
    calls = Calls()
    with FakeIMDS(script=script, notice_after=good + 2) as imds:
        with SpotNoticePoller(
            calls, options=SpotNoticeOptions(endpoint=imds.endpoint, timeout=5.0, **FAST)
        ) as poller:
            assert poller.wait_for_notice(30)
        assert imds.count("GET", 500) == 7 and imds.count("GET", -1) == 7
    assert calls.n == 1
    warned = warnings_of(caplog)
    kinds = [m.split("(")[1].split(";")[0] for m in warned]
    assert kinds == ["HTTP error", "connection dropped", "HTTP error", "connection dropped"], warned
    infos = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "work again" in r.getMessage()
    ]
    assert len(infos) == 1
    debug = [
        r for r in caplog.records if r.levelno == logging.DEBUG and "failed again" in r.getMessage()
    ]
    assert len(debug) == 3 * 6 - 2


def test_a_host_name_endpoint_is_resolved_within_the_deadline():
    """``localhost`` (resolved in a helper thread: the resolver has no timeout of its own; may
    resolve to ::1 first, where nothing listens): the next address is tried, the notice comes."""
    calls = Calls()
    with FakeIMDS(notice_after=2) as imds:
        endpoint = imds.endpoint.replace("127.0.0.1", "localhost")
        with SpotNoticePoller(calls, options=SpotNoticeOptions(endpoint=endpoint, **FAST)) as p:
            assert p.wait_for_notice(15)
    assert calls.n == 1 and p.notice == NOTICE


def test_https_endpoint_verified_and_polled(tmp_path, monkeypatch, caplog):
    """An ``https://`` endpoint: the certificate is checked (an unknown CA is a ``TLS``
    failure, logged, not raised), then with the CA trusted the notice comes."""
    from cloudckpt.testing.servers.tlsca import make_tls_files

    tls = make_tls_files(tmp_path)
    calls = Calls()
    with FakeIMDS(notice_after=1, tls=tls) as imds:
        options = SpotNoticeOptions(endpoint=imds.endpoint, timeout=5.0, **FAST)
        with SpotNoticePoller(calls, options=options) as poller:
            wait_until(lambda: warnings_of(caplog), "the certificate to be refused")
        assert calls.n == 0 and "(TLS;" in warnings_of(caplog)[0]
        monkeypatch.setenv("SSL_CERT_FILE", tls.ca_file)
        with SpotNoticePoller(calls, options=options) as poller:
            assert poller.wait_for_notice(15)
    assert calls.n == 1 and poller.notice == NOTICE


@pytest.mark.parametrize("length", [b"\xb2", b"1\xb2", b"\xd9\xa3", b"+5", b"5 5", b"x"])
def test_a_content_length_that_is_not_ascii_digits_is_a_typed_failure(length):
    """The head's numbers are HTTP's (ASCII digits, :mod:`cloudckpt.http_numbers`): a
    Content-Length of ``²`` (latin-1 0xb2, which ``str.isdigit`` takes) or of other scripts' digits
    is "not HTTP", never a bare ``ValueError`` from ``int()``."""
    import socket

    from cloudckpt.runs.spot_http import Deadline, RequestFailed, exchange

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\nbody")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(RequestFailed, match="Content-Length"):
            exchange(
                f"http://127.0.0.1:{port}",
                "GET",
                "/latest/meta-data/spot/instance-action",
                {},
                deadline=Deadline(5.0, threading.Event()),
                max_body=1 << 16,
            )
    finally:
        thread.join(5)
        server.close()
