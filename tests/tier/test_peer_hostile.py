"""The peer service and what a node receives from its peers: untrusted bytes, bounded, typed
errors, nothing used that does not verify."""

from __future__ import annotations

import asyncio
import socket
import threading

import msgpack
import pytest

from cloudckpt.checksum import crc32c
from cloudckpt.errors import (
    ChecksumError,
    ManifestError,
    ObjectExists,
    ObjectNotFound,
    PeerError,
    ProtocolError,
    StorageError,
)
from cloudckpt.layout import MANIFEST_KEY
from cloudckpt.runs.tier.flow import _decode_space
from cloudckpt.runs.tier.node import StepHolding, decode_inventory, encode_inventory
from cloudckpt.runs.tier.peers import Peer, decode_peer, encode_peer
from cloudckpt.runs.tier.reading import (
    StoreBehind,
    _decode_gathered,
    _decode_steps,
    check_extents,
)
from cloudckpt.storage.base import ReadRange
from cloudckpt.storage.local.store import LocalStore
from cloudckpt.storage.peer.client import PeerStore
from cloudckpt.storage.peer.server import PeerServer
from cloudckpt.storage.peer.tiered import Holder, TieredStore

KEY = "data/0123456789abcdef/r00000-0000.bin"


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_service_round_trip_token_keys_ranges_and_create_mode(tmp_path):
    async def body():
        server = await PeerServer(str(tmp_path), token="t0k").start()
        good = PeerStore(server.url, token="t0k")
        bad = PeerStore(server.url, token="wrong")
        try:
            data = bytes(range(256)) * 64
            await good.put(KEY, data, mode="create")
            with pytest.raises(ObjectExists):
                await good.put(KEY, b"other", mode="create")
            assert (await good.head(KEY)).size == len(data)
            assert await good.get(KEY) == data
            crc = crc32c(data[100:4196])
            (view,) = await good.read_ranges(KEY, [ReadRange(100, 4096, crc32c=crc)])
            assert bytes(view) == data[100:4196]
            with pytest.raises(PeerError, match="403"):
                await bad.get(KEY)
            with pytest.raises(PeerError, match="403"):
                await bad.put("data/0123456789abcdef/r00001-0000.bin", b"x", mode="create")
            with pytest.raises(ObjectNotFound):
                await good.head("data/0123456789abcdef/r00009-0000.bin")
            with pytest.raises(PeerError, match="416"):
                await good.read_ranges(KEY, [ReadRange(len(data) - 1, 10)])
            for evil in ("../outside", "/etc/passwd", "a/../../b"):
                with pytest.raises(Exception) as caught:
                    await good.get(evil)
                assert isinstance(caught.value, (ValueError, PeerError)), caught.value
            assert not (tmp_path.parent / "outside").exists()
        finally:
            await good.close()
            await bad.close()
            await server.close()

    _run(body())


def test_service_refuses_oversized_and_short_bodies(tmp_path):
    async def body():
        server = await PeerServer(str(tmp_path), token="t", max_object_bytes=1000).start()
        store = PeerStore(server.url, token="t")
        try:
            with pytest.raises(PeerError, match="413"):
                await store.put(KEY, b"x" * 1001, mode="create")
            assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("*.bin"))
        finally:
            await store.close()
            await server.close()

    _run(body())


