"""End-to-end save and load on real gloo worlds, against SeaweedFS and file://.

Rank functions live at module level so the harness can run them on its workers.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import cloudckpt
from tests.e2e.states import build_state, check_state, full_state_expected


def _rank() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def rank_save(url: str) -> dict:
    rank, world = _rank()
    result = cloudckpt.save(build_state(world, rank), url)
    return {"bytes": result.bytes_written, "objects": result.objects}


def rank_load_and_check(url: str) -> list[str]:
    rank, world = _rank()
    sd = build_state(world, rank, blank=True)
    cloudckpt.load(sd, url)
    return check_state(sd)


def rank_expect_error(url: str, action: str) -> str:
    """Run a failing operation; return the error's class names (the harness needs a result)."""
    rank, world = _rank()
    try:
        if action == "missing":
            sd = build_state(world, rank, blank=True)
            sd["not_in_ckpt"] = torch.zeros(3)
            cloudckpt.load(sd, url)
        elif action == "shape":
            sd = build_state(world, rank, blank=True)
            sd["plain_bool"] = torch.zeros(8, dtype=torch.bool)
            cloudckpt.load(sd, url)
        elif action == "corrupt":
            cloudckpt.load(build_state(world, rank, blank=True), url)
        elif action == "stateful":
            sd = build_state(world, rank)
            sd["bomb"] = _Bomb(explode=(rank == 1))
            cloudckpt.save(sd, url)
        elif action == "exists":
            cloudckpt.save(build_state(world, rank), url)
    except Exception as exc:  # the test asserts the exact types below
        return " ".join(c.__name__ for c in type(exc).__mro__)
    return "no error"


class _Bomb:
    def __init__(self, explode: bool):
        self.explode = explode

    def state_dict(self):
        if self.explode:
            raise RuntimeError("state_dict exploded on purpose")
        return {"x": 1}

    def load_state_dict(self, sd):
        pass


# -- model + optimizer state across world sizes ------------------------------------------------


@pytest.fixture(scope="module")
def saved_w2(world2, s3_server):
    url = s3_server.url(f"e2e-{os.getpid()}/w2")
    world2.run(rank_save, url)
    return url


@pytest.mark.parametrize("world_fixture", ["world2", "world3", "world4"])
def test_world2_checkpoint_loads_on_other_worlds(saved_w2, world_fixture, request):
    world = request.getfixturevalue(world_fixture)
    results = world.run(rank_load_and_check, saved_w2)
    assert results == [[]] * world.world_size


def test_world2_checkpoint_loads_on_one_process_without_dist(saved_w2, s3_env):
    expected = full_state_expected()
    full = cloudckpt.load_full(saved_w2)
    assert full["meta"] == expected["meta"]
    assert full["opt"]["param_groups"] == expected["opt"]["param_groups"]
    for name in (
        "dt_shard0",
        "dt_shard1",
        "dt_rep",
        "explicit",
        "ragged",
        "plain_bool",
        "plain_noncontig",
        "plain_empty",
        "plain_scalar",
    ):
        assert full[name].dtype == expected[name].dtype, name
        assert torch.equal(full[name], expected[name]), name
    assert torch.equal(full["opt"]["state"][0]["exp_avg"], expected["opt"]["state"][0]["exp_avg"])

    # and `load` with plain full tensors, in this process, with torch.distributed not initialised
    sd = {name: torch.zeros_like(t) for name, t in expected.items() if isinstance(t, torch.Tensor)}
    result = cloudckpt.load(sd, saved_w2, strict=False)
    for name, t in sd.items():
        assert torch.equal(t, expected[name]), name
    assert "meta.epoch" in result.unexpected_keys or any(
        k.startswith("meta") for k in result.unexpected_keys
    )


def test_world4_checkpoint_loads_on_world2(world4, world2, s3_server):
    url = s3_server.url(f"e2e-{os.getpid()}/w4")
    world4.run(rank_save, url)
    assert world2.run(rank_load_and_check, url) == [[], []]


def test_file_url_roundtrip(world2, tmp_path):
    url = (tmp_path / "ckpt").as_uri()
    world2.run(rank_save, url)
    assert world2.run(rank_load_and_check, url) == [[], []]
    assert world2.run(rank_load_and_check, str(tmp_path / "ckpt")) == [[], []]


# -- replicated state: written once, read once ---------------------------------------------------


def rank_replicated(url: str, mode: str) -> dict:
    rank, world = _rank()
    g = torch.Generator().manual_seed(1)
    state = {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(8)}
    state["tiny"] = torch.arange(4.0)
    if mode == "save":
        result = cloudckpt.save(state, url)
        return {"bytes": result.bytes_written}
    blank = {k: torch.zeros_like(v) for k, v in state.items()}
    # "load-slabs": tiny broadcast batches, so every 256 KiB region travels as 64 KiB slabs
    options = (
        cloudckpt.LoadOptions(broadcast_batch_bytes=64 << 10) if mode == "load-slabs" else None
    )
    result = cloudckpt.load(blank, url, options=options)
    ok = all(torch.equal(blank[k], state[k]) for k in state)
    return {"ok": ok, "fetched": result.bytes_fetched, "received": result.bytes_received}


def test_replicated_state_is_written_once_and_read_once(world2, s3_url):
    unique = 8 * 256 * 256 * 4 + 4 * 4
    saved = world2.run(rank_replicated, s3_url, "save")
    assert saved[0]["bytes"] == unique
    loaded = world2.run(rank_replicated, s3_url, "load")
    assert all(r["ok"] for r in loaded)
    # every region, the 16-byte one included (it travels in the group's batches), is read
    # once and received by the other rank
    assert sum(r["fetched"] for r in loaded) == unique
    assert all(r["received"] > 0 for r in loaded)
    assert sum(r["received"] for r in loaded) == unique
    slabs = world2.run(rank_replicated, s3_url, "load-slabs")
    assert all(r["ok"] for r in slabs)
    assert [r["fetched"] for r in slabs] == [r["fetched"] for r in loaded]


