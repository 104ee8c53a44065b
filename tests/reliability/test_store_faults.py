"""Store faults through the fault proxy (cloudckpt/testing/faults/faultproxy.py), 2-rank jobs.

- At 10% mixed faults (503 SlowDown, 500, connection resets, truncated bodies, slow responses) a
  save and a load complete with exact data, and the checkpoint verifies.
- With the store down (the proxy failing everything, or a closed port), or going down in the
  middle of a save or a load, every rank raises a typed cloudckpt error once the short retry
  deadline passes (the harness's own timeout catches a hang), and nothing looks complete. When
  the store comes back, the same save succeeds.
"""

from __future__ import annotations

import socket

import pytest

import cloudckpt
from cloudckpt.errors import CheckpointNotFound
from cloudckpt.storage import RetryOptions
from cloudckpt.testing.faults.faultproxy import FaultProxy
from tests.reliability.conftest import SAVE_OPTIONS, storage_for
from tests.reliability.ranks import load_step, save_step
from tests.reliability.states import differences, full_expected

pytestmark = pytest.mark.timeout(600)

ALL_KINDS = ("503", "500", "reset", "delay", "truncate")

#: The store-down tests: give up after about two seconds, whatever the number of attempts. Only
#: for the phase that must fail: once the store is back, a job runs with the usual retries
#: (QUICK_RETRY), since a 1 s attempt limit also cuts healthy requests on a loaded CI machine
#: (one upload_part took over 1 s twice in a row there, with the other pytest worker busy).
SHORT_DEADLINE = RetryOptions(
    max_attempts=100_000, base_delay=0.01, max_delay=0.1, attempt_timeout=1.0, deadline=2.0
)
#: How long the harness waits for a rank before calling it hung (the deadline plus slack for the
#: process's other work); a rank still retrying by then fails the test.
HANG_LIMIT_S = 60.0
#: The same for the mid-load test, kept short: a rank waiting for a failed broadcast source would
#: otherwise sit out the whole collective timeout (fixed bug); the retry deadline (2 s) plus slack.
MID_LOAD_HANG_LIMIT_S = 10.0


def _committed(s3_server, url: str) -> bool:
    """Whether ``url`` holds a manifest, asked behind cloudckpt's back."""
    bucket, _, key = url[len("s3://") :].partition("/")
    client = s3_server.boto3_client()
    try:
        client.head_object(Bucket=bucket, Key=f"{key}/manifest.msgpack")
    except client.exceptions.ClientError as exc:
        if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def _round_at_fault_rate(world2, s3_server, proxy, url, rate, kinds, figures, *, seed_kinds=True):
    """One 2-rank save and load through the proxy at ``rate``; checks exact data end to end."""
    proxy.reset_counters()
    proxy.configure(
        rate=rate, kinds=kinds, delay_s=0.05, schedule=list(kinds) if seed_kinds else []
    )
    through_proxy = storage_for(s3_server, endpoint_url=proxy.endpoint_url)
    saved = world2.run(save_step, url, 7, 3, storage=through_proxy, options=SAVE_OPTIONS)
    assert all(o["ok"] for o in saved), saved
    loaded = world2.run(load_step, url, 7, 3, storage=through_proxy)
    assert [o.get("bad") for o in loaded] == [[], []], loaded
    full = cloudckpt.load_full(url, storage=through_proxy)
    assert differences(full, full_expected(2, 7, 3)) == []
    counters = proxy.counters
    proxy.configure(rate=0.0, schedule=[])
    report = cloudckpt.verify(url, storage=storage_for(s3_server))  # direct, no faults
    assert report.ok, report.problems
    figures.add("faults: requests through the proxy", counters.get("requests", 0))
    figures.add("faults: injected (failing)", counters.get("injected", 0))
    figures.add("faults: slow responses", counters.get("delay", 0))
    figures.add("faults: 2-rank save+load rounds")
    return counters


def test_save_and_load_at_ten_percent_mixed_faults(world2, s3_server, s3_url, fault_proxy, figures):
    counters = _round_at_fault_rate(
        world2, s3_server, fault_proxy, s3_url, 0.10, ALL_KINDS, figures
    )
    for kind in ALL_KINDS:  # the schedule makes sure each kind happened at least once
        assert counters.get(kind, 0) >= 1, counters
    assert counters["injected"] >= 4


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.10, 0.25])
@pytest.mark.parametrize("round_", range(5))
def test_save_and_load_under_faults_long(world2, s3_server, s3_url, figures, rate, round_):
    with FaultProxy(s3_server.endpoint_url, seed=1000 * round_ + int(rate * 100)) as proxy:
        _round_at_fault_rate(
            world2, s3_server, proxy, s3_url, rate, ALL_KINDS, figures, seed_kinds=False
        )


