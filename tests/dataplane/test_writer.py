"""The writer against a LocalStore (world 1, in process): items packed in order into objects,
each item's bytes where its location says, one crc32c per checksum block, failures cancel."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cloudckpt.checksum import block_crcs, content_hash
from cloudckpt.dataplane.writer import ItemDigests, WriterOptions, write_chunks
from cloudckpt.errors import StorageError
from cloudckpt.layout import data_key
from cloudckpt.planning.batching import pack_in_order
from cloudckpt.runtime.loop import run_coroutine
from tests.dataplane.helpers import ATTEMPT, data_path, store_at

BLOCK = 1000  # not a power of two: blocks split elements


def _items():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(64, 64, generator=g)  # 16 KiB, contiguous
    return [
        (7, big),
        (3, torch.randn(32, 48, generator=g).t()),  # strided view: copied
        (11, torch.randn(5, 7, generator=g).to(torch.bfloat16)),
        (2, torch.tensor(True)),  # 0-d
        (5, torch.empty(0, 3)),  # empty
        (9, torch.randint(0, 1 << 40, (3000,), generator=g)),  # 24 KB, bigger than an object
        (1, torch.randn(8, 2, 2, generator=g)[:, :, 0]),  # strided, not a view prefix
    ]


def test_items_are_packed_in_order_with_their_bytes_and_block_crcs(tmp_path):
    store = store_at(tmp_path)
    items = _items()
    opts = WriterOptions(object_size=20_000, checksum_block_size=BLOCK, max_staging_bytes=4096)
    locations, stats = run_coroutine(
        write_chunks(store, items, rank=3, attempt=ATTEMPT, options=opts)
    )
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
            got = body[offset : offset + sizes[i]]
            assert got == expected
            assert loc.crcs == block_crcs(got, BLOCK)
            assert len(loc.crcs) == max(1, -(-sizes[i] // BLOCK))
            offset += sizes[i]


@pytest.mark.parametrize("hashing", [False, True])
def test_a_save_without_a_base_packs_alike_and_hashes_each_item_as_it_uploads(tmp_path, hashing):
    """Hashing without a base (the default save) changes nothing of the packing; every item's
    hash is that of the bytes stored for it (computed in the object's own crc pass)."""
    store = store_at(tmp_path / str(hashing))
    items = _items()
    opts = WriterOptions(object_size=20_000, checksum_block_size=BLOCK, max_staging_bytes=4096)
    locations, stats = run_coroutine(
        write_chunks(store, items, rank=3, attempt=ATTEMPT, options=opts, hashing=hashing)
    )
    sizes = [t.numel() * t.element_size() for _, t in items]
    assert stats.objects == len(pack_in_order(sizes, opts.object_size)) and not stats.reused
    for (cid, _), loc in zip(items, locations):
        body = data_path(tmp_path / str(hashing), loc.object_key).read_bytes()
        got = body[loc.byte_offset : loc.byte_offset + loc.byte_length]
        assert loc.chunk_id == cid and loc.crcs == block_crcs(got, BLOCK)
        assert loc.content_hash == (content_hash(got) if hashing else b"")


def test_an_item_larger_than_an_object_gets_an_object_of_its_own(tmp_path):
    items = [(0, torch.zeros(10)), (1, torch.zeros(1000)), (2, torch.zeros(10))]
    locations, stats = run_coroutine(
        write_chunks(
            store_at(tmp_path),
            items,
            rank=0,
            attempt=ATTEMPT,
            options=WriterOptions(object_size=100, checksum_block_size=BLOCK),
        )
    )
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
        run_coroutine(
            write_chunks(
                store,
                items,
                rank=0,
                attempt=ATTEMPT,
                options=WriterOptions(object_size=400, checksum_block_size=BLOCK),
            )
        )
    assert data_key(ATTEMPT, 0, 1) not in store.done


def test_hashing_skips_known_items_and_packs_the_others_in_order(tmp_path):
    """Every item gets its content hash; items whose hash and block crcs ``known`` holds are
    not uploaded (reported in ``reused``); the rest are packed by the same rule as without
    hashing."""
    store = store_at(tmp_path)
    items = _items()
    digests = {cid: content_hash(_raw(t)) for cid, t in items}
    crcs = {cid: block_crcs(_raw(t), BLOCK) for cid, t in items}
    known = {
        7: (digests[7], crcs[7]),
        9: (digests[9], crcs[9]),
        11: (b"\x00" * 8, crcs[11]),  # changed: another hash
        3: (digests[3], (0,) * len(crcs[3])),  # the same hash, other crcs: not reused
        42: (b"\x01" * 8, (1,)),
    }
    opts = WriterOptions(object_size=20_000, checksum_block_size=BLOCK, max_staging_bytes=4096)
    locations, stats = run_coroutine(
        write_chunks(store, items, rank=1, attempt=ATTEMPT, options=opts, known=known)
    )
    assert stats.reused == ((7, digests[7]), (9, digests[9]))
    uploaded = [(cid, t) for cid, t in items if cid not in (7, 9)]
    sizes = [t.numel() * t.element_size() for _, t in uploaded]
    assert stats.bytes_reused == 16384 + 24000 and stats.bytes_written == sum(sizes)
    assert [loc.chunk_id for loc in locations] == [cid for cid, _ in uploaded]
    assert stats.objects == len(pack_in_order(sizes, opts.object_size))
    for loc, (cid, t) in zip(locations, uploaded):
        expected = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        body = data_path(tmp_path, loc.object_key).read_bytes()
        assert body[loc.byte_offset : loc.byte_offset + loc.byte_length] == expected
        assert loc.content_hash == digests[cid] and len(loc.content_hash) == 8
        assert loc.crcs == block_crcs(expected, BLOCK)  # computed in the hashing pass
    for n, extra in enumerate(({}, {"known": None}, {"known": {}})):
        plain, _ = run_coroutine(
            write_chunks(
                store_at(tmp_path / f"plain{n}"),
                items,
                rank=1,
                attempt=ATTEMPT,
                options=opts,
                **extra,
            )
        )
        # no hashing unless asked (an empty ``known``, a save without a base, asks nothing)
        assert {loc.content_hash for loc in plain} == {b""}
        assert [loc.crcs for loc in plain] == [
            block_crcs(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), BLOCK)
            for _, t in items
        ]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_hashing_everything_known_uploads_nothing(tmp_path):
    items = [(i, torch.full((50,), float(i))) for i in range(5)]
    known = {i: (content_hash(_raw(t)), block_crcs(_raw(t), 4 << 20)) for i, t in items}
    locations, stats = run_coroutine(
        write_chunks(store_at(tmp_path), items, rank=0, attempt=ATTEMPT, known=known)
    )
    assert locations == [] and stats.objects == 0 and stats.bytes_written == 0
    assert [cid for cid, _ in stats.reused] == list(range(5))
    assert not (tmp_path / "data").exists()


