"""Fast recovery on the simulated cluster (cloudckpt.testing.cluster): every rank of a node
SIGKILLed mid-run and its local tier wiped, then the job restarted (same and smaller world) and
resumed exactly; two neighbouring nodes lost with replicas=1: the newest step in the store.

Slow (a cluster of 4 namespaces and SeaweedFS); skipped where namespaces cannot be made."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import uuid

import pytest

from cloudckpt.testing.cluster.simulated import Cluster, ClusterUnavailable, unavailable_reason
from tests.tier import ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        unavailable_reason() is not None, reason=f"no simulated cluster: {unavailable_reason()}"
    ),
]
NODES = 4
KW = {"replicas": 1, "store_every": 3, "background": True, "keep": 2}


@pytest.fixture(scope="module")
def cluster4():
    try:
        cluster = Cluster(nodes=NODES, frontend_mbit=100.0, timeout=180.0).start()
    except ClusterUnavailable as exc:
        pytest.skip(f"no simulated cluster here: {exc}")
    yield cluster
    cluster.close()


def _kill_node_mid_run(cluster: Cluster, url: str, root: str, victim: int) -> None:
    outcome: dict = {}

    def run() -> None:
        try:
            cluster.run(ranks.train, url, root, 1, list(range(1, 40)), KW, 0.2, timeout=120)
        except BaseException as exc:  # noqa: BLE001 - expected: a rank was killed
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 90
    # kill once a few steps are in the tiers and one is in the store
    while time.monotonic() < deadline and not os.path.isdir(
        os.path.join(root, f"node{victim}", "step-000000000004")
    ):
        time.sleep(0.1)
    for rank in range(cluster.world_size):
        if cluster.node_of(rank) == victim:
            os.kill(cluster.world.pids[rank], signal.SIGKILL)
    thread.join()
    assert "error" in outcome, "the run went on without its killed node"
    shutil.rmtree(os.path.join(root, f"node{victim}"))  # the replacement node starts empty


def test_one_node_killed_and_wiped_resumes_exactly_same_and_smaller_world(cluster4, tmp_path):
    url = cluster4.info.url(f"recovery-{uuid.uuid4().hex[:8]}")
    root = str(tmp_path)
    _kill_node_mid_run(cluster4, url, root, victim=2)
    loaded = cluster4.run(ranks.load_latest, url, root, 1, KW)
    assert all(r["equal"] for r in loaded), loaded
    assert len({r["step"] for r in loaded}) == 1 and loaded[0]["step"] >= 3, loaded
    # node 2's objects came from node 3, its replica holder, not from the store
    assert "node 3's tier" in loaded[2]["reads"] and "object store" not in loaded[2]["reads"]
    # a smaller world (nodes 0, 1, 3), after node 2 is lost again: resharded from the tiers
    shutil.rmtree(os.path.join(root, "node2"), ignore_errors=True)
    smaller = cluster4.run(ranks.load_in_group, url, root, 1, KW, [0, 1, 3])
    assert smaller[2] is None
    got = [r for r in smaller if r is not None]
    assert all(r["equal"] and r["step"] == loaded[0]["step"] for r in got), got


def test_two_neighbours_lost_with_one_replica_fall_back_to_the_store(cluster4, tmp_path):
    url = cluster4.info.url(f"recovery2-{uuid.uuid4().hex[:8]}")
    root = str(tmp_path)
    kw = {**KW, "background": False}
    cluster4.run(ranks.save_steps, url, root, 1, [3, 4, 5], kw)  # 3 in the store, 4 and 5 not
    for node in (1, 2):  # node 1's objects live on nodes 1 and 2 only
        shutil.rmtree(os.path.join(root, f"node{node}"))
    loaded = cluster4.run(ranks.load_latest, url, root, 1, kw)
    assert all(r["equal"] and r["step"] == 3 for r in loaded), loaded
