"""The job's nodes, as far as the tier is concerned: this process's service of its node's tier,
who is on which node, and who replicates to whom.

Every rank serves its node's tier (:class:`~cloudckpt.storage.peer.server.PeerServer`, one per
directory per process, on cloudckpt's background loop) with a token of its own, and tells the
others its node key (``host`` plus the tier's absolute path: ranks of one node share both),
its service's URL and token (:class:`Blob` of :func:`encode_peer`, untrusted on receipt:
:func:`decode_peer`). Nodes are numbered by their lowest rank. Node ``i`` replicates to nodes
``i+1 .. i+replicas`` (mod the number of nodes); a load reads a key from this node, then the
nodes after it in that order, then the object store. The map of nodes a process learnt is kept
for its later managers (:func:`known_nodes`, per world); the exchanges that use it carry every
rank's service again and replace it when it changed.
"""

from __future__ import annotations

import os
import secrets
import socket
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar

import msgpack

from cloudckpt.errors import ProtocolError
from cloudckpt.runtime.context import current
from cloudckpt.runtime.loop import run_coroutine
from cloudckpt.storage.peer.client import PeerStore
from cloudckpt.storage.peer.server import PeerServer

_SERVERS: dict[str, tuple[int, PeerServer]] = {}  # path -> (runtime generation, server)
_CLIENTS: dict[tuple[int, str, str], PeerStore] = {}  # (generation, url, token) -> client
_NODES: dict[Hashable, tuple[weakref.ref | None, Nodes]] = {}  # see known_nodes
_HOSTS: dict[tuple, str] = {}  # (host option, MASTER_ADDR, MASTER_PORT) -> advertised address
_MAX_FIELD = 4096


@dataclass(frozen=True)
class Blob:
    """A phase report of msgpack bytes, decoded (and checked) by its user."""

    RECORD: ClassVar[str] = "tier"
    raw: bytes

    def encode(self) -> bytes:
        return b"\x01" + self.raw

    @classmethod
    def decode(cls, raw: bytes) -> Blob:
        if not raw or raw[:1] != b"\x01":
            raise ProtocolError("malformed tier report")
        return cls(bytes(raw[1:]))


@dataclass(frozen=True)
class Peer:
    """One rank's tier service: its node key, URL, token; ``problem``: why its tier is unusable."""

    node_key: str
    url: str
    token: str
    problem: str | None


def encode_peer(peer: Peer) -> bytes:
    return msgpack.packb([peer.node_key, peer.url, peer.token, peer.problem])


def decode_peer(raw: bytes) -> Peer:
    try:
        doc = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # noqa: BLE001 - malformed msgpack of any kind
        raise ProtocolError(f"malformed tier peer report: {exc}"[:200]) from exc
    if not (isinstance(doc, list) and len(doc) == 4):
        raise ProtocolError("a tier peer report is [node, url, token, problem]")
    node_key, url, token, problem = doc
    for value in (node_key, url, token):
        if not isinstance(value, str) or len(value) > _MAX_FIELD:
            raise ProtocolError("a tier peer report holds strings of at most 4 KiB")
    if not url.startswith("http://") or problem is not None and not isinstance(problem, str):
        raise ProtocolError("a tier peer report holds an http:// URL and an optional problem")
    return Peer(node_key, url, token, problem)


@dataclass(frozen=True)
class Nodes:
    """Every rank's service (rank order) grouped into nodes (numbered by their lowest rank)."""

    peers: tuple[Peer, ...]
    node_of: tuple[int, ...]  # rank -> node
    first_rank: tuple[int, ...]  # node -> its lowest rank (whose service the others use)

    @classmethod
    def of(cls, peers: list[Peer]) -> Nodes:
        keys: list[str] = []
        node_of = []
        for p in peers:
            if p.node_key not in keys:
                keys.append(p.node_key)
            node_of.append(keys.index(p.node_key))
        first = tuple(node_of.index(n) for n in range(len(keys)))
        return cls(tuple(peers), tuple(node_of), first)

    @property
    def count(self) -> int:
        return len(self.first_rank)

    def service(self, node: int) -> Peer:
        return self.peers[self.first_rank[node]]

    def targets(self, node: int, replicas: int) -> list[int]:
        """The nodes that hold replicas of ``node``'s objects."""
        return [(node + k) % self.count for k in range(1, min(replicas, self.count - 1) + 1)]

    def order(self, node: int) -> list[int]:
        """Every other node, nearest first (replica holders of ``node``'s objects come first)."""
        return [(node + k) % self.count for k in range(1, self.count)]


def known_nodes(key: Hashable, world: object | None) -> Nodes | None:
    """The job's nodes as this process last learnt them for ``key`` (a tier, a channel, a
    runtime generation) in ``world`` (the default process group object; ``None``: no
    ``torch.distributed``); ``None`` when not known, or learnt in another world (the default
    group was destroyed since: every process is new to it). A map known here may still be stale
    (a peer restarted its service): every exchange that uses one also carries every rank's
    service and replaces it (:func:`remember_nodes`)."""
    held = _NODES.get(key)
    if held is None:
        return None
    ref, nodes = held
    if (ref() if ref is not None else None) is not world:
        del _NODES[key]
        return None
    return nodes


def remember_nodes(key: Hashable, world: object | None, nodes: Nodes) -> None:
    """Keep ``nodes`` for later managers of this process (see :func:`known_nodes`)."""
    _NODES[key] = (weakref.ref(world) if world is not None else None, nodes)


def advertised_host(host: str | None) -> str:
    """The address other nodes reach this one at (see ``LocalTier.host``; found once per
    process and rendezvous address)."""
    if host:
        return host
    master = os.environ.get("MASTER_ADDR")
    key = (host, master, os.environ.get("MASTER_PORT"))
    found = _HOSTS.get(key)
    if found is None:
        found = _HOSTS[key] = _route_to(master) if master else "127.0.0.1"
    return found


def _route_to(master: str) -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500") or 29500)))
            return s.getsockname()[0]
    except (OSError, ValueError):
        return "127.0.0.1"


def serve(path: str, host: str) -> PeerServer:
    """This process's service of the tier at ``path`` (started on first use)."""
    generation = current().generation
    held = _SERVERS.get(path)
    if held is not None and held[0] == generation and held[1].host == host:
        return held[1]
    server = PeerServer(path, token=secrets.token_hex(16), host=host)
    run_coroutine(server.start())
    _SERVERS[path] = (generation, server)
    return server


def peer_client(url: str, token: str, timeout: float) -> PeerStore:
    """This process's client of the service at ``url`` (one connection pool per service)."""
    key = (current().generation, url, token)
    client = _CLIENTS.get(key)
    if client is None:
        client = _CLIENTS[key] = PeerStore(url, token=token, timeout=timeout)
    return client
