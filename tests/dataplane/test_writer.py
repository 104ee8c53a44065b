"""The writer against a LocalStore (world 1, in process): items packed in order into objects,
each item's bytes where its location says, one crc32c per checksum block, failures cancel."""

from __future__ import annotations

import pytest
import torch

from cloudckpt.checksum import block_crcs
from cloudckpt.dataplane.writer import WriterOptions, write_chunks
from cloudckpt.errors import StorageError
from cloudckpt.layout import data_key
from cloudckpt.planning.batching import pack_in_order
from cloudckpt.runtime import run_coroutine
from tests.dataplane.helpers import ATTEMPT, data_path, store_at

BLOCK = 1000   # not a power of two: blocks split elements


def _items():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(64, 64, generator=g)                          # 16 KiB, contiguous
    return [
        (7, big),
        (3, torch.randn(32, 48, generator=g).t()),                   # strided view: copied
        (11, torch.randn(5, 7, generator=g).to(torch.bfloat16)),
        (2, torch.tensor(True)),                                     # 0-d
        (5, torch.empty(0, 3)),                                      # empty
        (9, torch.randint(0, 1 << 40, (3000,), generator=g)),        # 24 KB, bigger than an object
        (1, torch.randn(8, 2, 2, generator=g)[:, :, 0]),             # strided, not a view prefix
    ]


def test_items_are_packed_in_order_with_their_bytes_and_block_crcs(tmp_path):
    store = store_at(tmp_path)
    items = _items()
    opts = WriterOptions(object_size=20_000, checksum_block_size=BLOCK, max_staging_bytes=4096)
    locations, stats = run_coroutine(write_chunks(store, items, rank=3, attempt=ATTEMPT,
                                                  options=opts))
    sizes = [t.numel() * t.element_size() for _, t in items]
    groups = pack_in_order(sizes, opts.object_size)
    assert len(groups) > 2 and stats.objects == len(groups)
    assert stats.bytes_written == sum(sizes)
    assert [loc.chunk_id for loc in locations] == [cid for cid, _ in items]
    for n, members in enumerate(groups):
        key = data_key(ATTEMPT, 3, n)
        body = data_path(tmp_path, key).read_bytes()
        assert len(body) == sum(sizes[i] for i in members)
        offset = 0
        for i in members:  # in order, back to back
            loc = locations[i]
            assert (loc.object_key, loc.byte_offset, loc.byte_length) == (key, offset, sizes[i])
            expected = items[i][1].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            got = body[offset:offset + sizes[i]]
            assert got == expected
            assert loc.crcs == block_crcs(got, BLOCK)
            assert len(loc.crcs) == max(1, -(-sizes[i] // BLOCK))
            offset += sizes[i]


def test_an_item_larger_than_an_object_gets_an_object_of_its_own(tmp_path):
    items = [(0, torch.zeros(10)), (1, torch.zeros(1000)), (2, torch.zeros(10))]
    locations, stats = run_coroutine(write_chunks(
        store_at(tmp_path), items, rank=0, attempt=ATTEMPT,
        options=WriterOptions(object_size=100, checksum_block_size=BLOCK)))
    assert [loc.object_key for loc in locations] == [data_key(ATTEMPT, 0, n) for n in (0, 1, 2)]
    assert stats.objects == 3


class _FailingPuts:
    """A LocalStore whose put of one key fails; counts the puts that finished."""

    def __init__(self, store, bad_key: str):
        self.store, self.bad_key, self.done = store, bad_key, []

    async def put(self, key, body, mode="overwrite"):
        if key == self.bad_key:
            raise StorageError(f"injected failure putting {key}")
        await self.store.put(key, body, mode=mode)
        self.done.append(key)


def test_a_failed_upload_raises_its_error(tmp_path):
    store = _FailingPuts(store_at(tmp_path), data_key(ATTEMPT, 0, 1))
    items = [(i, torch.full((100,), float(i))) for i in range(6)]
    with pytest.raises(StorageError, match="injected failure"):
        run_coroutine(write_chunks(store, items, rank=0, attempt=ATTEMPT,
                                   options=WriterOptions(object_size=400, checksum_block_size=BLOCK)))
    assert data_key(ATTEMPT, 0, 1) not in store.done
