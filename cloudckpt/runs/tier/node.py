"""One node's tier directory, and what it holds.

Layout (the run layout of an object store, below a marker)::

    <path>/cloudckpt-tier.msgpack              {"format": 1, "job": <job>}: whose tier this is
    <path>/step-<step:012d>/manifest.msgpack   the same bytes as the checkpoint's everywhere
    <path>/step-<step:012d>/data/<attempt>/r<rank>-<n>.bin   this node's objects and replicas

A node's tier holds part of a checkpoint: its own ranks' objects and the replicas it received.
A step is *complete in the tiers* when the nodes holding its manifest (the same bytes: same
crc32c) hold every object it lists between them. The inventory (:class:`Inventory`) is what a
node says it holds; one received from a peer is untrusted bytes (:func:`decode_inventory`:
bounded, every key checked, ``ProtocolError`` otherwise).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack

from cloudckpt.checksum import crc32c
from cloudckpt.errors import ManifestError, ProtocolError, StorageError
from cloudckpt.layout import MANIFEST_KEY, data_key_attempt, parse_step_dir, step_dir
from cloudckpt.runtime.loop import run_coroutine
from cloudckpt.storage.local.store import LocalStore
from cloudckpt.stored import decode_manifest_without_pickle

log = logging.getLogger(__name__)

MARKER = "cloudckpt-tier.msgpack"
FORMAT = 1
MAX_INVENTORY_BYTES = 64 << 20
_MAX_MARKER_BYTES = 64 << 10


@dataclass(frozen=True)
class StepHolding:
    """One step in one node's tier: its manifest's crc32c, the keys of every object it lists
    (``listed``) and of those this tier holds (``held``), relative to the step; ``sizes``: the
    size of each held object where known (what a load checks the manifest's extents against
    instead of asking the holder)."""

    crc: int
    listed: tuple[str, ...]
    held: frozenset[str]
    sizes: Mapping[str, int] = field(default_factory=dict)


Inventory = dict[int, StepHolding]


def encode_inventory(inventory: Inventory) -> bytes:
    return msgpack.packb(
        [
            [s, h.crc, list(h.listed), keys, [h.sizes.get(k, -1) for k in keys]]
            for s, h in sorted(inventory.items())
            for keys in [sorted(h.held)]
        ]
    )


def decode_inventory(raw: bytes) -> Inventory:
    """An inventory from untrusted bytes (a peer's): ``ProtocolError`` unless well-formed."""
    if not isinstance(raw, bytes | bytearray | memoryview) or len(raw) > MAX_INVENTORY_BYTES:
        raise ProtocolError("a tier inventory must be at most 64 MiB of msgpack")
    try:
        doc = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # noqa: BLE001 - malformed msgpack of any kind
        raise ProtocolError(f"a tier inventory is not msgpack: {exc}"[:200]) from exc
    if not isinstance(doc, list):
        raise ProtocolError("a tier inventory is a list of steps")
    inventory: Inventory = {}
    for entry in doc:
        if not (isinstance(entry, list) and len(entry) == 5):
            raise ProtocolError("a tier inventory entry is [step, crc, listed, held, sizes]")
        step, crc, listed, held, sizes = entry
        if type(step) is not int or step < 0 or step in inventory:
            raise ProtocolError(f"bad or repeated step in a tier inventory: {step!r}"[:120])
        if type(crc) is not int or not 0 <= crc < 1 << 32:
            raise ProtocolError("a tier inventory's manifest crc is a 32-bit unsigned int")
        if not isinstance(listed, list) or not isinstance(held, list):
            raise ProtocolError("a tier inventory's keys are lists")
        for key in (*listed, *held):
            if not isinstance(key, str) or data_key_attempt(key) is None:
                raise ProtocolError(f"not a data object key in a tier inventory: {key!r}"[:120])
        if not set(held) <= set(listed):
            raise ProtocolError("a tier inventory holds objects its manifest does not list")
        if not (isinstance(sizes, list) and len(sizes) == len(held)) or not all(
            type(n) is int and -1 <= n < 1 << 62 for n in sizes
        ):
            raise ProtocolError("a tier inventory gives one size (an int, -1: unknown) per object")
        known = {k: n for k, n in zip(held, sizes) if n >= 0}
        inventory[step] = StepHolding(crc, tuple(listed), frozenset(held), known)
    return inventory


def complete_in(inventories: list[Inventory], step: int, crc: int) -> bool:
    """Whether the tiers holding ``step``'s manifest of crc ``crc`` hold all of its objects."""
    held: set[str] = set()
    listed: tuple[str, ...] = ()
    for inv in inventories:
        h = inv.get(step)
        if h is not None and h.crc == crc:
            held |= h.held
            listed = h.listed
    return bool(listed) and set(listed) <= held


def complete_steps(inventories: list[Inventory]) -> dict[int, int]:
    """``{step: manifest crc}`` of the steps complete in these tiers (the newest crc group wins
    where two saves of one step exist: the one most nodes hold, then the larger crc)."""
    found: dict[int, int] = {}
    for step in sorted({s for inv in inventories for s in inv}):
        crcs = [inv[step].crc for inv in inventories if step in inv]
        for crc in sorted(set(crcs), key=lambda c: (crcs.count(c), c), reverse=True):
            if complete_in(inventories, step, crc):
                found[step] = crc
                break
    return found


class NodeTier:
    """This node's tier directory (see the module docstring); usable once :meth:`claim` said so."""

    def __init__(self, path: str, job: str):
        self.path = os.path.abspath(path)
        self.job = job
        self._store: LocalStore | None = None

    @property
    def store(self) -> LocalStore:
        if self._store is None:
            self._store = LocalStore(self.path)
        return self._store

    def step_url(self, step: int) -> str:
        return os.path.join(self.path, step_dir(step).rstrip("/"))

    def claim(self) -> str | None:
        """Make the directory ours, or say why it is not usable (``None``: usable). A directory
        with another job's or format's marker is left untouched."""
        marker = msgpack.packb({"format": FORMAT, "job": self.job})
        try:
            os.makedirs(self.path, exist_ok=True)
            target = os.path.join(self.path, MARKER)
            temp = f"{target}.{os.getpid()}.{secrets.token_hex(4)}"
            with open(temp, "xb") as f:  # complete before it is linked: no reader sees it half
                f.write(marker)
            try:
                os.link(temp, target)
                return None
            except FileExistsError:
                with open(target, "rb") as f:
                    found = f.read(_MAX_MARKER_BYTES + 1)
            finally:
                os.unlink(temp)
        except OSError as exc:
            return f"the tier directory {self.path} cannot be used ({exc})"
        try:
            doc = msgpack.unpackb(found, raw=False)
        except Exception:  # noqa: BLE001 - any malformed marker
            doc = None
        if found == marker:
            return None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            return f"{self.path} holds a tier of another cloudckpt format ({MARKER})"
        return f"{self.path} holds the tier of another job ({doc.get('job')!r:.80})"

    def inventory(self) -> Inventory:
        """What this tier holds: each step with a manifest that decodes (a damaged one is
        logged and left out). One trip to cloudckpt's loop: the listing, then the manifests
        read together."""
        objects, manifests = run_coroutine(self._scan())
        inventory: Inventory = {}
        for step, raw in sorted(manifests.items()):
            if raw is None:
                continue
            crc = crc32c(raw)
            listed = _listed_objects(step, raw)
            if listed is None:
                continue
            wanted = set(listed)
            held = {k: n for k, n in objects.get(step, {}).items() if k in wanted}
            inventory[step] = StepHolding(crc, listed, frozenset(held), held)
        return inventory

    async def _scan(self) -> tuple[dict[int, dict[str, int]], dict[int, bytes | None]]:
        """Each step's data objects with their sizes, and its manifest's bytes (``None``: not
        readable)."""
        objects: dict[int, dict[str, int]] = {}
        steps: list[int] = []
        for info in await _listing(self.store):
            top, _, rest = info.key.partition("/")
            step = parse_step_dir(top + "/")
            if step is None:
                continue
            if rest == MANIFEST_KEY:
                steps.append(step)
            elif data_key_attempt(rest) is not None:
                objects.setdefault(step, {})[rest] = info.size

        async def manifest(step: int) -> bytes | None:
            try:
                return await self.store.get(step_dir(step) + MANIFEST_KEY, max_bytes=1 << 30)
            except StorageError:
                return None

        raws = await asyncio.gather(*(manifest(s) for s in steps))
        return objects, dict(zip(steps, raws))

    def manifest_bytes(self, step: int) -> bytes | None:
        try:
            return run_coroutine(self.store.get(step_dir(step) + MANIFEST_KEY, max_bytes=1 << 30))
        except StorageError:
            return None

    def own_keys(self, step: int, rank: int) -> list[str]:
        """The data objects of ``rank`` this tier holds for ``step`` (relative to the step)."""
        prefix = step_dir(step)
        keys = []
        for info in run_coroutine(_listing(self.store, prefix + "data/")):
            rest = info.key[len(prefix) :]
            if data_key_attempt(rest) is not None and f"/r{rank:05d}-" in rest:
                keys.append(rest)
        return keys

    def held_bytes(self) -> int:
        return sum(info.size for info in run_coroutine(_listing(self.store)))

    def step_bytes(self, step: int) -> int:
        return sum(info.size for info in run_coroutine(_listing(self.store, step_dir(step))))

    def remove_step(self, step: int) -> None:
        shutil.rmtree(self.step_url(step), ignore_errors=True)

    def prune(self, keep: int, protected: set[int]) -> list[int]:
        """Remove the steps beyond the newest ``keep`` this tier holds a manifest of (and the
        folders of older steps without one), never a step in ``protected``."""
        found = (parse_step_dir(e + "/") for e in os.listdir(self.path))
        steps = sorted(s for s in found if s is not None)
        with_manifest = [s for s in steps if os.path.exists(self._manifest_path(s))]
        kept = set(with_manifest[-keep:]) | protected
        newest = with_manifest[-1] if with_manifest else -1
        removed = [s for s in steps if s not in kept and s < newest]
        for step in removed:
            self.remove_step(step)
        return removed

    def _manifest_path(self, step: int) -> str:
        return os.path.join(self.step_url(step), MANIFEST_KEY)


_LISTED: dict[bytes, tuple[str, ...]] = {}  # a manifest's blake2b digest -> its objects
_LISTED_MAX = 64


def _listed_objects(step: int, raw: bytes) -> tuple[str, ...] | None:
    """The objects a manifest lists (decoded once per process per manifest: an inventory is
    taken at every tiered load); ``None`` (logged) when it does not decode."""
    key = hashlib.blake2b(raw, digest_size=20).digest()
    listed = _LISTED.get(key)
    if listed is None:
        try:
            manifest, _ = decode_manifest_without_pickle(raw)
        except ManifestError as exc:
            log.warning("cloudckpt: the tier's manifest of step %d is damaged: %s", step, exc)
            return None
        listed = tuple(sorted(set(manifest.objects)))
        if len(_LISTED) >= _LISTED_MAX:
            _LISTED.pop(next(iter(_LISTED)))
        _LISTED[key] = listed
    return listed


async def _listing(store: LocalStore, prefix: str = "") -> list:
    return [info async for info in store.list(prefix)]


def object_blocks(manifest) -> dict[str, list[tuple[int, int, int]]]:
    """``{object key: [(offset, length, crc32c), ...]}``: every checksum block of every chunk the
    manifest stores in each object (what makes an object's bytes trustworthy)."""
    cols = manifest.columns
    block = manifest.checksum_block_size
    out: dict[str, list[tuple[int, int, int]]] = {}
    keys = manifest.objects
    for c in range(len(cols.byte_length)):
        length = int(cols.byte_length[c])
        if length == 0:
            continue
        offset = int(cols.byte_offset[c])
        first = int(cols.crc_start[c])
        blocks = out.setdefault(keys[int(cols.object_index[c])], [])
        for i, start in enumerate(range(0, length, block)):
            blocks.append((offset + start, min(block, length - start), int(cols.crcs[first + i])))
    return out


def damaged_blocks(data: bytes | memoryview, blocks: list[tuple[int, int, int]]) -> int:
    """How many of ``blocks`` the bytes ``data`` of one object fail (past the end: failed)."""
    view = memoryview(data)
    bad = 0
    for offset, length, crc in blocks:
        if offset + length > len(view) or crc32c(view[offset : offset + length]) != crc:
            bad += 1
    return bad
