"""Read once, share, in rounds (api/load_data.run_broadcasts, dataplane/broadcast.py): every
member of a group is the source of about an even share of its bytes, and in each round all the
group's sources send at once (an exchange), real gloo ranks over SeaweedFS.

Regions of uneven sizes (so sources send batches of different sizes in one round), destinations
of another dtype or not contiguous (through buffers) next to ones that take bytes in place,
groups of every rank and of some ranks in one load, and a source that fails in an exchange round
(a corrupt block): every rank raises the same error and the block's elements land nowhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cloudckpt

BLOCK = 4 << 10
BATCH = 32 << 10
LOAD = cloudckpt.LoadOptions(broadcast=True, min_broadcast_bytes=0, broadcast_batch_bytes=BATCH)
FILL = 3


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {
        "big": torch.randn(300, 257, generator=g),  # ~301 KiB, runs
        "odd": torch.randn(123, 77, generator=g).to(torch.bfloat16),  # ~18.5 KiB
        "ints": torch.randint(0, 1 << 40, (5_001,), generator=g),  # ~39 KiB
        "cols": torch.arange(64 * 256, dtype=torch.float32).reshape(64, 256),  # sliced
        "pair": torch.randn(90, 100, generator=g),  # ranks 0 and 1
        "trio": torch.randn(70, 33, generator=g).to(torch.float16),  # ranks 1, 2, 3
    }


def _wanted(rank: int, world: int) -> set[str]:
    names = {"big", "odd", "ints", "cols"}
    if rank in (0, 1):
        names.add("pair")
    if world == 4 and rank in (1, 2, 3):
        names.add("trio")
    return names


def rank_rounds(url: str, mode: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = _state()
    if mode == "save":
        cloudckpt.save(state, url, options=cloudckpt.SaveOptions(checksum_block_size=BLOCK))
        return {}
    names = _wanted(rank, world)
    dest = {k: torch.full_like(v, FILL) for k, v in state.items() if k in names}
    if rank == 1:
        dest["big"] = torch.full((300, 257), FILL, dtype=torch.float64)  # dtype converted
    if rank == 2:
        dest["odd"] = torch.full((77, 123), FILL, dtype=torch.bfloat16).t()  # not contiguous
    # every rank wants the same column slice of "cols": window batches, not runs
    cols = torch.full((64, 100), FILL, dtype=torch.float32)
    dest["cols"] = cloudckpt.GlobalPiece(cols, (64, 256), (0, 40))
    want = {k: state[k] for k in dest if k != "cols"}
    try:
        result = cloudckpt.load(dest, url, options=LOAD)
    except Exception as exc:
        big = dest["big"].reshape(-1)
        return {
            "error": " ".join(c.__name__ for c in type(exc).__mro__),
            "message": str(exc),
            "big": big.tolist(),
        }
    equal = {k: torch.equal(dest[k], v.to(dest[k].dtype)) for k, v in want.items()}
    equal["cols"] = torch.equal(cols, state["cols"][:, 40:140])
    return {"equal": equal, "fetched": result.bytes_fetched, "received": result.bytes_received}


@pytest.mark.parametrize("world_fixture", ["world3", "world4"])
def test_every_rank_sources_a_share_and_every_destination_gets_the_stored_values(
    request, s3_url, world_fixture
):
    world = request.getfixturevalue(world_fixture)
    world.run(rank_rounds, s3_url, "save")
    results = world.run(rank_rounds, s3_url, "load")
    for r in results:
        assert all(r["equal"].values()), r
    fetched = [r["fetched"] for r in results]
    # every rank is a source, and sources share the bytes evenly (sources are per window of at
    # most a batch, the largest first, each to the member that fetched least so far)
    assert min(fetched) > 0
    assert max(fetched) - min(fetched) <= 2 * BATCH, fetched
    # every stored byte wanted is read once (whole tensors and whole rows of "cols": whole
    # checksum blocks) and reaches every other rank that wants it, nothing more
    state = _state()
    wanters = {k: sum(k in _wanted(r, len(results)) for r in range(len(results))) for k in state}
    nbytes = {k: v.numel() * v.element_size() for k, v in state.items()}
    assert sum(fetched) == sum(nbytes[k] for k in state if wanters[k])
    assert sum(r["received"] for r in results) == sum(
        nbytes[k] * (wanters[k] - 1) for k in state if wanters[k]
    )


def test_a_source_failing_in_an_exchange_round_fails_every_rank_and_lands_nowhere(
    world3, s3_server, s3_env, s3_url
):
    world3.run(rank_rounds, s3_url, "save")
    manifest = cloudckpt.read_manifest(s3_url)
    chunk = max(manifest.tensors["big"].chunks, key=lambda c: c.byte_length)  # rows of "big"
    key = manifest.objects[chunk.object_index]
    client = s3_server.boto3_client()
    prefix = s3_url.split("/", 3)[3] + "/data/"
    (obj,) = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)["Contents"]
        if o["Key"].endswith(key)
    ]
    body = bytearray(client.get_object(Bucket=s3_server.bucket, Key=obj)["Body"].read())
    bad_block = chunk.byte_length // BLOCK // 2  # mid-chunk: a later round, not the first
    body[chunk.byte_offset + bad_block * BLOCK + 7] ^= 0xFF
    client.put_object(Bucket=s3_server.bucket, Key=obj, Body=bytes(body))
    results = world3.run(rank_rounds, s3_url, "load", timeout=60)
    assert len({r["message"] for r in results}) == 1, results  # the same error everywhere
    per_block = BLOCK // 4  # float32 elements of one block
    first = chunk.offsets[0] * 257 + bad_block * per_block  # a chunk of "big" is whole rows
    for r in results:
        assert "ChecksumError" in r["error"] and "CheckpointError" in r["error"], r["error"]
        assert key in r["message"]
        bad = r["big"][first : first + per_block]
        assert all(v == FILL for v in bad)  # nothing of the corrupt block reached any rank
