"""Option and result types of the public save/load API (frozen, keyword-only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How a save cuts, checksums and schedules its data.

    - ``object_size``: target bytes per data object (larger items get their own object).
    - ``checksum_block_size``: bytes covered by each stored crc32c (partial reads verify whole
      blocks, so smaller blocks mean less over-read on resharded loads, more manifest bytes).
    - ``max_staging_bytes``: host copies of device / non-contiguous tensors alive at once.
    - ``replicas_to_lowest_rank``: write every replicated piece from its lowest holder instead of
      balancing them over holders.
    - ``timeout``: seconds any collective may wait for a peer before every rank fails.
    - ``join_timeout``: seconds the ranks that call a save wait for the others to call it too
      before each raises ``CollectiveMismatch`` (a save made on some ranks only: the rank-0
      guard); ``None``: ``timeout``. Raise it when ranks reach their saves further apart.
    - ``join_as``: what the ranks compare in that handshake instead of the URL (``None``: the
      URL). Only for a caller that writes one checkpoint to per-node URLs (the local tier of
      ``CheckpointManager(local=...)``): it passes the name those URLs share.
    - ``use_plan_cache``: reuse the global plan when the layout has not changed.
    - ``max_async_staging_bytes``: async save only; host staging memory this rank may use
      (``None``: no limit). A save needing more fails before writing anything.
    - ``content_hashes``: record a content hash of every chunk (8 bytes each, in the same pass
      over the bytes as their crc32c: about 0.1 s of CPU per GiB), so that a later save can use
      this checkpoint as its base. On by default; implied by ``base=``. ``False`` saves that
      CPU, and the checkpoint cannot be a base (a save against it writes every chunk).
    - ``pin_lease``: incremental saves: seconds a pin protects the base's objects after it was
      last renewed (renewed every quarter of it while the save runs; a save that could not
      renew them for half of it fails before committing). From 60 to 86400 (a day,
      ``cloudckpt.layout.MAX_PIN_LEASE``): a reader counts any longer lease as a day.
    - ``if_exists``: what a save does when a checkpoint is already committed at its URL.
      ``"error"`` (the default): ``CheckpointExists``, the old one untouched. ``"replace"``: the
      new one replaces it atomically (a fixed name such as ``last``): its objects go under a
      fresh attempt prefix, the manifest's overwrite is the commit (readers see the old
      checkpoint or the new one, never a mix), then the objects of the checkpoint's other
      attempts that no checkpoint references are deleted. A crash at any point leaves one
      loadable checkpoint there (the old one before the swap, the new one after); leftovers of
      a crash are collected by the next replacing save. A reader still reading the old
      checkpoint when its objects are collected fails with ``ObjectNotFound``.
    """

    object_size: int = 128 << 20
    checksum_block_size: int = 4 << 20
    max_staging_bytes: int = 256 << 20
    replicas_to_lowest_rank: bool = False
    timeout: float = 600.0
    join_timeout: float | None = 10.0
    join_as: str | None = None
    use_plan_cache: bool = True
    max_async_staging_bytes: int | None = None
    content_hashes: bool = True
    pin_lease: float = 600.0
    if_exists: Literal["error", "replace"] = "error"

    def __post_init__(self) -> None:
        _check_join_timeout(self.join_timeout)
        if self.if_exists not in ("error", "replace"):
            raise ValueError(f'if_exists must be "error" or "replace", got {self.if_exists!r}')
        if not 60.0 <= self.pin_lease <= 86400.0:
            raise ValueError(
                f"pin_lease must be from 60 to 86400 seconds (a day), got "
                f"{self.pin_lease!r}; pins are renewed while a save runs, so a "
                f"longer lease is never needed"
            )


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a load reads and shares data.

    - ``broadcast``: read a region that several ranks need once and broadcast it. ``None``
      (the default) broadcasts for remote stores (``s3://``) only: on a local or shared
      filesystem every rank reading the page cache beats sending the bytes over gloo.
    - ``min_broadcast_bytes``: the regions a group of ranks all need are read once and sent to
      the group when together they are at least this many bytes (each region, however small,
      travels in the group's batches); a group that would move less (its rounds' collectives
      would cost more than its ranks reading the bytes) reads them on every rank.
    - ``broadcast_batch_bytes``: the most bytes one source sends in one round (regions are cut
      into checksum-aligned windows of at most 16 MiB or this size, whichever is smaller, and
      smaller still so that each source sends its share in several rounds and an exchange
      stays within a quarter of ``max_read_bytes``); every member of a group is the source of
      about an even share, and in each round all of a group's sources send at once, while
      they fetch the next round's bytes. A region of at least 1 MiB (or this size) stored as
      one contiguous run travels in batches of its own, from the source's destination
      straight into each receiver's.
    - ``max_read_bytes``: fetched buffers alive at once per rank (bounds memory). Regions stored
      as one run whose destinations are contiguous tensors of the stored dtype need no buffer:
      their verified blocks are copied straight into the destinations.
    - ``max_broadcast_groups``: at most this many distinct subgroups are created; regions of the
      least used groups are then read by each rank instead.
    - ``share_manifest``: the coordinator reads the manifest and broadcasts it (otherwise every
      rank reads it).
    - ``timeout``: seconds any collective may wait for a peer before every rank fails.
    - ``join_timeout``: seconds the ranks that call a load wait for the others to call it too
      before each raises ``CollectiveMismatch``; ``None``: ``timeout``.
    - ``join_as``: as ``SaveOptions.join_as`` (a load from per-node URLs).
    """

    broadcast: bool | None = None
    min_broadcast_bytes: int = 32 << 10
    broadcast_batch_bytes: int = 32 << 20
    max_read_bytes: int = 192 << 20
    max_broadcast_groups: int = 64
    share_manifest: bool = True
    timeout: float = 600.0
    join_timeout: float | None = 10.0
    join_as: str | None = None

    def __post_init__(self) -> None:
        _check_join_timeout(self.join_timeout)


def _check_join_timeout(value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(
            f"join_timeout must be a positive number of seconds or None, got {value!r}"
        )


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """What a save did. ``bytes_written``/``objects`` count every rank's data objects;
    ``bytes_reused``: the chunk bytes an incremental save did not upload because its ``base``
    (the base's folder; ``""`` for a full save) already holds them.

    ``retention_error`` is set only by ``CheckpointManager.save``, on the rank that prunes (rank
    0): the exception of the clean-up after the commit (removing a killed attempt's leftovers,
    then pruning by the retention policy) when it failed. The checkpoint itself is committed and
    loadable; what the policy meant to delete may still be there (``CheckpointManager.prune``
    retries it and raises on failure). ``None`` when that work succeeded or did not run.
    """

    url: str
    bytes_written: int
    objects: int
    seconds: float
    rank_bytes_written: int = 0
    attempt: str = ""
    plan_cached: bool = False
    retention_error: Exception | None = None
    bytes_reused: int = 0
    base: str = ""

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_written / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """What a load did on this rank: bytes fetched from the store and received by broadcast."""

    url: str
    bytes_fetched: int
    bytes_received: int
    seconds: float
    unexpected_keys: tuple[str, ...] = ()
    broadcasts: int = 0

    @property
    def throughput_mb_s(self) -> float:
        total = self.bytes_fetched + self.bytes_received
        return total / 1e6 / self.seconds if self.seconds > 0 else 0.0
