"""What keeps the objects of one checkpoint folder of a run alive: the committed checkpoints of
other folders that reference them, and the pins of incremental saves still running.

Every deletion asks :func:`folder_references` about a folder *after* that folder's manifest is
gone (or it never had one), and removes only what the answer does not keep. The protocol, and
why a save running or a deletion racing elsewhere cannot lose a referenced object, is in
docs/architecture.md ("Deleting with references"). In short: a saver writes its pin into every
folder it may reference, then checks that its base's manifest is still the one it read; a
deleter removes the manifest first, then reads the pins, and reads them again after reading the
manifests they name, until no new pin appears.

Works on a store opened at the run root (keys relative to it); no torch, no collective.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from cloudckpt.errors import CloudCkptError, ObjectNotFound
from cloudckpt.layout import (
    MANIFEST_KEY,
    MAX_PIN_BYTES,
    MIN_PIN_LEASE,
    PINS_PREFIX,
    decode_pin,
    parse_pin_key,
)
from cloudckpt.stored import decode_manifest_without_pickle, fetch_manifest_bytes
from cloudckpt.wording import plural

__all__ = [
    "FolderRefs",
    "describe_holders",
    "folder_references",
    "judge_pin",
    "read_manifest_or_none",
]

log = logging.getLogger(__name__)

#: GETs (referrers' manifests, pins) in flight at once.
CONCURRENCY = 16


@dataclass(frozen=True)
class FolderRefs:
    """The answer of :func:`folder_references` for ``folder``.

    - ``keys``: keys (relative to the folder) that committed checkpoints of other folders
      reference (``referrers``).
    - ``pinned``: a pin of a save that has not committed is live (or a referrer's manifest could
      not be read): every object of the folder must stay.
    - ``stale_pins``: keys (relative to the folder) of pins that protect nothing any more (their
      save committed without referencing this folder, or it is gone and its lease is over).
    """

    folder: str
    keys: frozenset[str] = frozenset()
    pinned: bool = False
    stale_pins: tuple[str, ...] = ()
    referrers: tuple[str, ...] = field(default=())

    def keeps(self, rel: str) -> bool:
        """Whether the object at ``rel`` (relative to the folder) must stay."""
        return self.pinned or rel in self.keys


async def read_manifest_or_none(store, folder: str):
    """The decoded manifest of ``folder`` (never unpickling), ``None`` when it has none."""
    try:
        raw = await fetch_manifest_bytes(store, f"{folder}/{MANIFEST_KEY}")
    except ObjectNotFound:
        return None
    return decode_manifest_without_pickle(raw)[0]


async def folder_references(
    store, folder: str, *, now: float | None = None, max_rounds: int = 64
) -> FolderRefs:
    """What keeps objects of ``folder`` (see :class:`FolderRefs`), judged at ``now`` (epoch
    seconds, this machine's clock by default, compared with the store's timestamps).

    Lists ``<folder>/pins/``; for each new pin reads the manifest of the folder it names: a
    committed manifest of the pin's attempt contributes the keys it references here; otherwise
    the pin is live until its last write plus its lease. Lists again until no new pin appears
    (a save pinning meanwhile validated its base after the previous listing: see the protocol).
    """
    now = time.time() if now is None else now
    prefix = f"{folder}/{PINS_PREFIX}"
    sem = asyncio.Semaphore(CONCURRENCY)
    verdicts: dict[str, tuple[str, object]] = {}
    for _ in range(max_rounds):
        new = [info async for info in store.list(prefix) if info.key not in verdicts]
        if not new:
            break

        async def judge(info):
            async with sem:
                return info.key, await judge_pin(store, folder, info, now)

        verdicts.update(await asyncio.gather(*(judge(i) for i in new)))
    else:  # pins keep appearing: keep everything this time
        return FolderRefs(folder=folder, pinned=True)
    keys: set[str] = set()
    referrers, stale, pinned = [], [], False
    for key, (verdict, detail) in sorted(verdicts.items()):
        if verdict == "refs":
            assert isinstance(detail, tuple)  # (referrer, keys): judge_pin's contract
            keys |= detail[1]
            referrers.append(detail[0])
        elif verdict == "live":
            pinned = True
        elif verdict == "stale":
            stale.append(key[len(folder) + 1 :])
    return FolderRefs(
        folder=folder,
        keys=frozenset(keys),
        pinned=pinned,
        stale_pins=tuple(stale),
        referrers=tuple(referrers),
    )


async def judge_pin(
    store, folder: str, info, now: float, manifests: dict | None = None
) -> tuple[str, object]:
    """``("refs", (referrer, keys))``, ``("live", until)``, ``("stale", None)`` or
    ``("other", None)`` (not a pin of the layout: left alone) for the pin listed as ``info``
    (an ``ObjectInfo``, run-relative key) in ``folder``: a pin of the attempt that committed
    its folder refers to the keys that manifest uses here (stale if none); a pin of an attempt
    other than the one that committed its folder is stale (that save can never commit: the
    manifest is written in create mode); any other pin is live until its last write plus its
    lease (``until``, epoch seconds; the lease clamped as :func:`cloudckpt.layout.decode_pin`
    does). ``manifests`` memoises the referrers' manifests (folder -> task) within one caller's
    work."""
    named = parse_pin_key(info.key[len(folder) + 1 :])
    if named is None:
        return "other", None
    attempt, referrer = named
    try:
        if manifests is None:
            manifest = await read_manifest_or_none(store, referrer)
        else:
            if referrer not in manifests:
                manifests[referrer] = asyncio.ensure_future(read_manifest_or_none(store, referrer))
            manifest = await asyncio.shield(manifests[referrer])
    except CloudCkptError as exc:  # a damaged referrer: keep what it may need
        log.warning(
            "cannot read the manifest of %s, which pins %s: keeping every object of %s (%s)",
            referrer,
            folder,
            folder,
            exc,
        )
        return "live", None
    if manifest is not None and manifest.attempt == attempt:
        used = frozenset(k for h, k in zip(manifest.object_homes, manifest.objects) if h == folder)
        return ("refs", (referrer, used)) if used else ("stale", None)
    if manifest is not None:  # another attempt committed there: this one can never commit
        return "stale", None
    try:
        pin = decode_pin(
            await store.get(info.key, max_bytes=MAX_PIN_BYTES), info.key[len(folder) + 1 :]
        )
        lease = pin.lease
    except ObjectNotFound:
        return "stale", None  # removed meanwhile
    except (CloudCkptError, ValueError):
        lease = MIN_PIN_LEASE  # damaged: protects for the shortest lease
    written = info.last_modified if info.last_modified is not None else now
    return ("live", written + lease) if written + lease > now else ("stale", None)


async def describe_holders(
    store, folder: str, *, now: float | None = None, manifests: dict | None = None
) -> tuple[str, ...]:
    """One line for each pin in ``folder`` saying what it holds, judged as
    :func:`judge_pin` does at ``now``: ``"<referrer>: committed, uses N object(s)"``,
    ``"<referrer>: save <attempt> not committed, pinned until <UTC time>"``,
    ``"<referrer>: its manifest cannot be read, keeps every object"`` or ``"<referrer>: stale
    pin (protects nothing; prune removes it)"``. For listings; removes nothing."""
    now = time.time() if now is None else now
    manifests = {} if manifests is None else manifests
    pins = [i async for i in store.list(f"{folder}/{PINS_PREFIX}")]
    sem = asyncio.Semaphore(CONCURRENCY)

    async def judge(info):
        async with sem:
            return await judge_pin(store, folder, info, now, manifests)

    verdicts = await asyncio.gather(*(judge(i) for i in pins))
    lines = []
    for info, (verdict, detail) in zip(pins, verdicts):
        named = parse_pin_key(info.key[len(folder) + 1 :])
        if named is None:
            continue
        attempt, referrer = named
        if verdict == "refs":
            lines.append(f"{referrer}: committed, uses {plural(len(detail[1]), 'object')}")
        elif verdict == "live" and detail is None:
            lines.append(f"{referrer}: its manifest cannot be read, keeps every object")
        elif verdict == "live":
            until = datetime.fromtimestamp(detail, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            lines.append(f"{referrer}: save {attempt} not committed, pinned until {until}")
        else:
            lines.append(f"{referrer}: stale pin (protects nothing; prune removes it)")
    return tuple(sorted(lines))
