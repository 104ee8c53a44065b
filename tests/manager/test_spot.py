"""SpotNoticePoller against a fake EC2 instance-metadata service on 127.0.0.1
(cloudckpt.testing.servers.imds; never the real 169.254.169.254): IMDSv2 tokens, 404 until a notice,
exactly one callback, expired tokens, a server that is down or misbehaves, a clean stop; a
notice that ends in a preemption save of the current step through PreemptionHandler and a real
CheckpointManager (world of one), and through examples/train.py --spot-notices.
"""

from __future__ import annotations

import logging
import socket
import time

import pytest
import torch

from cloudckpt import CheckpointManager
from cloudckpt.runs.preemption import Preempted, PreemptionHandler
from cloudckpt.runs.spot import (
    DEFAULT_ENDPOINT,
    ENDPOINT_ENV,
    RECOVERY_POLLS,
    SpotNoticeOptions,
    SpotNoticePoller,
)
from cloudckpt.testing.servers.imds import DEFAULT_NOTICE as NOTICE
from cloudckpt.testing.servers.imds import FakeMetadataServer as FakeIMDS

FAST = dict(interval=0.02, timeout=2.0)


def wait_until(predicate, what: str, limit: float = 60.0) -> None:
    """Wait for ``predicate()`` (a generous limit that only catches a hang)."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


class Calls:
    def __init__(self, fail: bool = False):
        self.n = 0
        self.fail = fail

    def __call__(self):
        self.n += 1
        if self.fail:
            raise RuntimeError("callback broke")


def test_notice_after_404s_calls_back_exactly_once_and_stops_polling():
    calls = Calls()
    with FakeIMDS(notice_after=4) as imds:
        poller = SpotNoticePoller(calls, options=SpotNoticeOptions(endpoint=imds.endpoint, **FAST))
        with poller:
            assert poller.wait_for_notice(60)
            wait_until(lambda: not poller.running, "the poller to end after the notice")
        assert calls.n == 1
        assert poller.notice == NOTICE
        assert imds.count("GET", 404) == 3 and imds.count("GET", 200) == 1
        assert imds.count("GET") == 4, "no poll after the notice"
        assert imds.count("PUT", 200) == 1, "one token serves every poll"
        assert imds.ttls == ["21600"]


def test_expired_token_is_renewed_and_polling_goes_on():
    calls = Calls()
    with FakeIMDS(notice_after=7, token_uses=2) as imds:
        options = SpotNoticeOptions(endpoint=imds.endpoint, token_ttl=300, **FAST)
        with SpotNoticePoller(calls, options=options) as poller:
            assert poller.wait_for_notice(60)
        assert calls.n == 1 and poller.notice == NOTICE
        assert imds.count("GET", 401) >= 3, "each token was refused after two uses"
        assert imds.count("PUT", 200) >= 4 and set(imds.ttls) == {"300"}


def test_server_down_is_logged_once_and_is_not_fatal(caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    caplog.set_level(logging.DEBUG, logger="cloudckpt.runs.spot")
    calls = Calls()
    failures = lambda: [r for r in caplog.records if "poll failed" in r.getMessage()]  # noqa: E731
    with SpotNoticePoller(calls, options=SpotNoticeOptions(endpoint=endpoint, **FAST)) as poller:
        wait_until(lambda: len(failures()) >= 4, "four failed polls")
        assert poller.running
    assert not poller.running and calls.n == 0 and poller.notice is None
    levels = [r.levelno for r in failures()]
    assert levels[0] == logging.WARNING and set(levels[1:]) == {logging.DEBUG}
    assert "refused" in failures()[0].getMessage().lower()


def test_dropped_connections_and_errors_then_recovery_then_notice(caplog):
    """Dropped connections and 5xx: one WARNING per kind, one INFO when the episode ends."""
    caplog.set_level(logging.DEBUG, logger="cloudckpt.runs.spot")
    calls = Calls()
    # the notice comes after the episode has ended: RECOVERY_POLLS good polls, then the notice
    with FakeIMDS(notice_after=RECOVERY_POLLS + 1, script=["drop", 500, "drop", 503]) as imds:
        with SpotNoticePoller(
            calls, options=SpotNoticeOptions(endpoint=imds.endpoint, **FAST)
        ) as poller:
            assert poller.wait_for_notice(60)
        assert calls.n == 1
        assert imds.count("GET", -1) == 2 and imds.count("GET", 500) == 1
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    warned = [m for lvl, m in messages if lvl == logging.WARNING and "poll failed" in m]
    assert len(warned) == 2, "one WARNING per kind: the dropped connection, the HTTP error"
    assert "connection dropped" in warned[0] and "HTTP error" in warned[1]
    assert sum(1 for lvl, m in messages if lvl == logging.INFO and "work again" in m) == 1


def test_stop_is_clean_idempotent_and_start_happens_once():
    calls = Calls()
    with FakeIMDS() as imds:  # no notice, ever
        poller = SpotNoticePoller(
            calls, options=SpotNoticeOptions(endpoint=imds.endpoint, interval=0.02)
        )
        poller.start()
        with pytest.raises(RuntimeError):
            poller.start()
        wait_until(lambda: imds.count("GET", 404) >= 3, "three polls")
        poller.stop()
        assert not poller.running
        seen = imds.count("GET")
        poller.stop()
        assert imds.count("GET") == seen and calls.n == 0 and not poller.wait_for_notice(0)


def test_a_body_that_is_not_json_is_still_a_notice():
    calls = Calls()
    with FakeIMDS(notice_after=1, notice_body="<html>stop</html>") as imds:
        with SpotNoticePoller(
            calls, options=SpotNoticeOptions(endpoint=imds.endpoint, **FAST)
        ) as poller:
            assert poller.wait_for_notice(60)
    assert calls.n == 1 and poller.notice == {"raw": "<html>stop</html>"}


def test_a_failing_callback_is_logged_and_not_called_again(caplog):
    calls = Calls(fail=True)
    with FakeIMDS(notice_after=1) as imds:
        with SpotNoticePoller(
            calls, options=SpotNoticeOptions(endpoint=imds.endpoint, **FAST)
        ) as poller:
            assert poller.wait_for_notice(60)
            wait_until(lambda: not poller.running, "the poller to end")
        assert calls.n == 1 and imds.count("GET", 200) == 1
    assert any("callback failed" in r.getMessage() for r in caplog.records)


def test_proxy_variables_are_not_used(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_proxy = f"http://127.0.0.1:{s.getsockname()[1]}"
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead_proxy)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    calls = Calls()
    with FakeIMDS(notice_after=1) as imds:
        with SpotNoticePoller(
            calls, options=SpotNoticeOptions(endpoint=imds.endpoint, **FAST)
        ) as poller:
            assert poller.wait_for_notice(60)
    assert calls.n == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(interval=0),
        dict(interval=-1),
        dict(interval=True),
        dict(timeout=0),
        dict(token_ttl=0),
        dict(token_ttl=21601),
        dict(token_ttl=1.5),
        dict(endpoint="169.254.169.254"),
        dict(endpoint="http://127.0.0.1:1/latest"),
        dict(endpoint="ftp://127.0.0.1"),
    ],
)
def test_bad_options_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SpotNoticeOptions(**kwargs)


def test_endpoint_resolution_order(monkeypatch):
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    assert SpotNoticeOptions().resolved_endpoint() == DEFAULT_ENDPOINT == "http://169.254.169.254"
    monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:9/")
    assert SpotNoticeOptions().resolved_endpoint() == "http://127.0.0.1:9"
    assert SpotNoticeOptions(endpoint="http://[::1]:8").resolved_endpoint() == "http://[::1]:8"
    monkeypatch.setenv(ENDPOINT_ENV, "not a url")
    with pytest.raises(ValueError, match=ENDPOINT_ENV):
        SpotNoticeOptions().resolved_endpoint()
    with pytest.raises(TypeError):
        SpotNoticePoller("not callable", options=SpotNoticeOptions(endpoint="http://127.0.0.1:9"))


def test_notice_leads_to_a_preemption_save_of_the_current_step(tmp_path):
    """World of one: the notice arrives during step 3; the loop stops at the next step boundary
    as after a SIGTERM, saves that step and raises Preempted; a restart resumes from it."""
    url = str(tmp_path / "run")
    mgr = CheckpointManager(url, keep_last=2)
    state = {"w": torch.zeros(8), "progress": {"step": 0}}
    with (
        FakeIMDS() as imds,
        PreemptionHandler(mgr) as preempt,
        SpotNoticePoller(
            preempt.request, options=SpotNoticeOptions(endpoint=imds.endpoint, **FAST)
        ) as poller,
    ):
        with pytest.raises(Preempted) as info:
            for step in range(1, 1000):
                state["w"] += 1
                state["progress"]["step"] = step
                if step == 2:
                    mgr.save(step, state)  # a regular save before the notice
                if step == 3:
                    imds.post_notice()
                    assert poller.wait_for_notice(60)
                    assert preempt.requested
                preempt.checkpoint_if_preempted(step, state)
    assert info.value.step == 3 and info.value.code == 143 and info.value.signum is None
    assert imds.count("GET", 200) == 1
    assert [(i.step, i.complete) for i in mgr.list()] == [(2, True), (3, True)]
    resumed = {"w": torch.zeros(8), "progress": {"step": 0}}
    assert CheckpointManager(url).load(resumed) == 3
    assert torch.equal(resumed["w"], torch.full((8,), 3.0)) and resumed["progress"]["step"] == 3


def test_train_example_stops_at_a_spot_notice(s3_env, s3_url, tmp_path):
    """examples/train.py --spot-notices (one process, the metadata endpoint from the standard
    AWS variable): the notice makes it save the current step and exit 143."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    marker = tmp_path / "preempted"
    with FakeIMDS(notice_after=1) as imds:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(root),
            ENDPOINT_ENV: imds.endpoint,
        }
        proc = subprocess.run(
            [
                sys.executable,
                str(root / "examples" / "train.py"),
                "--url",
                s3_url,
                "--steps",
                "100000",
                "--save-every",
                "100000",
                "--dim",
                "32",
                "--layers",
                "1",
                "--step-delay",
                "0.05",
                "--spot-notices",
                "--preempted-marker",
                str(marker),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert imds.count("GET", 200) == 1
    assert proc.returncode == 143, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = int(marker.read_text())
    assert f"preemption checkpoint of step {step} done" in proc.stdout
    assert "spot interruption notice" in proc.stderr
    assert [(i.step, i.complete) for i in CheckpointManager(s3_url).list()] == [(step, True)]
