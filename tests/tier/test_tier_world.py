"""The local tier with real ranks on one machine: 2 "nodes" of 2 ranks (each node its own tier
directory), SeaweedFS behind them. Node loss = its tier directory removed."""

from __future__ import annotations

import glob
import os
import shutil

import pytest

from tests.tier import ranks

KW = {"replicas": 1, "store_every": 2, "background": False, "keep": 2}


def _flip_byte(path: str, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_save_list_lose_a_node_corrupt_a_replica_lose_everything(world4, s3_url, tmp_path):
    root = str(tmp_path)
    listed = world4.run(ranks.save_steps, s3_url, root, 2, [1, 2, 3], KW)
    # 2 nodes, 1 replica: each node holds everything; every second step is in the store too
    assert listed[0] == [
        (2, True, ("local", "peers", "store")),
        (3, True, ("local", "peers")),
    ], listed[0]  # keep=2: step 1 pruned from the tiers (and never in the store)

    # node 1 lost: its ranks read everything from node 0's tier, exactly
    shutil.rmtree(os.path.join(root, "node1"))
    loaded = world4.run(ranks.load_latest, s3_url, root, 2, KW)
    assert all(r["equal"] and r["step"] == 3 for r in loaded), loaded
    assert all(r["failures"] == 0 for r in loaded), loaded
    assert set(loaded[2]["reads"]) == {"node 0's tier"}, loaded[2]
    assert set(loaded[0]["reads"]) == {"local tier"}, loaded[0]

    # step 4 saved again with both nodes; a flipped byte in node 1's replica of rank 0's
    # object, node 0 lost: rank 0's chunks fail in node 1's tier and come from the store
    world4.run(ranks.save_steps, s3_url, root, 2, [4], KW)
    (replica,) = glob.glob(
        os.path.join(root, "node1", "step-000000000004", "data", "*", "r00000-*")
    )
    _flip_byte(replica)
    shutil.rmtree(os.path.join(root, "node0"))
    loaded = world4.run(ranks.load_latest, s3_url, root, 2, KW)
    assert all(r["equal"] and r["step"] == 4 for r in loaded), loaded
    assert sum(r["failures"] for r in loaded) >= 1 and sum(r["healed"] for r in loaded) >= 1
    assert any("object store" in r["reads"] for r in loaded), loaded

    # step 5 in the tiers only; both nodes lost: the newest step in the store (4), exactly
    world4.run(ranks.save_steps, s3_url, root, 2, [5], KW)
    shutil.rmtree(os.path.join(root, "node0"))
    shutil.rmtree(os.path.join(root, "node1"))
    loaded = world4.run(ranks.load_latest, s3_url, root, 2, KW)
    assert all(r["equal"] and r["step"] == 4 for r in loaded), loaded
    assert all(set(r["reads"]) == {"object store"} for r in loaded), loaded


@pytest.mark.slow  # timed out once in the full parallel suite (alone: ~4 s); see the report
def test_a_smaller_world_reshards_from_the_surviving_node(world4, s3_url, tmp_path):
    root = str(tmp_path)
    kw = {**KW, "store_every": 100}  # nothing in the store: the tiers alone
    world4.run(ranks.save_steps, s3_url, root, 2, [1], kw)
    shutil.rmtree(os.path.join(root, "node1"))
    # the job restarted on node 0 alone: a world of 2 ranks (a subgroup of the 4 here)
    loaded = world4.run(ranks.load_in_group, s3_url, root, 2, kw, [0, 1])
    assert loaded[2:] == [None, None]
    assert all(r["equal"] and r["step"] == 1 for r in loaded[:2]), loaded
    assert all(set(r["reads"]) == {"local tier"} for r in loaded[:2]), loaded
