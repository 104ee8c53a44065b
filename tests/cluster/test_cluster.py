"""The simulated cluster (cloudckpt.testing.cluster.simulated): namespaces with shaped links, one
store.

Skipped where network namespaces cannot be created (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from cloudckpt.testing.cluster.simulated import Cluster, ClusterUnavailable, unavailable_reason
from cloudckpt.testing.cluster.watchdog import namespace_pids, run_dir, run_namespaces, sweep_stale
from tests.cluster import ranks

REPO = Path(__file__).resolve().parents[2]
NODES = 4
FRONTEND_MBIT = 50.0

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"no simulated cluster here: {unavailable_reason()}"
)


@pytest.fixture(scope="module")
def cluster4():
    try:
        cluster = Cluster(nodes=NODES, frontend_mbit=FRONTEND_MBIT, timeout=120.0).start()
    except ClusterUnavailable as exc:
        pytest.skip(f"no simulated cluster here: {exc}")
    yield cluster
    cluster.close()


def _url(cluster: Cluster, name: str) -> str:
    return cluster.info.url(f"{name}-{uuid.uuid4().hex[:8]}")


def _host_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    return sorted(line.split(":")[1].strip() for line in out.stdout.splitlines())


def test_ranks_run_in_their_nodes_with_private_routes_only(cluster4):
    where = cluster4.run(ranks.whereami)
    assert [w["node"] for w in where] == list(range(NODES))
    assert len({w["netns"] for w in where}) == NODES  # one namespace per node
    assert {w["sum"] for w in where} == {NODES * (NODES + 1) / 2}  # gloo over the backend
    assert {w["gloo_if"] for w in where} == {"be0"}
    assert {w["endpoint"] for w in where} == {cluster4.info.endpoint_url}
    assert cluster4.info.endpoint_url.startswith("http://10.213.1.254:")
    for ns, lines in cluster4.routes().items():
        assert not [line for line in lines if line.startswith("default")], ns
        for line in lines:  # only the run's private subnets and loopback
            assert any(net in line for net in ("10.213.1.", "10.213.2.", "127.")), (ns, line)


def test_four_node_round_trip_is_exact(cluster4):
    url = _url(cluster4, "roundtrip")
    before = cluster4.link_bytes()
    written = cluster4.run(ranks.save_state, url, 7, 256)
    loaded = cluster4.run(ranks.load_and_compare, url, 7, 256)
    after = cluster4.link_bytes()
    assert all(r["equal"] for r in loaded), loaded
    assert len(set(written)) == 1 and written[0] > 0  # every rank reports the whole save
    # the bytes went over the nodes' frontend links
    sent = sum(a["frontend"]["tx"] - b["frontend"]["tx"] for a, b in zip(after, before))
    assert sent >= written[0]


_DRIVER = """
import json, sys, time
from cloudckpt.testing.cluster.simulated import Cluster
from tests.cluster import ranks
cluster = Cluster(nodes=2, ranks_per_node=2, frontend_mbit=100).start()
print(json.dumps({"prefix": cluster.prefix, "pids": cluster.world.pids,
                  "server_pid": cluster.server_pid, "where": cluster.run(ranks.whereami)}),
      flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def test_two_ranks_per_node_and_everything_removed_after_the_driver_is_killed():
    host_links = _host_links()
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER], cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        line = driver.stdout.readline()
        assert line, "the driver did not start its cluster"
        started = json.loads(line)
        prefix = started["prefix"]
        names = run_namespaces(prefix)
        assert len(names) == 4  # switch, store, 2 nodes
        inside = set(namespace_pids(names))
        assert started["server_pid"] in inside and set(started["pids"]) <= inside
        where = started["where"]  # 2 ranks per node: one namespace per node, local ranks 0, 1
        assert [(w["node"], w["local_rank"]) for w in where] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert where[0]["netns"] == where[1]["netns"] != where[2]["netns"] == where[3]["netns"]
        assert {w["sum"] for w in where} == {10.0}
        assert os.path.isdir(run_dir(prefix))
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        driver.stdout.close()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if (
            not run_namespaces(prefix)
            and not any(_alive(p) for p in inside)
            and not os.path.exists(run_dir(prefix))
        ):
            break
        time.sleep(0.2)
    assert run_namespaces(prefix) == []
    assert [p for p in inside if _alive(p)] == []
    assert not os.path.exists(run_dir(prefix))
    assert _host_links() == host_links  # nothing was ever added to the machine's namespace


