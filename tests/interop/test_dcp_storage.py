"""cloudckpt.dcp.StorageWriter / StorageReader in one process, on SeaweedFS and local folders:
DCP's own layout both ways (FileSystemReader reads what the writer wrote, the reader reads what
FileSystemWriter wrote), the commit rule (.metadata last, in create mode), checksums that catch
a damaged byte anywhere in a data file, and checksums of another save ignored."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from cloudckpt.dcp import DCPOptions, StorageReader, StorageWriter
from cloudckpt.dcp.metadata import decode_checksums
from cloudckpt.errors import (
    CheckpointExists,
    ChecksumError,
    ConfigError,
    IntegrityError,
    InvalidRange,
)
from tests.interop.helpers import (
    assert_same,
    download_prefix,
    failure_of,
    odd_state,
    storage_for,
    upload_folder,
    zeros_like_state,
)
from tests.reliability.stores import RawCheckpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SMALL = DCPOptions(object_size=1 << 20, checksum_block_size=256 << 10)


@pytest.fixture
def storage(s3_server):
    return storage_for(s3_server)


def _load(url, storage, state, **kw):
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=StorageReader(url, storage, **kw))
    return out


def test_writer_files_are_dcp_layout_filesystem_reader_loads_them(
    s3_server, s3_url, storage, tmp_path
):
    state = odd_state(1)
    dcp.save(state, storage_writer=StorageWriter(s3_url, storage, options=SMALL))
    names = download_prefix(s3_server, s3_url, tmp_path)
    data = [n for n in names if n.endswith(".distcp")]
    assert set(names) == {".metadata", ".metadata.checksums", *data}
    assert len(data) >= 2 and all(n.startswith("__0_") for n in data), names
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert_same(out, state)
    assert_same(_load(s3_url, storage, state), state)  # and cloudckpt's reader, on S3


def test_reader_loads_filesystem_writer_checkpoint_uploaded(s3_server, s3_url, storage, tmp_path):
    state = odd_state(2)
    dcp.save(
        state, storage_writer=dcp.FileSystemWriter(str(tmp_path), thread_count=3, sync_files=False)
    )
    names = upload_folder(s3_server, tmp_path, s3_url)
    assert ".metadata" in names and sum(n.endswith(".distcp") for n in names) == 3
    assert_same(_load(s3_url, storage, state), state)


def test_local_folder_round_trip_and_file_url(tmp_path):
    state = odd_state(3)
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "ck", options=SMALL))
    for reader in (StorageReader(f"file://{tmp_path}/ck"), dcp.FileSystemReader(tmp_path / "ck")):
        out = zeros_like_state(state)
        dcp.load(out, storage_reader=reader)
        assert_same(out, state)


def test_existing_checkpoint_is_refused_before_anything_is_written(s3_server, s3_url, storage):
    state = odd_state(4)
    dcp.save(state, storage_writer=StorageWriter(s3_url, storage, options=SMALL))
    raw = RawCheckpoint(s3_url, s3_server)
    before = {n: raw.read(n) for n in (".metadata", ".metadata.checksums", "__0_0.distcp")}
    changed = {
        k: (v * 3 if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v)
        for k, v in state.items()
    }
    with pytest.raises(CheckpointException) as info:
        dcp.save(changed, storage_writer=StorageWriter(s3_url, storage, options=SMALL))
    err = failure_of(info.value)
    assert isinstance(err, CheckpointExists) and "new prefix" in str(err)
    assert {n: raw.read(n) for n in before} == before
    assert_same(_load(s3_url, storage, state), state)


class _Recording:
    """A store wrapper recording every put (key, mode)."""

    def __init__(self, store, puts):
        self._store, self.puts = store, puts

    async def put(self, key, body, *, mode="overwrite"):
        self.puts.append((key, mode))
        return await self._store.put(key, body, mode=mode)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_metadata_is_written_last_in_create_mode(monkeypatch, s3_url, storage):
    import cloudckpt.dcp.writer as writer_module

    puts: list = []
    real = writer_module.shared_store
    monkeypatch.setattr(
        writer_module,
        "shared_store",
        lambda url, options=None: _Recording(real(url, options), puts),
    )
    dcp.save(odd_state(5), storage_writer=StorageWriter(s3_url, storage, options=SMALL))
    assert puts[-1] == (".metadata", "create")
    assert puts[-2] == (".metadata.checksums", "overwrite")
    assert all(k.endswith(".distcp") for k, _ in puts[:-2]) and len(puts) >= 4


class _LateWriter(StorageWriter):
    """Another writer commits at the same prefix between this one's planning and its commit."""

    def finish(self, metadata, results):
        from cloudckpt.runtime.loop import run_coroutine, shared_store

        run_coroutine(shared_store(self.url, self.storage).put(".metadata", b"the first commit"))
        super().finish(metadata, results)


def test_a_commit_never_replaces_a_metadata_created_meanwhile(s3_server, s3_url, storage):
    with pytest.raises(CheckpointException) as info:
        dcp.save(odd_state(6), storage_writer=_LateWriter(s3_url, storage, options=SMALL))
    assert isinstance(failure_of(info.value), CheckpointExists)
    assert RawCheckpoint(s3_url, s3_server).read(".metadata") == b"the first commit"


