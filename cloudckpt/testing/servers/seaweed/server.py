"""A throwaway local S3 endpoint: SeaweedFS (`weed mini`) on 127.0.0.1 with real credentials.

Used by the tests, the examples and the benchmarks; never imported by library code.

Contract:
- `S3Server(...).start()` returns an `S3ServerInfo` once the S3 port answers and (by default) the
  bucket exists. Every listening port is chosen free and passed explicitly; a port taken between the
  check and the bind makes weed exit at once, and the start is retried on a fresh block of ports.
- Like S3, it creates only the buckets asked for (`bucket`, plus `buckets`): a PUT into any other
  bucket gets NoSuchBucket (`-s3.autoCreateBucket=false`), so a bucket typo fails here as on AWS.
- Authentication is on: one admin identity (Admin, Read, List, Tagging, Write) and one read-only
  identity (Read, List), each with random keys. `AWS_*` variables never reach weed's environment.
- Each start uses a fresh private work directory (data, logs, sockets, identities file), removed on
  `stop()`. weed runs in its own session and is stopped by PID (SIGTERM, then SIGKILL).
- No orphan, nothing left behind: a small watchdog process, started before weed, stops weed and
  removes the work directory and weed's gRPC sockets (which weed always puts in /tmp) when the
  owning Python process dies, even by SIGKILL; `atexit` stops servers still running at exit.
- Secrets never appear in reprs or in weed's command line; they are written only to the 0600
  identities file and printed only by the `export` lines of the command-line entry point.
- `tls=True` also serves S3 over https on its own port (`info.https_endpoint_url`), with a server
  certificate for 127.0.0.1 signed by a private CA made for this start (`info.ca_file`, in the
  work directory): nothing trusts it unless told to.
- `host` (default 127.0.0.1) is the one address weed listens on and advertises. Any other address
  is accepted only inside a named network namespace (``ip netns``), never in the machine's own:
  the simulated cluster of :mod:`cloudckpt.testing.cluster.simulated` runs weed on its server
  namespace's private address, which nothing outside that run's namespaces can reach.

Around it: `config` (identities file, command lines, environment), `host` (binary, ports, names,
stopping), `watchdog` (the script that outlives a crash); `cli` is the command line.
"""

from __future__ import annotations

import atexit
import os
import random
import secrets
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from cloudckpt.testing.servers.endpoint import (
    DEFAULT_BUCKET,
    DEFAULT_REGION,
    S3ServerError,
    S3ServerInfo,
)
from cloudckpt.testing.servers.seaweed.config import (
    new_keys,
    watchdog_argv,
    weed_argv,
    weed_environment,
    write_identities,
)
from cloudckpt.testing.servers.seaweed.host import (
    GRPC_OFFSET,
    GRPC_SOCKET,
    GRPC_SOCKET_SERVICES,
    check_bucket_name,
    check_host,
    find_weed,
    pick_extra_port,
    pick_ports,
    stop_server_process,
)
from cloudckpt.testing.servers.seaweed.watchdog import remove_sockets
from cloudckpt.testing.servers.tlsca import make_tls_files

__all__ = ["S3Server", "start_s3_server"]

READY_TIMEOUT_S = 30.0
START_ATTEMPTS = 5


_LIVE_SERVERS: weakref.WeakSet[S3Server] = weakref.WeakSet()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.stop()