def test_stale_runs_of_dead_owners_are_swept_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid names a run whose owner is gone
    stale, live = f"ckc{dead.pid}x5a1e", f"ckc{os.getpid()}x11fe"
    for name in (f"{stale}-n0", f"{live}-n0"):
        subprocess.run(["ip", "netns", "add", name], check=True)
    os.mkdir(run_dir(stale))
    try:
        assert stale in sweep_stale()
        assert run_namespaces(stale) == [] and not os.path.exists(run_dir(stale))
        assert run_namespaces(live) == [f"{live}-n0"]  # its owner (this process) is alive
    finally:
        for name in (f"{stale}-n0", f"{live}-n0"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_weed_listens_elsewhere_than_loopback_only_inside_a_named_namespace():
    from cloudckpt.testing.servers.seaweed.server import S3Server

    with pytest.raises(ValueError, match="network namespace"):
        S3Server(host="10.213.1.254")  # this process runs in the machine's own namespace
    with pytest.raises(ValueError, match="not an IPv4 address"):
        S3Server(host="localhost")


def test_no_root_no_cluster(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in unavailable_reason()
    cluster = Cluster(nodes=2)
    with pytest.raises(ClusterUnavailable, match="root"):
        cluster.start()
    assert run_namespaces(cluster.prefix) == [] and not os.path.exists(run_dir(cluster.prefix))


# Limits of the save whose node loses its link: a stalled upload is given up after
# `attempt_timeout`, the whole write after `deadline`; the other ranks wait in the collective
# (SaveOptions.timeout, longer) for the failing rank's report.
RETRY = {
    "max_attempts": 4,
    "base_delay": 0.05,
    "max_delay": 0.5,
    "connect_timeout": 2.0,
    "read_timeout": 4.0,
    "attempt_timeout": 8.0,
    "deadline": 15.0,
}
COLLECTIVE_TIMEOUT = 90.0
FAIL_BOUND_S = RETRY["deadline"] + 30.0  # the run's limit: failing later is a hang


@pytest.mark.slow
@pytest.mark.parametrize("fault", [{"down": True}, {"loss": 100}], ids=["cable-pulled", "loss-100"])
def test_a_node_losing_its_link_mid_save_fails_every_rank_together(cluster4, fault):
    previous = _url(cluster4, "before-drop")
    cluster4.run(ranks.save_state, previous, 3, 256)
    url = _url(cluster4, "link-drop")
    outcome: dict = {}

    def save() -> None:
        try:
            outcome["results"] = cluster4.run(
                ranks.save_expecting_failure,
                url,
                5,
                12_000,
                RETRY,
                COLLECTIVE_TIMEOUT,
                timeout=FAIL_BOUND_S,
            )
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    victim = 2
    start = cluster4.link_bytes()[victim]["frontend"]["tx"]
    thread = threading.Thread(target=save)
    thread.start()
    try:
        # pull the cable once the victim is uploading (its frontend has sent 1 MiB of the save)
        while thread.is_alive() and cluster4.link_bytes()[victim]["frontend"]["tx"] - start < (
            1 << 20
        ):
            time.sleep(0.05)
        cluster4.set_link(victim, **fault)
        thread.join()
    finally:
        cluster4.set_link(victim, down=False, loss=0)
    assert "error" not in outcome, outcome.get("error")
    results = outcome["results"]
    assert all(r["raised"] for r in results), results
    assert len({r["raised"] for r in results}) == 1, results  # the same error everywhere
    assert all(victim in r["failed_ranks"] for r in results), results
    # the checkpoint before is intact, the failed one was never committed
    assert all(r["equal"] for r in cluster4.run(ranks.load_and_compare, previous, 3, 256))
    assert set(cluster4.run(ranks.try_load, url, 5, 256)) == {"CheckpointNotFound"}
