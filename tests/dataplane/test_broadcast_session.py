"""The read-once broadcast session (dataplane/broadcast.py) driven by the api's loop
(api/load_data.run_broadcasts), two ranks simulated in one process: each rank a thread with a
broadcaster that hands bytes over in memory. No collective, no torch.distributed.

Covers run batches landing in place, run batches through a buffer (another dtype, a transposed
destination), window batches (a column slice), a read budget smaller than two batches, and a
corrupt block (the source says so, first or with the bytes; nothing of the batch lands
anywhere), in an exchange round and in a round of one source."""

from __future__ import annotations

import threading

import pytest
import torch

from cloudckpt.api.load_data import run_broadcasts
from cloudckpt.dataplane.broadcast import BroadcastSession
from cloudckpt.errors import ChecksumError
from cloudckpt.planning.broadcast.groups import select_broadcasts
from cloudckpt.planning.broadcast.plan import plan_broadcasts, split_reads
from cloudckpt.planning.broadcast.readers import assign_readers
from cloudckpt.planning.broadcast.rounds import RunBatch, WindowBatch
from cloudckpt.planning.load.plan import plan_local_load
from tests.dataplane.helpers import box, data_path, piece, store_at, write_tensors

BLOCK = 512
CPU = torch.device("cpu")
FILL = 9


