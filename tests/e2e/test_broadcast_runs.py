"""Read once, broadcast, for large regions stored as one run: the source reads them straight into
its destination and broadcasts from there; receivers take them straight into theirs, or through
a buffer when their destination cannot take them in place (another dtype, not contiguous).

Small checksum blocks and broadcast batches make every region travel as several run windows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cloudckpt

BLOCK = 64 << 10
LOAD = cloudckpt.LoadOptions(broadcast_batch_bytes=192 << 10)  # 3 blocks per run window


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(512, 256, generator=g),  # 512 KiB, float32
        "b": torch.randn(300, 700, generator=g).to(torch.bfloat16),  # odd sizes, bfloat16
        "c": torch.randint(0, 1 << 40, (40_000,), generator=g),  # int64, 1-D
        "tiny": torch.arange(5.0),  # rides in a batch
    }


def rank_runs(url: str, mode: str) -> dict:
    rank = dist.get_rank()
    state = _state()
    if mode == "save":
        result = cloudckpt.save(
            state, url, options=cloudckpt.SaveOptions(checksum_block_size=BLOCK)
        )
        return {"bytes": result.bytes_written}
    dest = {k: torch.full_like(v, 3) for k, v in state.items()}
    if mode == "mixed" and rank == 1:
        dest["a"] = torch.full((256, 512), 3.0).t()  # not contiguous: through a buffer
        dest["b"] = torch.full((300, 700), 3.0)  # float32 from bfloat16
    try:
        result = cloudckpt.load(dest, url, options=LOAD)
    except Exception as exc:  # the corrupt case checks the error and what stayed untouched
        untouched = {k: bool((dest[k] == 3).all()) for k in ("a", "b", "c")}
        return {
            "error": " ".join(c.__name__ for c in type(exc).__mro__),
            "untouched": untouched,
            "equal": {k: torch.equal(dest[k], state[k].to(dest[k].dtype)) for k in state},
        }
    equal = {k: torch.equal(dest[k], state[k].to(dest[k].dtype)) for k in state}
    return {
        "equal": equal,
        "fetched": result.bytes_fetched,
        "received": result.bytes_received,
        "broadcasts": result.broadcasts,
    }


@pytest.fixture
def saved_runs(world2, s3_url):
    saved = world2.run(rank_runs, s3_url, "save")
    state = _state()
    unique = sum(t.numel() * t.element_size() for t in state.values())
    assert saved[0]["bytes"] == unique
    return s3_url, unique


@pytest.mark.parametrize("mode", ["load", "mixed"])
def test_large_replicated_regions_are_read_once_and_land_everywhere(world2, saved_runs, mode):
    url, unique = saved_runs
    results = world2.run(rank_runs, url, mode)
    for r in results:
        assert all(r["equal"].values()), r
    # every byte read once (the tiny tensor's too: it travels in the group's batches)
    assert sum(r["fetched"] for r in results) == unique
    assert sum(r["received"] for r in results) == unique
    assert all(r["received"] > 0 for r in results)  # both ranks are sources
    assert all(r["broadcasts"] >= 8 for r in results)  # several windows per region


def test_corrupt_block_in_a_run_fails_every_rank_and_spares_its_elements(
    world2, s3_server, s3_env, saved_runs
):
    url, _ = saved_runs
    client = s3_server.boto3_client()
    prefix = url.split("/", 3)[3] + "/data/"
    keys = [
        o["Key"] for o in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)["Contents"]
    ]
    manifest = cloudckpt.read_manifest(url)
    chunk = manifest.tensors["a"].chunks[0]
    key = manifest.objects[chunk.object_index]
    (obj,) = [k for k in keys if k.endswith(key)]
    body = bytearray(client.get_object(Bucket=s3_server.bucket, Key=obj)["Body"].read())
    body[chunk.byte_offset + 10] ^= 0xFF  # first block of "a"
    client.put_object(Bucket=s3_server.bucket, Key=obj, Body=bytes(body))
    results = world2.run(rank_runs, url, "load")
    for r in results:
        assert "ChecksumError" in r["error"] and "CheckpointError" in r["error"], r
        assert not r["equal"]["a"]
    # the corrupted block's elements of "a" were never written on either rank: its first row
    # (256 float32 = 1 KiB, inside the first 64 KiB block) still holds the fill value
    first_rows = world2.run(_first_row_untouched, url)
    assert first_rows == [True, True]


def _first_row_untouched(url: str) -> bool:
    dest = {k: torch.full_like(v, 3) for k, v in _state().items()}
    try:
        cloudckpt.load(dest, url, options=LOAD)
    except Exception:
        pass
    return bool((dest["a"][0] == 3).all())