def rank_small_replicated(url: str, mode: str) -> dict:
    state = {f"t{i}": torch.arange(4.0) + i for i in range(3)}  # 48 bytes shared in all
    if mode == "save":
        return {"bytes": cloudckpt.save(state, url).bytes_written}
    blank = {k: torch.zeros_like(v) for k, v in state.items()}
    result = cloudckpt.load(blank, url)
    return {
        "ok": all(torch.equal(blank[k], state[k]) for k in state),
        "fetched": result.bytes_fetched,
        "received": result.bytes_received,
        "broadcasts": result.broadcasts,
    }


def test_a_group_sharing_fewer_bytes_than_the_threshold_reads_them_on_every_rank(world2, s3_url):
    """``min_broadcast_bytes`` counts what a group shares in all: 48 bytes are not worth a
    round of collectives, so each rank reads them itself."""
    assert world2.run(rank_small_replicated, s3_url, "save")[0]["bytes"] == 48
    loaded = world2.run(rank_small_replicated, s3_url, "load")
    assert [(r["ok"], r["fetched"], r["received"], r["broadcasts"]) for r in loaded] == [
        (True, 48, 0, 0)
    ] * 2


def test_replicated_state_on_a_local_store_is_read_by_every_rank(world2, tmp_path):
    """The broadcast default follows the store's ``remote`` capability: none for file://."""
    url = str(tmp_path / "ckpt")
    world2.run(rank_replicated, url, "save")
    loaded = world2.run(rank_replicated, url, "load")
    assert all(r["ok"] for r in loaded)
    assert all(r["fetched"] == 8 * 256 * 256 * 4 + 4 * 4 for r in loaded)
    assert all(r["received"] == 0 for r in loaded)


# -- errors, the same on every rank ---------------------------------------------------------------


def test_missing_key_fails_on_every_rank(world2, saved_w2):
    names = world2.run(rank_expect_error, saved_w2, "missing")
    assert all("MissingKeysError" in n and "CheckpointError" in n for n in names), names


def test_shape_mismatch_fails_on_every_rank(world2, saved_w2):
    names = world2.run(rank_expect_error, saved_w2, "shape")
    assert all("ShapeMismatchError" in n for n in names), names


def test_exception_in_state_dict_on_one_rank_fails_every_rank(world2, s3_url):
    names = world2.run(rank_expect_error, s3_url, "stateful")
    assert all("CheckpointError" in n for n in names), names
    assert world2.run(_has_manifest, s3_url) == [False, False]


def _has_manifest(url: str) -> bool:
    try:
        cloudckpt.read_manifest(url)
    except FileNotFoundError:
        return False
    return True


def test_second_save_to_same_name_raises_checkpoint_exists(world2, s3_url):
    world2.run(rank_save, s3_url)
    names = world2.run(rank_expect_error, s3_url, "exists")
    assert all("CheckpointExists" in n for n in names), names
    assert world2.run(rank_load_and_check, s3_url) == [[], []]


def test_corrupted_data_object_is_detected_on_every_rank(world2, s3_server, s3_url):
    world2.run(rank_save, s3_url)
    client = s3_server.boto3_client()
    prefix = s3_url.split("/", 3)[3] + "/data/"
    keys = [
        o["Key"] for o in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)["Contents"]
    ]
    for key in keys:
        body = bytearray(client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
        if body:
            body[len(body) // 2] ^= 0xFF
            client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(body))
    names = world2.run(rank_expect_error, s3_url, "corrupt")
    assert all("ChecksumError" in n for n in names), names


# -- ranks holding different keys (pipeline stages) ---------------------------------------------


def rank_pipeline_stage(url: str) -> None:
    rank, _ = _rank()
    stage = {f"stage{rank}": {"w": torch.full((3,), float(rank)), "meta": {"id": rank}}}
    cloudckpt.save({"shared": torch.ones(2), **stage}, url)


def test_ranks_with_different_keys_restore_the_union_of_structures(world2, s3_url, s3_env):
    world2.run(rank_pipeline_stage, s3_url)
    full = cloudckpt.load_full(s3_url)
    assert set(full) == {"shared", "stage0", "stage1"}
    assert torch.equal(full["stage1"]["w"], torch.full((3,), 1.0))
    assert full["stage0"]["meta"] == {"id": 0} and full["stage1"]["meta"] == {"id": 1}


def rank_plan_cache_votes(root: str) -> list[bool]:
    """Three saves of one layout: the second reuses the cached plan; before the third, rank 1
    forgets its plans (a restarted rank), so every rank re-plans; the fourth reuses again, and a
    fifth, where rank 0 disables the cache, re-plans everywhere."""
    from cloudckpt.runtime.context import current

    rank, world = _rank()
    current().save_plans.clear()
    cached = []
    for i in range(5):
        if i == 2 and rank == 1:
            current().save_plans.clear()
        options = cloudckpt.SaveOptions(use_plan_cache=not (i == 4 and rank == 0))
        result = cloudckpt.save(build_state(world, rank), f"{root}/{i}", options=options)
        cached.append(result.plan_cached)
    return cached


def test_plan_cache_is_reused_only_when_every_rank_holds_the_plan(world2, s3_url):
    results = world2.run(rank_plan_cache_votes, s3_url)
    assert results == [[False, True, False, True, False]] * 2
    for i in range(5):
        assert world2.run(rank_load_and_check, f"{s3_url}/{i}") == [[], []]