@pytest.fixture
def saved(s3_server, s3_url, storage):
    """A checkpoint of ``odd_state(7)`` written by cloudckpt's writer with small blocks."""
    state = odd_state(7)
    dcp.save(state, storage_writer=StorageWriter(s3_url, storage, options=SMALL))
    raw = RawCheckpoint(s3_url, s3_server)
    sums = decode_checksums(raw.read(".metadata.checksums"))
    return state, raw, sums


def _positions(sums, rng) -> list[tuple[str, int]]:
    """Bytes to damage: in every data file its first and last byte, and in every item a load
    reads its first byte, a byte of its archive header, a byte of its tensor data and its last
    byte. (DCP reads nothing of a tensor with no elements: its item is left out.)"""
    out = set()
    ends: dict[str, int] = {}
    for (name, offset), item in sums.items.items():
        ends[name] = max(ends.get(name, 0), offset + item.length)
        if item.length == 0 or item.data_offset == item.length:
            continue
        out |= {
            (name, offset),
            (name, offset + item.length - 1),
            (name, offset + rng.randrange(max(1, item.data_offset))),
            (name, offset + rng.randrange(item.length)),
        }
    out |= {(name, 0) for name in ends} | {(name, end - 1) for name, end in ends.items()}
    return sorted(out)


def test_a_damaged_byte_anywhere_in_a_data_file_is_detected(saved, s3_url, storage):
    state, raw, sums = saved
    rng = random.Random(0)
    positions = _positions(sums, rng)
    # bounded but spread: every file's ends and a sample of the items' bytes
    sample = sorted(
        set(rng.sample(positions, min(24, len(positions)))) | {p for p in positions if p[1] == 0}
    )
    for name, offset in sample:
        original = raw.flip(name, offset)
        try:
            out = zeros_like_state(state)
            with pytest.raises(CheckpointException) as info:
                dcp.load(out, storage_reader=StorageReader(s3_url, storage))
            err = failure_of(info.value)
            assert isinstance(err, ChecksumError), (name, offset, err)
            assert name in str(err)
            _nothing_corrupt(out, state)
        finally:
            raw.write(name, original)
    assert_same(_load(s3_url, storage, state), state)


def _nothing_corrupt(out, state) -> None:
    """Every destination element holds its old value (0) or the right one."""
    for k, want in state.items():
        got = out[k]
        if isinstance(want, dict):
            _nothing_corrupt(got, want)
        elif isinstance(want, torch.Tensor) and want.numel():
            ok = (got == want) | (got == torch.zeros((), dtype=got.dtype))
            assert bool(ok.all()), k


def test_a_truncated_data_file_is_detected(saved, s3_url, storage):
    state, raw, _ = saved
    original = raw.truncate("__0_0.distcp", 1000)
    try:
        with pytest.raises(CheckpointException) as info:
            _load(s3_url, storage, state)
        assert isinstance(failure_of(info.value), (ChecksumError, InvalidRange))
    finally:
        raw.write("__0_0.distcp", original)


def test_a_damaged_metadata_is_an_integrity_error(saved, s3_url, storage):
    state, raw, _ = saved
    data = raw.read(".metadata")
    for offset in (len(data) - 3, len(data) // 2):
        raw.flip(".metadata", offset)
        with pytest.raises(IntegrityError):
            StorageReader(s3_url, storage).read_metadata()
        raw.write(".metadata", data)


def test_checksums_of_another_save_are_ignored(s3_server, s3_url, storage, tmp_path, caplog):
    """The prefix written again by FileSystemWriter (uploaded over ours): its .metadata loads,
    our stale checksums file is not used (a warning says so)."""
    first = odd_state(8)
    dcp.save(first, storage_writer=StorageWriter(s3_url, storage, options=SMALL))
    second = odd_state(9)
    dcp.save(second, storage_writer=dcp.FileSystemWriter(str(tmp_path), sync_files=False))
    upload_folder(s3_server, tmp_path, s3_url)
    with caplog.at_level(logging.WARNING, logger="cloudckpt.dcp.reader"):
        assert_same(_load(s3_url, storage, second), second)
    assert "belongs to another save" in caplog.text


def test_rank_local_metadata_without_collectives(tmp_path):
    state = odd_state(10)
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "ck"), use_collectives=False)
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert "__0.metadata" in names and ".metadata" not in names
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=StorageReader(tmp_path / "ck"))
    assert_same(out, state)


def test_checkpoint_ids(tmp_path):
    assert StorageWriter.validate_checkpoint_id("s3://bucket/run/step-1")
    assert StorageReader.validate_checkpoint_id(str(tmp_path))
    assert not StorageWriter.validate_checkpoint_id("gs://bucket/x")
    with pytest.raises(ConfigError):
        StorageWriter("gs://bucket/x")
    with pytest.raises(ConfigError):
        DCPOptions(object_size=0)
    writer = StorageWriter("s3://bucket/a/")
    assert writer.checkpoint_id == "s3://bucket/a"
    writer.reset("s3://bucket/b")
    assert writer.checkpoint_id == "s3://bucket/b" and writer.storage_meta().save_id
