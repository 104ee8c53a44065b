"""The base of an incremental save, on the coordinator: reading it, pinning the folders the save
will reference, keeping the pins fresh, and releasing them.

Contract (the protocol and why it is safe: docs/architecture.md, "Incremental checkpoints"):

- :func:`base_folder` checks, before any I/O and on every rank, that a base URL names a sibling
  of the new checkpoint in the same run (``ConfigError`` otherwise).
- :func:`read_base` reads the base's manifest (HEAD for its ETag, GET, decoded without ever
  unpickling): the save starts it on the coordinator during planning, so that the read is off
  its critical path. :func:`open_base` matches it against the new save's skeleton
  (:func:`cloudckpt.planning.save.incremental.match_base`). When some chunk matches, it writes a pin
  (``<home>/pins/<attempt>.<folder>``, overwrite) into every folder the save may reference (the
  base's and the base's homes), then HEADs the base's manifest again: only if it is still there
  with the same ETag does the save go on incrementally. Otherwise (no manifest, no hashes,
  another block size, nothing matches, the manifest changed or went away) the pins are removed
  and the save writes every chunk itself: ``None``, with the reason logged (INFO). A base whose
  manifest does not decode (damaged, or a format this version cannot read) also means a full
  save, logged at WARNING: a damaged newest checkpoint must not stop a run from saving.
- While the save runs, a task on cloudckpt's loop rewrites the pins every ``lease / 4``
  seconds. :meth:`PinnedBase.check_lease` (just before the manifest is written) raises
  ``CheckpointError`` when the last complete rewrite started more than ``lease / 2`` ago: a
  deleter may then have taken the pins for those of a dead save.
- After the commit the pins stay: they record that the new checkpoint references those
  folders (deleting it removes them); those in folders it does not reference after all are
  removed. After a failure :meth:`PinnedBase.release` removes them
  (a save killed outright leaves them to expire).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from cloudckpt.errors import CheckpointError, ConfigError, ManifestError, ObjectNotFound
from cloudckpt.layout import MANIFEST_KEY, Pin, clamp_lease, encode_pin, pin_key, split_folder
from cloudckpt.manifest.model import Manifest
from cloudckpt.planning.save.incremental import BaseChunks, match_base
from cloudckpt.runtime.loop import BackgroundTask
from cloudckpt.storage.base import ObjectInfo, ObjectStore
from cloudckpt.stored import decode_manifest_without_pickle, fetch_manifest_bytes

log = logging.getLogger(__name__)


def base_folder(url: str, base: str) -> tuple[str, str, str]:
    """``(run URL, new checkpoint's folder, base's folder)``; ``ConfigError`` unless ``base`` is
    another checkpoint of the run ``url`` is in (the folder right above both)."""
    mine, theirs = split_folder(url), split_folder(base)
    if mine is None:
        raise ConfigError(
            f"an incremental save needs a folder above its checkpoint (the run), and {url} has none"
        )
    if theirs is None or theirs[0] != mine[0] or theirs[1] == mine[1]:
        raise ConfigError(
            f"the base {base} is not another checkpoint of the run {mine[0]} "
            f"(a base must be a sibling folder of {url})"
        )
    return mine[0], mine[1], theirs[1]


@dataclass(frozen=True, eq=False)
class BaseRead:
    """The base's manifest as :func:`read_base` found it: ``info`` (the HEAD before the GET:
    ETag and size) and ``manifest``; ``manifest`` ``None`` when the base is not usable (``why``
    says why)."""

    info: ObjectInfo | None
    manifest: Manifest | None
    why: str = ""
    damaged: bool = False  # the manifest is there but does not decode (logged at WARNING)


async def read_base(run_store, base: str) -> BaseRead:
    """HEAD, GET and decode (never unpickling) the manifest of the base ``base`` (a folder of
    ``run_store``). No side effect: a read nobody uses may be dropped."""
    manifest_key = f"{base}/{MANIFEST_KEY}"
    try:
        before = await run_store.head(manifest_key)
        manifest, _ = decode_manifest_without_pickle(
            await fetch_manifest_bytes(run_store, manifest_key)
        )
    except ObjectNotFound:
        return BaseRead(None, None, "it has no manifest")
    except ManifestError as exc:  # a damaged base must not stop every later save of the run
        return BaseRead(None, None, f"its manifest is damaged or unreadable: {exc}", damaged=True)
    if manifest.chunk_hashes is None:
        return BaseRead(before, None, "its manifest records no chunk hashes")
    return BaseRead(before, manifest)


@dataclass(eq=False)
class PinnedBase:
    """A usable base, pinned. ``chunks``: the base and the matching chunks."""

    chunks: BaseChunks
    store: ObjectStore  # the run root's store
    keys: tuple[str, ...]  # run-relative pin keys
    body: bytes
    lease: float
    renewed: float  # time.monotonic() when the last full write started
    task: BackgroundTask | None = field(default=None)  # the refresher

    def check_lease(self) -> None:
        age = time.monotonic() - self.renewed
        if age > self.lease / 2:
            raise CheckpointError(
                f"the pins protecting this save's base were last renewed {age:.0f} s ago, over "
                f"half their lease of {self.lease:.0f} s: a clean-up may have removed objects "
                f"the checkpoint would reference; save again"
            )

    async def refresh(self) -> None:
        while True:
            await asyncio.sleep(self.lease / 4)
            started = time.monotonic()
            try:
                await _put_all(self.store, self.keys, self.body)
                self.renewed = started
            except Exception as exc:  # noqa: BLE001 - retried at the next period
                log.warning("could not renew the pins of an incremental save: %s", exc)

    def stop(self) -> None:
        """Stop renewing the pins (from any thread but the loop's)."""
        if self.task is not None:
            self.task.cancel_and_wait()
            self.task = None

    async def drop_unused(self, used) -> None:
        """After the commit: remove the pins in folders the manifest does not reference after
        all (they protect nothing); a failure is only logged."""
        unused = [k for k in self.keys if k.split("/", 1)[0] not in used]
        try:
            if unused:
                await self.store.delete(unused)
        except Exception as exc:  # noqa: BLE001 - they are only stale pins
            log.warning(
                "could not remove %d unused pins of an incremental save: %s", len(unused), exc
            )

    async def release(self) -> None:
        """Remove the pins (the save failed or fell back to a full save)."""
        await self.store.delete(list(self.keys))


async def _put_all(store, keys, body) -> None:
    await asyncio.gather(*(store.put(k, body) for k in keys))


async def open_base(
    run_store,
    *,
    folder: str,
    base: str,
    attempt: str,
    skeleton,
    checksum_block_size: int,
    lease: float,
    read: BaseRead | None = None,
) -> PinnedBase | None:
    """Read (unless ``read``, :func:`read_base`'s result, is given), match and pin the base
    ``base`` of the save ``attempt`` of ``folder`` (see the module docstring); ``None`` when
    the save must write every chunk itself."""
    lease = clamp_lease(lease)
    manifest_key = f"{base}/{MANIFEST_KEY}"
    if read is None:
        read = await read_base(run_store, base)
    before, manifest = read.info, read.manifest
    if manifest is None or before is None:  # a usable read has both
        _full(base, read.why, warn=read.damaged)
        return None
    match = match_base(skeleton, manifest, checksum_block_size=checksum_block_size)
    if not (match >= 0).any():
        _full(
            base,
            "none of its chunks has the box, dtype and checksum block size of one of this save's",
        )
        return None
    chunks = BaseChunks(folder=base, manifest=manifest, match=match)
    keys = tuple(f"{home}/{pin_key(attempt, folder)}" for home in sorted(chunks.homes()))
    body = encode_pin(Pin(folder=folder, attempt=attempt, lease=lease))
    renewed = time.monotonic()
    pinned = PinnedBase(
        chunks=chunks, store=run_store, keys=keys, body=body, lease=lease, renewed=renewed
    )
    try:
        await _put_all(run_store, keys, body)
        after = await run_store.head(manifest_key)
    except ObjectNotFound:
        after = None
    except BaseException:
        await asyncio.shield(pinned.release())
        raise
    if after is None or after.etag != before.etag or after.size != before.size:
        await pinned.release()
        _full(base, "its manifest changed or was deleted while the save pinned it")
        return None
    return pinned


def _full(base: str, why: str, *, warn: bool = False) -> None:
    """Log why the save writes every chunk itself."""
    log.log(
        logging.WARNING if warn else logging.INFO,
        "incremental save: not using %s as the base (%s): every chunk is written",
        base,
        why,
    )
