"""The peer service and what a node receives from its peers: untrusted bytes, bounded, typed
errors, nothing used that does not verify."""

from __future__ import annotations

import asyncio
import socket
import threading

import msgpack
import pytest

from cloudckpt.checksum import crc32c
from cloudckpt.errors import ChecksumError, ObjectExists, ObjectNotFound, PeerError, ProtocolError
from cloudckpt.runs.tier.node import StepHolding, decode_inventory, encode_inventory
from cloudckpt.runs.tier.peers import decode_peer
from cloudckpt.storage.base import ReadRange
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
    inv = {7: StepHolding(5, (KEY,), frozenset({KEY}))}
    assert decode_inventory(encode_inventory(inv)) == inv
    bad = [
        b"\xc1",  # not msgpack
        msgpack.packb({"a": 1}),
        msgpack.packb([[7, 5, [KEY]]]),
        msgpack.packb([[-1, 5, [KEY], [KEY]]]),
        msgpack.packb([[7, 1 << 33, [KEY], [KEY]]]),
        msgpack.packb([[7, 5, ["../../etc/passwd"], []]]),
        msgpack.packb([[7, 5, [], [KEY]]]),  # holds what its manifest does not list
        msgpack.packb([[7, 5, [KEY], [KEY]], [7, 5, [KEY], [KEY]]]),
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
