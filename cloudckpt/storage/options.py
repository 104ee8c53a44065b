"""Options of the storage layer: frozen, keyword-only, safe to log (secrets hidden from repr)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import urlsplit

from cloudckpt.errors import ConfigError

MiB = 1024 * 1024

#: S3 limits on multipart uploads.
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * 1024 * MiB
MAX_PARTS = 10_000
#: S3's limit on the body of one PutObject (create-mode puts are always one PutObject).
MAX_PUT_SIZE = 5 * 1024 * MiB


@dataclass(frozen=True, kw_only=True)
class RetryOptions:
    """How one storage operation retries, and when it gives up.

    ``max_attempts`` counts every request of the operation (1 = no retry). Between attempts the
    store sleeps ``uniform(0, min(max_delay, base_delay * 2**retry))`` seconds (full jitter).

    Time limits, from the smallest unit up (defaults in brackets):

    - ``connect_timeout`` [5 s]: to open a connection. A live endpoint accepts in milliseconds;
      an address that drops packets (firewall, wrong host) is noticed after this long.
    - ``read_timeout`` [20 s]: silence allowed while waiting for the server: for the first byte
      of its answer once the request is sent, and between two reads of a response body. It is
      not a bound on a transfer: a slow large GET or upload that keeps moving bytes is never cut
      by it. Servers answer in milliseconds, and those that need long (S3's
      CompleteMultipartUpload, CopyObject) send keep-alive bytes meanwhile.
    - ``max_stalls`` [3]: an operation whose attempts got no answer at all (a connect or read
      timeout) this many times in a row gives up (``RetriesExhausted``, "no answer"). So an
      endpoint that accepts connections but never answers fails an operation after about
      ``max_stalls * read_timeout`` = 60 s, and a closed port after ``max_attempts`` quick
      refusals (about 10 s), instead of running to the deadline.
    - ``attempt_timeout`` [300 s]: one whole attempt, transfer included (a cap for requests whose
      upload stalls, where ``read_timeout`` does not apply yet).
    - ``deadline`` [300 s]: the whole operation (its attempts, the sleeps between them and every
      wait for a request slot or buffer memory), after which ``RetriesExhausted`` is raised with
      the last cause.

    :meth:`within` builds options from one number (the CLI's ``--timeout``).
    """

    max_attempts: int = 8
    base_delay: float = 0.1
    max_delay: float = 5.0
    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    max_stalls: int = 3
    attempt_timeout: float = 300.0
    deadline: float = 300.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError("RetryOptions.max_attempts must be >= 1")
        if self.max_stalls < 1:
            raise ConfigError("RetryOptions.max_stalls must be >= 1")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ConfigError("RetryOptions delays must be >= 0")
        if min(self.attempt_timeout, self.deadline, self.connect_timeout, self.read_timeout) <= 0:
            raise ConfigError("RetryOptions timeouts must be > 0")

    def within(self, seconds: float) -> RetryOptions:
        """These options with an unresponsive endpoint given up on after about ``seconds``:
        ``read_timeout = seconds / max_stalls`` and ``connect_timeout`` at most that. A live
        server that answers slowly still has ``read_timeout`` of silence per read, and transfers
        are still bounded by ``attempt_timeout`` / ``deadline`` only, which are kept (raised to
        ``seconds`` if smaller)."""
        if not seconds > 0:
            raise ConfigError(f"a timeout must be > 0 seconds, got {seconds}")
        read = seconds / self.max_stalls
        return replace(
            self,
            read_timeout=read,
            connect_timeout=min(self.connect_timeout, read),
            attempt_timeout=max(self.attempt_timeout, seconds),
            deadline=max(self.deadline, seconds),
        )


@dataclass(frozen=True, kw_only=True)
class StorageOptions:
    """Options of an object store. Anything left ``None`` comes from the standard AWS chain,
    resolved as boto3 resolves it (``AWS_ENDPOINT_URL[_S3]``, ``AWS_DEFAULT_REGION``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
    ``AWS_CA_BUNDLE``, the config
    and credentials files, instance roles; ``AWS_REGION`` where nothing else names a region): the
    order is in ``cloudckpt.storage.s3.aws_config``.

    - ``addressing_style``: ``"path"``, ``"virtual"`` or ``"auto"`` (virtual hosted where the bucket
      name allows it); None: the profile's ``s3 = addressing_style``, else path style for a
      configured endpoint and virtual hosted for AWS S3 (as boto3).
    - ``verify_tls``: None or True verify TLS certificates with the AWS chain of CA bundles
      (``AWS_CA_BUNDLE``, the profile's ``ca_bundle``, ``REQUESTS_CA_BUNDLE``, then certifi's); a
      path (str or PathLike) trusts that PEM bundle (a private CA); False turns verification off.
    - ``concurrency``: requests in flight per store (and the size of its connection pool).
    - ``multipart_threshold``: bodies larger than this go multipart; ``part_size`` None picks one
      per body (>= 5 MiB, <= 10,000 parts; for a stream, from its size hint, else 16 MiB).
    - ``coalesce_gap``: ranges of one object closer than this are read by one GET.
    - ``max_buffer_bytes``: bytes the store itself may hold for reads in flight and for the parts
      of streams (``open_writer``) in flight (destination
      buffers provided by the caller are not counted, nor the received bytes of a range with
      sinks, held until it is verified: at most about one range per request in flight, whose
      buffers the direct reader keeps for the next ranges until reads stop for 2 s).
    - ``transport_checksums``: send ``x-amz-checksum-crc32c`` with every body so the server
      rejects bodies damaged in transit.
    - ``direct_range_reads``: ranged reads (``read_ranges``) go over cloudckpt's own HTTP/1.1
      reader, which receives bodies in place (about half the client CPU of aiohttp), with
      GetObject URLs presigned by the same client; answers it does not read, proxies and
      client certificates go through aiobotocore as every other request
      (``cloudckpt.storage.s3.rangeget``). False: aiobotocore for every request.
    - ``conditional_create``: how ``mode="create"`` is enforced: ``"native"`` (one PutObject
      with If-None-Match: *, whatever the body's size, so at most 5 GiB), ``"fallback"``
      (multipart-upload claim protocol, for servers that ignore the header; needs
      ListMultipartUploads) or ``"auto"`` (probe the server once per store, then pick).
    - ``prefix_spreading``: S3 only. N > 0 stores each key under one of N hashed prefixes of the
      root URL given to ``open_store`` (``root/<h>/key``), spreading a large job over S3's
      per-prefix request-rate partitions. Readers must open the same root with the same N.
    - ``fsync``: LocalStore only: fsync files and directories before a put returns.
    - ``retry``: attempts and time limits of each request (:class:`RetryOptions`: a dead
      endpoint fails an operation within about a minute by default; :meth:`with_timeout`).
    """

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    profile: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] | None = None
    verify_tls: bool | str | None = None
    concurrency: int = 16
    multipart_threshold: int = 16 * MiB
    part_size: int | None = None
    coalesce_gap: int = 1 * MiB
    max_buffer_bytes: int = 256 * MiB
    retry: RetryOptions = field(default_factory=RetryOptions)
    transport_checksums: bool = True
    direct_range_reads: bool = True
    conditional_create: Literal["auto", "native", "fallback"] = "auto"
    prefix_spreading: int = 0
    fsync: bool = False

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError("StorageOptions.concurrency must be >= 1")
        if self.multipart_threshold < MIN_PART_SIZE:
            raise ConfigError("StorageOptions.multipart_threshold must be >= 5 MiB")
        if self.part_size is not None and not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ConfigError("StorageOptions.part_size must be between 5 MiB and 5 GiB")
        if self.coalesce_gap < 0:
            raise ConfigError("StorageOptions.coalesce_gap must be >= 0")
        if self.max_buffer_bytes < 1 * MiB:
            raise ConfigError("StorageOptions.max_buffer_bytes must be >= 1 MiB")
        if self.addressing_style not in (None, "auto", "path", "virtual"):
            raise ConfigError(f"bad addressing_style {self.addressing_style!r}")
        if isinstance(self.verify_tls, os.PathLike):
            object.__setattr__(self, "verify_tls", os.fspath(self.verify_tls))
        verify = self.verify_tls
        if not isinstance(verify, (bool, str, type(None))) or (
            isinstance(verify, str) and not verify.strip()
        ):
            raise ConfigError(
                "StorageOptions.verify_tls must be None, True, False or the path of "
                f"a CA bundle (PEM), not {self.verify_tls!r}"
            )
        if self.conditional_create not in ("auto", "native", "fallback"):
            raise ConfigError(f"bad conditional_create {self.conditional_create!r}")
        if not 0 <= self.prefix_spreading <= 4096:
            raise ConfigError("StorageOptions.prefix_spreading must be between 0 and 4096")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError("give both access_key_id and secret_access_key, or neither")
        if self.endpoint_url is not None:
            check_endpoint_url(self.endpoint_url, "StorageOptions.endpoint_url")

    def with_timeout(self, seconds: float) -> StorageOptions:
        """A copy whose requests give up on an unresponsive endpoint after about ``seconds``
        (:meth:`RetryOptions.within`), e.g. ``StorageOptions().with_timeout(10)``; the rest
        still comes from the AWS chain."""
        return replace(self, retry=self.retry.within(seconds))


def check_endpoint_url(url: str, source: str) -> None:
    """Raise ``ConfigError`` (one line naming ``source``, e.g. ``AWS_ENDPOINT_URL``) unless
    ``url`` is an ``http://`` or ``https://`` URL with a host: ``127.0.0.1:9000`` (no scheme),
    ``s3://bucket`` or ``""`` are refused before any client is made. Pure (no I/O)."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(
            f"{source} is empty: give the endpoint as http://HOST[:PORT] or "
            "https://HOST[:PORT], or leave it unset for AWS S3"
        )
    try:
        parsed = urlsplit(url.strip())
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise ConfigError(
            f"{source} {url!r} is not a valid URL ({exc}): give "
            "http://HOST[:PORT] or https://HOST[:PORT]"
        ) from exc
    if parsed.scheme.lower() not in ("http", "https") or not parsed.hostname:
        raise ConfigError(
            f"{source} {url!r} is not an endpoint URL: it needs http:// or "
            f"https:// and a host, e.g. http://{_host_hint(url)}"
        )


def _host_hint(url: str) -> str:
    rest = url.split("://", 1)[-1].strip("/")
    return rest if rest and " " not in rest else "127.0.0.1:9000"


def choose_part_size(size: int, requested: int | None = None, *, default: int = 16 * MiB) -> int:
    """Part size for a multipart body of ``size`` bytes: ``requested`` (or ``default``), raised to
    at least 5 MiB and enough that the body fits in 10,000 parts (rounded up to whole MiB)."""
    part = max(requested or default, MIN_PART_SIZE)
    need = -(-size // MAX_PARTS)
    if need > part:
        part = -(-need // MiB) * MiB
    if part > MAX_PART_SIZE:
        raise ConfigError(f"a body of {size} bytes does not fit in {MAX_PARTS} parts of 5 GiB")
    return part