class _Link:
    """Threads meeting for each broadcast or all-gather."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.data = None
        self.slots: dict[int, torch.Tensor] = {}


class _MemoryBroadcaster:
    def __init__(self, rank: int, link: _Link, device: torch.device = CPU):
        self.rank, self.link, self.device = rank, link, device

    def broadcast(self, buf: torch.Tensor, *, src: int, members) -> None:
        assert self.rank in members
        if self.rank == src:
            self.link.data = buf.clone()
        self.link.barrier.wait(timeout=60)
        if self.rank != src:
            buf.copy_(self.link.data)
        self.link.barrier.wait(timeout=60)

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor, *, members) -> None:
        assert self.rank in members and out.numel() == len(members) * mine.numel()
        self.link.slots[self.rank] = mine.clone()
        self.link.barrier.wait(timeout=60)
        n = mine.numel()
        for j, m in enumerate(members):
            out[j * n : (j + 1) * n].copy_(self.link.slots[m])
        self.link.barrier.wait(timeout=60)

    def exchange(self, slots, *, members) -> None:
        self.link.slots[self.rank] = slots[members.index(self.rank)].clone()
        self.link.barrier.wait(timeout=60)
        for j, m in enumerate(members):
            if m != self.rank:
                assert slots[j].numel() == self.link.slots[m].numel()
                slots[j].copy_(self.link.slots[m])
        self.link.barrier.wait(timeout=60)


def _state():
    g = torch.Generator().manual_seed(5)
    return {
        "run": torch.randn(64, 32, generator=g),  # 8 KiB, one chunk
        "half": torch.randn(48, 16, generator=g).to(torch.bfloat16),  # 1.5 KiB
        "cols": torch.randn(32, 64, generator=g),
    }  # sliced by columns


def _wants(rank: int, state):
    """(spec, destination) per request: rank 1 takes 'run' transposed and 'half' as float32."""
    run, half, cols = state["run"], state["half"], state["cols"]
    out = [
        (
            piece("run", run, (0, 0), run.shape),
            torch.full((32, 64), FILL, dtype=run.dtype).t() if rank else torch.full_like(run, FILL),
        ),
        (
            piece("half", half, (0, 0), half.shape),
            torch.full(half.shape, FILL, dtype=torch.float32 if rank else half.dtype),
        ),
        (piece("cols", cols, (0, 8), (32, 40)), torch.full((32, 40), FILL, dtype=cols.dtype)),
    ]
    return out


def _load_two_ranks(
    store,
    manifest,
    state,
    *,
    batch_bytes,
    max_read_bytes,
    device=CPU,
    names=("run", "half", "cols"),
):
    wants = [[(s, d) for s, d in _wants(r, state) if s.name in names] for r in range(2)]
    plans = [plan_local_load(manifest, [s for s, _ in w], rank=r) for r, w in enumerate(wants)]
    assignment = assign_readers(plans, min_broadcast_bytes=0)
    kept = select_broadcasts(assignment.broadcasts, 64)
    sessions = []
    for rank in range(2):
        served = assignment.broadcast_of(rank)
        for i in range(len(plans[rank].reads)):
            assert int(served[i]) in kept  # every region is broadcast here
        reads = split_reads(plans[rank], assignment, kept)
        plan = plan_broadcasts(
            manifest,
            assignment,
            kept,
            reads.items_by_broadcast,
            rank=rank,
            batch_bytes=batch_bytes,
            max_read_bytes=max_read_bytes,
        )
        sessions.append(
            BroadcastSession(store, manifest, plan, [d for _, d in wants[rank]], device=device)
        )
    link, errors = _Link(2), [None, None]

    def rank_main(rank: int) -> None:
        try:
            run_broadcasts(sessions[rank], _MemoryBroadcaster(rank, link, device))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[rank] = exc
            link.barrier.abort()
        finally:
            sessions[rank].cancel_pending()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [None, None]
    return sessions, wants


@pytest.fixture
def written(tmp_path):
    store = store_at(tmp_path)
    state = _state()
    manifest, *_ = write_tensors(store, state, rows=64, block=BLOCK, object_size=1 << 20)
    return tmp_path, store, manifest, state


@pytest.mark.parametrize(
    "batch_bytes,max_read_bytes",
    [
        (2048, 1 << 20),  # fetching ahead
        (2048, 2048),  # a budget of one batch: no fetching ahead, still every batch fetched
        (1 << 20, 1 << 20),  # no run batches (regions under 1 MiB), large window batches
    ],
)
def test_every_destination_gets_the_stored_values_read_once(written, batch_bytes, max_read_bytes):
    _, store, manifest, state = written
    sessions, wants = _load_two_ranks(
        store, manifest, state, batch_bytes=batch_bytes, max_read_bytes=max_read_bytes
    )
    for w in wants:
        for spec, dest in w:
            assert torch.equal(dest, box(state[spec.name], spec.offsets, spec.sizes).to(dest.dtype))
    assert sessions[0].batches == sessions[1].batches  # the one global order
    kinds = {type(b) for b in sessions[0].batches}
    # regions of at least min(1 MiB, batch_bytes) stored as one run travel as run batches
    assert kinds == ({RunBatch, WindowBatch} if batch_bytes <= 8192 else {WindowBatch})
    assert sum(s.received for s in sessions) == sum(
        p.payload_bytes for b in sessions[0].batches for p in b.parts
    )
    # each batch was fetched by its source alone: whole blocks, at least the region's bytes
    assert sum(s.fetched for s in sessions) == sum(
        p.fetch_bytes for b in sessions[0].batches for p in b.parts
    )
    assert sessions[0].failure is None and sessions[1].failure is None


def test_a_corrupt_block_is_reported_by_its_source_and_lands_nowhere(written):
    root, store, manifest, state = written
    chunk = manifest.tensors["cols"].chunks[0]
    path = data_path(root, manifest.objects[chunk.object_index])
    body = bytearray(path.read_bytes())
    body[chunk.byte_offset + 5] ^= 0xFF  # first block of "cols": its first two rows
    path.write_bytes(bytes(body))
    # batches of 2 KiB: the first window of "cols" (rows 0-7 of its chunk, 4 blocks) travels
    # alone, and its first block is the corrupt one
    sessions, wants = _load_two_ranks(
        store, manifest, state, batch_bytes=2048, max_read_bytes=1 << 20
    )
    failures = [s.failure for s in sessions]
    assert sum(f is not None for f in failures) == 1  # the source of "cols", and only it
    assert isinstance([f for f in failures if f is not None][0], ChecksumError)
    for w in wants:
        for spec, dest in w:
            want = box(state[spec.name], spec.offsets, spec.sizes).to(dest.dtype)
            if spec.name == "cols":  # nothing of the failed batch landed, the rest did
                assert (dest[:8] == FILL).all() and torch.equal(dest[8:], want[8:])
            else:
                assert torch.equal(dest, want)


def test_a_corrupt_block_in_a_one_source_round_lands_nowhere(written):
    """A round with one source sending window batches: its status rides at the end of the
    bytes it sends all the same, and no receiver (nor the source) delivers them."""
    root, store, manifest, state = written
    chunk = manifest.tensors["cols"].chunks[0]
    path = data_path(root, manifest.objects[chunk.object_index])
    body = bytearray(path.read_bytes())
    body[chunk.byte_offset + 5] ^= 0xFF
    path.write_bytes(bytes(body))
    sessions, wants = _load_two_ranks(
        store, manifest, state, batch_bytes=1 << 20, max_read_bytes=1 << 20, names=("cols",)
    )
    assert [(r.exchange, r.buffered) for r in sessions[0].rounds] == [(False, True)]
    failures = [s.failure for s in sessions]
    assert sum(f is not None for f in failures) == 1
    assert isinstance([f for f in failures if f is not None][0], ChecksumError)
    for w in wants:
        for _, dest in w:
            assert (dest == FILL).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_buffers_as_for_nccl_carry_the_stored_values(written):
    """Sent buffers on the GPU (as with NCCL): nothing lands in place, every batch goes through
    a device buffer and is copied out to the CPU destinations."""
    _, store, manifest, state = written
    _, wants = _load_two_ranks(
        store,
        manifest,
        state,
        batch_bytes=2048,
        max_read_bytes=1 << 20,
        device=torch.device("cuda"),
    )
    for w in wants:
        for spec, dest in w:
            assert torch.equal(dest, box(state[spec.name], spec.offsets, spec.sizes).to(dest.dtype))