class _LyingPeer:
    """A peer that answers every GET with ``answer(range_length)`` bytes and a fixed status."""

    def __init__(self, status: int, answer):
        self.status, self.answer = status, answer
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    more = conn.recv(65536)
                    if not more:
                        break
                    head += more
                length = 16
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"range: bytes="):
                        a, b = line.split(b"=")[1].split(b"-")
                        length = int(b) - int(a) + 1
                body, declared = self.answer(length)
                conn.sendall(
                    f"HTTP/1.1 {self.status} X\r\nContent-Length: {declared}\r\n"
                    "Connection: close\r\n\r\n".encode()
                    + body
                )

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    "status, answer, error",
    [
        (206, lambda n: (b"\0" * (n + 5), n + 5), PeerError),  # longer than asked
        (206, lambda n: (b"\0" * (n // 2), n // 2), PeerError),  # shorter
        (206, lambda n: (b"\0" * n, n), ChecksumError),  # the right size, wrong bytes
        (200, lambda n: (b"\0" * n, n), PeerError),  # not a ranged answer
        (500, lambda n: (b"", 0), PeerError),
        (206, lambda n: (b"\0" * 10, 1 << 40), PeerError),  # announces a terabyte, sends 10
    ],
    ids=["long", "short", "bad-bytes", "200", "500", "huge-length"],
)
def test_lying_peers_raise_typed_errors_and_sinks_stay_untouched(status, answer, error):
    peer = _LyingPeer(status, answer)
    sink = bytearray(b"\x07" * 64)

    async def body():
        store = PeerStore(peer.url, token="t", timeout=5)
        try:
            rng = ReadRange(0, 64, crc32c=crc32c(b"\x01" * 64), sinks=((0, memoryview(sink)),))
            with pytest.raises(error):
                await store.read_ranges(KEY, [rng])
        finally:
            await store.close()

    try:
        _run(body())
    finally:
        peer.close()
    assert sink == bytearray(b"\x07" * 64)


def test_tiered_store_reads_the_next_holder_when_one_lies(tmp_path):
    good_bytes = b"\x01" * 64
    peer = _LyingPeer(206, lambda n: (b"\0" * n, n))

    async def body():
        server = await PeerServer(str(tmp_path), token="t").start()
        good = PeerStore(server.url, token="t")
        liar = PeerStore(peer.url, token="t", timeout=5)
        try:
            await good.put(KEY, good_bytes, mode="create")
            tiered = TieredStore("s3://x/step", {KEY: [Holder("liar", liar), Holder("good", good)]})
            sink = bytearray(64)
            rng = ReadRange(0, 64, crc32c=crc32c(good_bytes), sinks=((0, memoryview(sink)),))
            await tiered.read_ranges(KEY, [rng])
            assert bytes(sink) == good_bytes
            nothing = TieredStore("s3://x/step", {KEY: [Holder("liar", liar)]})
            with pytest.raises(ChecksumError):
                await nothing.read_ranges(KEY, [ReadRange(0, 64, crc32c=crc32c(good_bytes))])
        finally:
            await good.close()
            await liar.close()
            await server.close()

    try:
        _run(body())
    finally:
        peer.close()


def test_inventory_and_peer_reports_from_untrusted_bytes():
    inv = {7: StepHolding(5, (KEY,), frozenset({KEY}), {KEY: 10})}
    assert decode_inventory(encode_inventory(inv)) == inv
    unsized = {7: StepHolding(5, (KEY,), frozenset({KEY}))}
    assert decode_inventory(encode_inventory(unsized)) == unsized  # -1 on the wire: unknown
    bad = [
        b"\xc1",  # not msgpack
        msgpack.packb({"a": 1}),
        msgpack.packb([[7, 5, [KEY]]]),
        msgpack.packb([[7, 5, [KEY], [KEY]]]),  # no sizes
        msgpack.packb([[-1, 5, [KEY], [KEY], [1]]]),
        msgpack.packb([[7, 1 << 33, [KEY], [KEY], [1]]]),
        msgpack.packb([[7, 5, ["../../etc/passwd"], [], []]]),
        msgpack.packb([[7, 5, [], [KEY], [1]]]),  # holds what its manifest does not list
        msgpack.packb([[7, 5, [KEY], [KEY], [1]], [7, 5, [KEY], [KEY], [1]]]),
        msgpack.packb([[7, 5, [KEY], [KEY], []]]),  # one size per held object
        msgpack.packb([[7, 5, [KEY], [KEY], [-2]]]),
        msgpack.packb([[7, 5, [KEY], [KEY], [1 << 62]]]),
        msgpack.packb([[7, 5, [KEY], [KEY], [True]]]),
        msgpack.packb([[7, 5, [KEY], [KEY], ["1"]]]),
        b"\x00" * (65 << 20),
    ]
    for raw in bad:
        with pytest.raises(ProtocolError):
            decode_inventory(raw)
    for raw in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb(["n", "ftp://x", "t", None])):
        with pytest.raises(ProtocolError):
            decode_peer(raw)
    with pytest.raises(ProtocolError):
        decode_peer(msgpack.packb(["n" * 5000, "http://x", "t", None]))


def test_merged_inventory_and_space_reports_from_untrusted_bytes():
    peer = encode_peer(Peer("h|/t", "http://127.0.0.1:1", "tok", None))
    inv = encode_inventory({7: StepHolding(5, (KEY,), frozenset({KEY}), {KEY: 10})})
    got = _decode_gathered(msgpack.packb([peer, inv]))
    assert got.peer.url == "http://127.0.0.1:1"
    assert got.inventory is not None and got.inventory[7].sizes == {KEY: 10}
    assert _decode_gathered(msgpack.packb([peer, None])).inventory is None
    for raw in (
        b"\xc1",
        msgpack.packb([peer]),
        msgpack.packb([peer, inv, []]),
        msgpack.packb(["not bytes", inv]),
        msgpack.packb([peer, "not bytes"]),
        msgpack.packb([peer, b"\xc1"]),  # an inventory that is not one
        msgpack.packb([b"\xc1", None]),  # a peer that is not one
    ):
        with pytest.raises(ProtocolError):
            _decode_gathered(raw)
    assert _decode_steps(msgpack.packb([1, 7])) == [1, 7]
    for raw in (b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([-1]), msgpack.packb(["7"])):
        with pytest.raises(ProtocolError):
            _decode_steps(raw)
    assert _decode_space(msgpack.packb([True, peer]))[0] is True
    for raw in (b"\xc1", msgpack.packb([1, peer]), msgpack.packb([True, "x"]), msgpack.packb([1])):
        with pytest.raises(ProtocolError):
            _decode_space(raw)


class _Manifest:
    """What ``check_extents`` reads of a manifest."""

    def __init__(self, extents: dict[str, int]):
        self.objects = list(extents)
        self._extents = extents

    def object_extents(self) -> dict[str, int]:
        return self._extents


def test_extents_checked_against_inventory_sizes_and_the_store(tmp_path):
    """An inventory's size that covers the extent costs no request (the holder here does not
    even answer); one that does not makes the next holder be asked; none: ManifestError."""
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    dead.close()  # nothing listens there: any request fails

    async def body():
        local = LocalStore(str(tmp_path))
        silent = PeerStore(url, token="t", timeout=2)
        try:
            await local.put(KEY, b"x" * 100)
            manifest = _Manifest({KEY: 100})
            sized = Holder("peer", silent, {KEY: 100})
            await check_extents(TieredStore("s3://x", {KEY: [sized]}), manifest)
            short = Holder("peer", silent, {KEY: 99})
            with pytest.raises(ManifestError, match="99 bytes"):
                await check_extents(TieredStore("s3://x", {KEY: [short]}), manifest)
            store = Holder("store", local)
            await check_extents(TieredStore("s3://x", {KEY: [short, store]}), manifest)
            with pytest.raises(ManifestError, match="100 bytes, the manifest refers to 101"):
                await check_extents(TieredStore("s3://x", {KEY: [store]}), _Manifest({KEY: 101}))
            with pytest.raises(ManifestError, match="missing"):
                other = "data/0123456789abcdef/r00001-0000.bin"
                await check_extents(TieredStore("s3://x", {other: [store]}), _Manifest({other: 1}))
            with pytest.raises(PeerError):  # asked, and not answering: its own error
                await check_extents(TieredStore("s3://x", {KEY: [Holder("p", silent)]}), manifest)
        finally:
            await silent.close()
            await local.close()

    _run(body())


def test_the_store_behind_the_tiers_serves_the_chosen_manifest_s_objects_only(tmp_path):
    manifest, data = b"the chosen manifest", b"y" * 64

    async def body():
        local = LocalStore(str(tmp_path))
        try:
            await local.put(MANIFEST_KEY, manifest)
            await local.put(KEY, data)
            same = StoreBehind(local, crc32c(manifest))
            assert await same.get(KEY) == data and (await same.head(KEY)).size == 64
            (view,) = await same.read_ranges(KEY, [ReadRange(0, 64, crc32c=crc32c(data))])
            assert bytes(view) == data
            gets = local.stats.requests.get("get", 0)
            await same.get(KEY)
            assert local.stats.requests.get("get", 0) == gets + 1  # the manifest read once
            other = StoreBehind(local, crc32c(b"another save of the step"))
            for read in (other.get(KEY), other.head(KEY), other.read_ranges(KEY, [])):
                with pytest.raises(StorageError, match="another save"):
                    await read
            assert await StoreBehind(local, None).get(KEY) == data  # the store's step alone
        finally:
            await local.close()

    _run(body())