def test_lost_answer_to_the_conditional_create_probe(s3_server, s3_url, fault_proxy):
    """Single process: requests are (1) HEAD manifest, (2) PUT data, (3) PUT probe object: its
    answer is lost (the server stored it). Nothing was committed at ``s3_url``, so the save must
    succeed."""
    import torch

    fault_proxy.configure(schedule=[None, None, "truncate"])
    options = storage_for(s3_server, endpoint_url=fault_proxy.endpoint_url)
    cloudckpt.save({"w": torch.arange(100)}, s3_url, storage=options)
    assert torch.equal(cloudckpt.load_full(s3_url, storage=options)["w"], torch.arange(100))


def _assert_typed_failure_everywhere(outcomes: list[dict], expected: str = "RetriesExhausted"):
    for rank, outcome in enumerate(outcomes):
        assert not outcome["ok"], (rank, outcome)
        assert "CheckpointError" in outcome["error"], (rank, outcome)
        assert expected in outcome["message"], (rank, outcome)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.mark.parametrize("down", ["proxy failing everything", "closed port"])
def test_store_down_save_and_load_fail_typed_and_leave_nothing_complete(
    world2, s3_server, s3_url, fault_proxy, figures, down
):
    healthy = storage_for(s3_server)
    assert all(
        o["ok"]
        for o in world2.run(
            save_step, s3_url + "/good", 1, 1, storage=healthy, options=SAVE_OPTIONS
        )
    )
    if down == "closed port":
        endpoint = f"http://127.0.0.1:{_closed_port()}"
    else:
        fault_proxy.configure(fail_all=True, kinds=("503", "500", "reset", "truncate"))
        endpoint = fault_proxy.endpoint_url
    dead = storage_for(s3_server, endpoint_url=endpoint, retry=SHORT_DEADLINE)

    saved = world2.run(
        save_step, s3_url + "/new", 2, 1, storage=dead, options=SAVE_OPTIONS, timeout=HANG_LIMIT_S
    )
    _assert_typed_failure_everywhere(saved)
    assert all("deadline" in o["message"] for o in saved), saved
    loaded = world2.run(load_step, s3_url + "/good", 1, 1, storage=dead, timeout=HANG_LIMIT_S)
    _assert_typed_failure_everywhere(loaded)
    assert all(o["untouched"] for o in loaded), loaded  # nothing was loaded into a tensor

    assert not _committed(s3_server, s3_url + "/new")
    with pytest.raises(CheckpointNotFound):
        cloudckpt.read_manifest(s3_url + "/new", storage=healthy)
    figures.add("faults: store-down save+load rounds")


@pytest.mark.parametrize("after_requests", [3, 12])
def test_store_dying_mid_save_then_back(
    world2, s3_server, s3_url, fault_proxy, figures, after_requests
):
    """The store answers the first requests of a save, then nothing: every rank fails typed,
    nothing is complete; once it is back, a new save of the same checkpoint succeeds."""
    fault_proxy.configure(
        schedule=[None] * after_requests, fail_all=True, kinds=("503", "500", "reset")
    )
    proxied = storage_for(s3_server, endpoint_url=fault_proxy.endpoint_url, retry=SHORT_DEADLINE)
    saved = world2.run(
        save_step, s3_url, 4, 0, storage=proxied, options=SAVE_OPTIONS, timeout=HANG_LIMIT_S
    )
    _assert_typed_failure_everywhere(saved)
    assert fault_proxy.counters.get("forwarded", 0) >= min(after_requests, 3)
    assert not _committed(s3_server, s3_url)

    fault_proxy.configure(fail_all=False, schedule=[])
    back = storage_for(s3_server, endpoint_url=fault_proxy.endpoint_url)  # the usual retries
    again = world2.run(save_step, s3_url, 4, 1, storage=back, options=SAVE_OPTIONS)
    assert all(o["ok"] for o in again), again
    loaded = world2.run(load_step, s3_url, 4, 1, storage=storage_for(s3_server))
    assert [o.get("bad") for o in loaded] == [[], []], loaded
    figures.add("faults: store-dying rounds")


def test_store_dying_mid_load(world2, s3_server, s3_url, fault_proxy, figures):
    """The manifest is read, then the store stops answering: every rank fails typed (within the
    retry deadline, not the collective timeout) and no destination receives unverified bytes;
    once the store is back, the load works."""
    healthy = storage_for(s3_server)
    assert all(
        o["ok"] for o in world2.run(save_step, s3_url, 5, 0, storage=healthy, options=SAVE_OPTIONS)
    )
    fault_proxy.configure(schedule=[None], fail_all=True, kinds=("503", "500", "reset", "truncate"))
    proxied = storage_for(s3_server, endpoint_url=fault_proxy.endpoint_url, retry=SHORT_DEADLINE)
    loaded = world2.run(load_step, s3_url, 5, 0, storage=proxied, timeout=MID_LOAD_HANG_LIMIT_S)
    _assert_typed_failure_everywhere(loaded)
    fault_proxy.configure(fail_all=False, schedule=[])
    back = storage_for(s3_server, endpoint_url=fault_proxy.endpoint_url)  # the usual retries
    loaded = world2.run(load_step, s3_url, 5, 0, storage=back)
    assert [o.get("bad") for o in loaded] == [[], []], loaded
    figures.add("faults: store-dying rounds")
