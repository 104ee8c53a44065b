"""Options of cloudckpt's DCP storage layer (frozen, keyword-only)."""

from __future__ import annotations

from dataclasses import dataclass

from cloudckpt.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class DCPOptions:
    """How :class:`cloudckpt.dcp.StorageWriter` cuts and checksums data files, and how
    :class:`cloudckpt.dcp.StorageReader` batches its reads.

    - ``object_size``: a rank's items are packed into data files (``__<rank>_<n>.distcp``) of
      about this many bytes (an item larger than that gets a file of its own); files upload
      concurrently, each multipart when large.
    - ``checksum_block_size``: bytes covered by each crc32c in the checksums file (a read
      verifies whole blocks, so smaller blocks mean less over-read when loading part of an item).
    - ``max_staging_bytes``: copies of tensors that cannot be uploaded from their own memory (on a
      device, strided views, views into a larger storage) alive at once.
    - ``read_batch_bytes``: a load reads each data file in batches of about this many bytes
      (one coalesced, concurrent ranged read each).
    - ``max_read_bytes``: bytes of batches in flight at once (their buffers bound a load's memory;
      bytes that land straight in a destination tensor count too).
    """

    object_size: int = 128 << 20
    checksum_block_size: int = 4 << 20
    max_staging_bytes: int = 256 << 20
    read_batch_bytes: int = 32 << 20
    max_read_bytes: int = 192 << 20

    def __post_init__(self) -> None:
        for name in (
            "object_size",
            "checksum_block_size",
            "max_staging_bytes",
            "read_batch_bytes",
            "max_read_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(
                    f"DCPOptions.{name} must be a positive number of bytes, got {value!r}"
                )