class S3Server:
    """One local SeaweedFS S3 endpoint; a context manager whose `__enter__` returns S3ServerInfo.

    Options (keyword-only):
      bucket: the default bucket (`info.bucket`), created at start unless `auto_create_bucket`
          is False.
      buckets: further buckets created at start.
      auto_create_bucket: create `bucket` at start (with the admin identity).
      s3_auto_create_bucket: weed's `-s3.autoCreateBucket` (a PUT into a missing bucket creates
          it). False by default, as on S3: a missing bucket gives NoSuchBucket.
      workdir: parent directory for the private work directory (default: the system temp dir).
      ready_timeout: seconds to wait for the S3 port to answer.
      tls: also serve S3 over https (see the module's contract; 127.0.0.1 only).
      host: the IPv4 address weed listens on (see the module's contract).
    """

    def __init__(
        self,
        *,
        bucket: str = DEFAULT_BUCKET,
        buckets: tuple[str, ...] = (),
        auto_create_bucket: bool = True,
        s3_auto_create_bucket: bool = False,
        workdir: str | os.PathLike | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
        tls: bool = False,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = check_host(host)
        if tls and host != "127.0.0.1":
            raise ValueError("tls=True serves a certificate for 127.0.0.1 only")
        self.bucket = check_bucket_name(bucket)
        self.buckets = tuple(dict.fromkeys(check_bucket_name(b) for b in buckets if b != bucket))
        self.auto_create_bucket = auto_create_bucket
        self.s3_auto_create_bucket = s3_auto_create_bucket
        self.ready_timeout = ready_timeout
        self.tls = tls
        self._parent_dir = None if workdir is None else str(workdir)
        self._proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self._workdir: str | None = None
        self._ports: dict[str, int] = {}
        self._info: S3ServerInfo | None = None
        self._lock = threading.Lock()
        self.start_seconds: float | None = None

    def __repr__(self) -> str:
        state = f"endpoint={self._info.endpoint_url} pid={self.pid}" if self._info else "stopped"
        return f"<S3Server bucket={self.bucket!r} {state}>"

    @property
    def info(self) -> S3ServerInfo:
        """The running server's S3ServerInfo (S3ServerError if not started)."""
        if self._info is None:
            raise S3ServerError("the S3 server is not running")
        return self._info

    @property
    def pid(self) -> int | None:
        """PID of the weed process (None when stopped)."""
        return None if self._proc is None else self._proc.pid

    @property
    def workdir(self) -> str | None:
        """The private work directory of the running server (removed by stop())."""
        return self._workdir

    @property
    def ports(self) -> dict[str, int]:
        """HTTP port of each service of the running server (gRPC: port + 10000); {} if stopped."""
        return dict(self._ports)

    def start(self) -> S3ServerInfo:
        """Start weed and wait until S3 answers and the buckets exist; idempotent while running."""
        with self._lock:
            if self._info is not None:
                return self._info
            t0 = time.monotonic()
            rng = random.Random(secrets.randbits(64))
            keys = new_keys()
            failures: list[str] = []
            for _ in range(START_ATTEMPTS):
                try:
                    info = self._start_once(rng, keys)
                except _PortClash as exc:
                    failures.append(str(exc))
                    self._kill_and_clean()
                    continue
                except BaseException:
                    self._kill_and_clean()
                    raise
                self._info = info
                self.start_seconds = time.monotonic() - t0
                _LIVE_SERVERS.add(self)
                return info
            raise S3ServerError(
                f"weed did not start after {START_ATTEMPTS} attempts:\n" + "\n---\n".join(failures)
            )

    def _start_once(self, rng: random.Random, keys: dict[str, str]) -> S3ServerInfo:
        self._workdir = tempfile.mkdtemp(prefix="cloudckpt-s3-", dir=self._parent_dir)
        work = Path(self._workdir)
        (work / "data").mkdir()
        (work / "log").mkdir()
        identities = work / "s3-identities.json"
        write_identities(identities, keys)
        # (checked free on 127.0.0.1 of this namespace: in a cluster's server namespace, where
        # weed listens on another address, nothing else listens anyway; a clash is retried)
        ports = self._ports = pick_ports(rng)
        if self.tls:
            ports["s3https"] = pick_extra_port(rng, ports)
        weed = find_weed()
        tls = make_tls_files(work / "tls") if self.tls else None
        argv = weed_argv(
            weed=weed,
            work=work,
            host=self.host,
            ports=ports,
            identities=identities,
            s3_auto_create_bucket=self.s3_auto_create_bucket,
            tls=tls,
        )
        env = weed_environment()
        # The watchdog first: from the moment weed exists, someone will stop it.
        self._watchdog = subprocess.Popen(
            watchdog_argv(weed, self._workdir, self._grpc_sockets()),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
        with open(work / "weed.out", "wb") as out:
            proc = self._proc = subprocess.Popen(
                argv,
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )

        endpoint = f"http://{self.host}:{ports['s3']}"
        self._wait_ready(proc, endpoint)
        https = None
        if tls is not None:
            https = f"https://127.0.0.1:{ports['s3https']}"
            self._wait_ready(proc, https, ssl.create_default_context(cafile=tls.ca_file))
        info = S3ServerInfo(
            endpoint_url=endpoint,
            region=DEFAULT_REGION,
            bucket=self.bucket,
            https_endpoint_url=https,
            ca_file=tls.ca_file if tls else None,
            **keys,
        )
        # A signed request with our own keys proves the answering server is ours, not a neighbour's.
        self._check_signed(proc, info)
        return info

    def _grpc_sockets(self) -> list[str]:
        return [
            GRPC_SOCKET.format(service=service, port=self._ports[service] + GRPC_OFFSET)
            for service in GRPC_SOCKET_SERVICES
            if service in self._ports
        ]

    def _log_tail(self, limit: int = 3000) -> str:
        if self._workdir is None:
            return ""
        try:
            return (Path(self._workdir) / "weed.out").read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def _wait_ready(
        self, proc: subprocess.Popen, endpoint: str, context: ssl.SSLContext | None = None
    ) -> None:
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )
        deadline = time.monotonic() + self.ready_timeout
        while True:
            code = proc.poll()
            if code is not None:
                raise _PortClash(f"weed exited with {code} during start:\n{self._log_tail()}")
            try:
                with opener.open(endpoint + "/", timeout=2) as resp:
                    status = resp.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            except (urllib.error.URLError, OSError):
                status = None
            if status in (200, 403):
                return
            if time.monotonic() > deadline:
                raise S3ServerError(
                    f"S3 at {endpoint} did not answer within {self.ready_timeout:.0f}s:\n"
                    f"{self._log_tail()}"
                )
            time.sleep(0.05)

    def _check_signed(self, proc: subprocess.Popen, info: S3ServerInfo) -> None:
        from botocore.exceptions import ClientError

        client = info.boto3_client()
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                client.list_buckets()
                wanted = ((self.bucket,) if self.auto_create_bucket else ()) + self.buckets
                for bucket in wanted:
                    try:
                        client.create_bucket(Bucket=bucket)
                    except ClientError as exc:
                        if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                            raise
                return
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch"):
                    raise _PortClash(f"the S3 port answered with {code}: another server") from exc
                if time.monotonic() > deadline:
                    raise S3ServerError(f"S3 not usable: {exc}\n{self._log_tail()}") from exc
            except Exception as exc:  # connection errors while weed settles
                if proc.poll() is not None:
                    raise _PortClash(f"weed exited during start:\n{self._log_tail()}") from exc
                if time.monotonic() > deadline:
                    raise S3ServerError(f"S3 not usable: {exc}\n{self._log_tail()}") from exc
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop weed (SIGTERM, then SIGKILL after a grace period), end the watchdog, remove the
        work directory and weed's gRPC sockets. Idempotent."""
        with self._lock:
            self._info = None
            _LIVE_SERVERS.discard(self)
            self._kill_and_clean()

    def _kill_and_clean(self) -> None:
        proc, self._proc = self._proc, None
        watchdog, self._watchdog = self._watchdog, None
        workdir, self._workdir = self._workdir, None
        stop_server_process(proc, watchdog, workdir)
        if proc is not None:
            remove_sockets(self._grpc_sockets())
        self._ports = {}

    def __enter__(self) -> S3ServerInfo:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __del__(self) -> None:
        try:
            if self._proc is not None:
                self.stop()
        except Exception:
            pass


class _PortClash(S3ServerError):
    """weed exited early or another server answered: retry with a fresh block of ports."""


def start_s3_server(**kw) -> S3Server:
    """Create and start an S3Server (keyword options as for S3Server); call `.stop()` when done."""
    server = S3Server(**kw)
    server.start()
    return server
