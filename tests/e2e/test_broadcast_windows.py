"""Read once, broadcast, for regions that are not one stored run (a column slice of a row-major
chunk): they travel as batches of checksum-aligned windows through pooled buffers. Whatever the
read budget, a source fetches every batch before it broadcasts it (a budget smaller than two
batches only stops it from fetching ahead)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cloudckpt

BLOCK = 4 << 10
ROWS, COLS = 64, 1024  # float32: one 4 KiB block per row, 256 KiB in all


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def rank_columns(url: str, mode: str, batch_bytes: int, read_bytes: int) -> dict:
    if mode == "save":
        cloudckpt.save(
            {"w": _full()}, url, options=cloudckpt.SaveOptions(checksum_block_size=BLOCK)
        )
        return {}
    # every rank wants the same left half of the columns: one region, not one contiguous run
    dest = torch.full((ROWS, COLS // 2), -1.0)
    opts = cloudckpt.LoadOptions(
        broadcast=True, broadcast_batch_bytes=batch_bytes, max_read_bytes=read_bytes
    )
    result = cloudckpt.load(
        {"w": cloudckpt.GlobalPiece(dest, (ROWS, COLS), (0, 0))}, url, options=opts
    )
    return {
        "equal": torch.equal(dest, _full()[:, : COLS // 2]),
        "rank": dist.get_rank(),
        "fetched": result.bytes_fetched,
        "received": result.bytes_received,
        "broadcasts": result.broadcasts,
    }


@pytest.mark.parametrize(
    "batch_bytes,read_bytes",
    [
        (32 << 10, 32 << 10),  # budget of one batch: no fetching ahead
        (32 << 10, 1 << 20),  # budget of eight batches
        (96 << 10, 96 << 10),  # windows of three blocks (the budget cuts them)
    ],
)
def test_column_slices_are_read_once_and_broadcast_whatever_the_budget(
    world2, s3_url, batch_bytes, read_bytes
):
    world2.run(rank_columns, s3_url, "save", 0, 0)
    results = world2.run(rank_columns, s3_url, "load", batch_bytes, read_bytes)
    assert all(r["equal"] for r in results), results
    # the region's 64 blocks are read once in all (whole blocks: twice the region's bytes)
    assert sum(r["fetched"] for r in results) == ROWS * COLS * 4
    # each window is read by one rank (sources balanced: both ranks read some) and received by
    # the other one
    assert [r["received"] for r in results] == [results[1]["fetched"], results[0]["fetched"]]
    assert all(r["fetched"] > 0 for r in results)
    assert all(r["broadcasts"] == results[0]["broadcasts"] > 1 for r in results)
