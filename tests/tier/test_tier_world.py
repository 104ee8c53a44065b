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


def test_a_replaced_service_is_learnt_at_the_next_exchange(world4, s3_url, tmp_path):
    """The map of nodes a process knows goes stale when a node's service is replaced (another
    port and token, a decoy on the old port): neither a load nor a save ever uses it."""
    root = str(tmp_path)
    kw = {**KW, "store_every": 100}  # the tiers alone: every read comes from a tier
    node0 = os.path.join(root, "node0")
    try:
        world4.run(ranks.save_steps, s3_url, root, 2, [1], kw)
        old = world4.run(ranks.restart_service, root, 2, 1, str(tmp_path / "decoy1"))
        assert old[:2] == [None, None] and old[2] and old[3]  # each rank serves (rank 2's: used)
        assert world4.run(ranks.known_services, s3_url, root, 2, kw)[0][1] == old[2]  # stale
        shutil.rmtree(node0)  # node 0's ranks read everything from node 1's new service
        loaded = world4.run(ranks.load_latest, s3_url, root, 2, kw)
        assert all(r["equal"] and r["step"] == 1 and r["failures"] == 0 for r in loaded), loaded
        assert set(loaded[0]["reads"]) == {"node 1's tier"}, loaded[0]
        known = world4.run(ranks.known_services, s3_url, root, 2, kw)
        assert all(k == known[0] for k in known) and known[0][1] != old[2], known

        # replaced again, then a save with the stale map: its tier space exchange learns the
        # new service and the replicas go there (node 0 lost afterwards reads them back)
        again = world4.run(ranks.restart_service, root, 2, 1, str(tmp_path / "decoy2"))
        listed = world4.run(ranks.save_steps, s3_url, root, 2, [2], kw)
        assert listed[0][-1] == (2, True, ("local", "peers")), listed[0]
        known = world4.run(ranks.known_services, s3_url, root, 2, kw)
        assert known[0][1] not in (old[2], again[2]), known
        shutil.rmtree(node0)
        loaded = world4.run(ranks.load_latest, s3_url, root, 2, kw)
        assert all(r["equal"] and r["step"] == 2 and r["failures"] == 0 for r in loaded), loaded
        assert set(loaded[1]["reads"]) == {"node 1's tier"}, loaded[1]
    finally:
        world4.run(ranks.stop_decoys)


def test_one_rank_s_tier_unusable_makes_every_rank_load_from_the_store(world4, s3_url, tmp_path):
    """The one exchange of a tiered load carries every rank's service: one rank's tier that
    cannot be used (another job's marker) leaves the tiers out on every rank, together."""
    root = str(tmp_path)
    world4.run(ranks.save_steps, s3_url, root, 2, [2, 3], KW)  # step 3: in the tiers only
    loaded = world4.run(ranks.load_with_a_foreign_rank, s3_url, root, 2, KW, 3)
    assert all(r["equal"] and r["step"] == 2 for r in loaded), loaded
    assert all(set(r["reads"]) == {"object store"} for r in loaded), loaded
    # the tiers are still whole: the next load with every rank's tier usable finds step 3
    loaded = world4.run(ranks.load_latest, s3_url, root, 2, KW)
    assert all(r["equal"] and r["step"] == 3 for r in loaded), loaded
    assert all(r["failures"] == 0 for r in loaded), loaded


def test_a_newer_step_in_the_store_only_wins_over_the_tiers(world4, s3_url, tmp_path):
    root = str(tmp_path)
    world4.run(ranks.save_steps, s3_url, root, 2, [2], KW)  # in the tiers and the store
    world4.run(ranks.save_to_store_only, s3_url, [4])  # a manager without a tier
    loaded = world4.run(ranks.load_latest, s3_url, root, 2, KW)
    assert all(r["equal"] and r["step"] == 4 for r in loaded), loaded
    assert all(set(r["reads"]) == {"object store"} for r in loaded), loaded
    loaded = world4.run(ranks.load_latest, s3_url, root, 2, KW, 2)  # asked for: from the tiers
    assert all(r["equal"] and r["step"] == 2 for r in loaded), loaded
    assert all(set(r["reads"]) == {"local tier"} for r in loaded), loaded


def test_a_rank_sending_a_malformed_inventory_fails_every_rank_alike(world4, s3_url, tmp_path):
    root = str(tmp_path)
    world4.run(ranks.save_steps, s3_url, root, 2, [1], KW)
    outcomes = world4.run(ranks.load_with_a_lying_rank, s3_url, root, 2, KW, 0)
    assert all(o is not None and o[0] == "ProtocolError" for o in outcomes), outcomes
    assert len({o[1] for o in outcomes}) == 1, outcomes  # the same error on every rank
    loaded = world4.run(ranks.load_latest, s3_url, root, 2, KW)  # nothing was left half-done
    assert all(r["equal"] and r["step"] == 1 for r in loaded), loaded