def test_a_failed_upload_stops_hashing_with_its_error(tmp_path):
    store = _FailingPuts(store_at(tmp_path), data_key(ATTEMPT, 0, 0))
    items = [(i, torch.full((100,), float(i))) for i in range(300)]
    with pytest.raises(StorageError, match="injected failure"):
        run_coroutine(
            write_chunks(
                store,
                items,
                rank=0,
                attempt=ATTEMPT,
                hashing=True,
                options=WriterOptions(object_size=400, checksum_block_size=BLOCK),
            )
        )


def test_digests_started_ahead_give_the_same_upload(tmp_path):
    """Hashing started before the upload (an incremental save hashes while its base is read)
    gives the same objects, locations and reuse as hashing inside the upload."""
    items = _items()
    first = _raw(items[0][1])
    known = {7: (content_hash(first), block_crcs(first, BLOCK)), 3: (b"\x00" * 8, (0,))}
    opts = WriterOptions(object_size=20_000, checksum_block_size=BLOCK, max_staging_bytes=4096)

    async def ahead(store):
        digests = ItemDigests(items, opts)
        await digests.start()
        await asyncio.sleep(0)
        return await write_chunks(
            store, items, rank=0, attempt=ATTEMPT, options=opts, known=known, digests=digests
        )

    inline = run_coroutine(
        write_chunks(
            store_at(tmp_path / "a"), items, rank=0, attempt=ATTEMPT, options=opts, known=known
        )
    )
    early = run_coroutine(ahead(store_at(tmp_path / "b")))
    assert early == inline and [c for c, _ in early[1].reused] == [7]
    for loc in early[0]:
        a = data_path(tmp_path / "a", loc.object_key).read_bytes()
        assert data_path(tmp_path / "b", loc.object_key).read_bytes() == a


@pytest.mark.parametrize("how", ["stopped", "never started", "failed"])
def test_an_upload_waiting_for_hashing_that_ended_early_raises(tmp_path, how):
    """Hashing that was stopped, never started or failed makes the upload raise, never hang."""
    items = [(i, torch.full((100,), float(i))) for i in range(4)]

    async def go():
        digests = ItemDigests(items, WriterOptions(checksum_block_size=BLOCK))
        if how == "failed":
            digests.block_size = 0  # the hash of the first batch raises ValueError
        if how != "never started":
            await digests.start()
        if how == "stopped":
            await digests.stop()
        return await write_chunks(
            store_at(tmp_path), items, rank=0, attempt=ATTEMPT, digests=digests
        )

    with pytest.raises(ValueError if how == "failed" else RuntimeError):
        run_coroutine(go(), timeout=60)
    assert not (tmp_path / "data").exists()


class _SlowPuts:
    """A LocalStore whose puts take a while (uploads hold their staging copies meanwhile)."""

    def __init__(self, store):
        self.store = store

    async def put(self, key, body, mode="overwrite"):
        await asyncio.sleep(0.002)
        await self.store.put(key, body, mode=mode)


@pytest.mark.parametrize("limit", [1, 600, 5000])
def test_hashing_and_uploads_share_a_tiny_staging_budget_without_waiting_on_each_other(
    tmp_path, limit
):
    """Strided items (copied for hashing, and again for upload) with a staging budget smaller
    than one item, a few items, or many: the hashing batches and the slow uploads take turns in
    one first-come budget; the save completes with every byte right and the budget empty."""
    g = torch.Generator().manual_seed(5)
    items = [(i, torch.randn(20, 1 + i % 7, generator=g).t()) for i in range(150)]
    opts = WriterOptions(object_size=700, checksum_block_size=BLOCK, max_staging_bytes=limit)

    async def go():
        digests = ItemDigests(items, opts)
        await digests.start()
        result = await write_chunks(
            _SlowPuts(store_at(tmp_path)),
            items,
            rank=0,
            attempt=ATTEMPT,
            options=opts,
            digests=digests,
        )
        return result, digests.budget

    (locations, stats), budget = run_coroutine(go(), timeout=120)
    assert budget.used == 0 and budget.peak <= max(1, limit)
    assert [loc.chunk_id for loc in locations] == [cid for cid, _ in items]
    for loc, (_, t) in zip(locations, items):
        body = data_path(tmp_path, loc.object_key).read_bytes()
        got = body[loc.byte_offset : loc.byte_offset + loc.byte_length]
        assert got == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert loc.crcs == block_crcs(got, BLOCK)
