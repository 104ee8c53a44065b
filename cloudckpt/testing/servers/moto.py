"""A second, independent S3 implementation for the tests: moto's server mode on 127.0.0.1.

moto (``pip install 'moto[s3]' flask flask-cors``) is AWS's own API model re-implemented in
Python, in memory. Started here as a subprocess (``moto.server.main``, what ``moto_server`` runs)
so it shares no interpreter, GIL or event loop with the code under test. It differs from the
session's SeaweedFS in ways the tests rely on: it accepts any credentials (no auth tests here),
does not check ``x-amz-checksum-crc32c`` or ``Content-MD5`` (a damaged body is stored as sent),
and honours ``If-None-Match: *`` on PutObject.

Contract, as for :mod:`cloudckpt.testing.servers.seaweed.server`: ``MotoServer().start()``
returns an ``S3ServerInfo`` once the port answers and the bucket exists (its read-only identity is
not enforced by moto); the port is chosen free and the start retried on a clash; the process runs
in its own session, is stopped by PID, and the SeaweedFS watchdog script stops it if the owning
process dies.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from cloudckpt.testing.servers.endpoint import (
    DEFAULT_BUCKET,
    DEFAULT_REGION,
    S3ServerError,
    S3ServerInfo,
)
from cloudckpt.testing.servers.seaweed.host import WATCHDOG_SCRIPT, stop_server_process

__all__ = ["MotoServer", "moto_available"]

READY_TIMEOUT_S = 60.0
START_ATTEMPTS = 3
# argv[1] is the work directory: it marks the process for the watchdog.
_MOTO_SRC = "import sys; from moto.server import main; main(sys.argv[2:])"


def moto_available() -> bool:
    """Whether moto's server mode can be imported here (moto, flask, flask-cors)."""
    from importlib.util import find_spec

    return all(find_spec(name) is not None for name in ("flask", "flask_cors", "moto"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MotoServer:
    """One moto S3 endpoint; a context manager whose ``__enter__`` returns ``S3ServerInfo``."""

    def __init__(
        self, *, bucket: str = DEFAULT_BUCKET, ready_timeout: float = READY_TIMEOUT_S
    ) -> None:
        self.bucket = bucket
        self.ready_timeout = ready_timeout
        self._proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self._workdir: str | None = None
        self._info: S3ServerInfo | None = None
        self._lock = threading.Lock()
        self.start_seconds: float | None = None

    def __repr__(self) -> str:
        state = f"endpoint={self._info.endpoint_url}" if self._info else "stopped"
        return f"<MotoServer bucket={self.bucket!r} {state}>"

    @property
    def info(self) -> S3ServerInfo:
        if self._info is None:
            raise S3ServerError("the moto server is not running")
        return self._info

    def start(self) -> S3ServerInfo:
        """Start moto and wait until it answers and the bucket exists; idempotent."""
        with self._lock:
            if self._info is not None:
                return self._info
            if not moto_available():
                raise S3ServerError(
                    "moto's server mode is not installed: pip install 'moto[s3]' flask flask-cors"
                )
            t0 = time.monotonic()
            failures = []
            for _ in range(START_ATTEMPTS):
                try:
                    self._info = self._start_once()
                except S3ServerError as exc:
                    failures.append(str(exc))
                    self._kill_and_clean()
                    continue
                except BaseException:
                    self._kill_and_clean()
                    raise
                self.start_seconds = time.monotonic() - t0
                return self._info
            raise S3ServerError("moto did not start:\n" + "\n---\n".join(failures))

    def _start_once(self) -> S3ServerInfo:
        self._workdir = tempfile.mkdtemp(prefix="cloudckpt-moto-")
        work = Path(self._workdir)
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
        # The watchdog first (the SeaweedFS launcher's): from the moment moto exists, someone
        # will stop it. It finds moto as the process running this interpreter with the work dir
        # among its arguments.
        self._watchdog = subprocess.Popen(
            [sys.executable, WATCHDOG_SCRIPT, str(os.getpid()), sys.executable, self._workdir],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
        with open(work / "moto.out", "wb") as out:
            proc = self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _MOTO_SRC,
                    self._workdir,
                    "-H",
                    "127.0.0.1",
                    "-p",
                    str(port),
                ],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        endpoint = f"http://127.0.0.1:{port}"
        self._wait_ready(proc, endpoint)
        info = S3ServerInfo(
            endpoint_url=endpoint,
            region=DEFAULT_REGION,
            bucket=self.bucket,
            access_key="MK" + secrets.token_hex(9).upper(),
            secret_key=secrets.token_urlsafe(30),
            readonly_access_key="MR" + secrets.token_hex(9).upper(),
            readonly_secret_key=secrets.token_urlsafe(30),
        )
        info.boto3_client().create_bucket(Bucket=self.bucket)
        return info

    def _log_tail(self, limit: int = 3000) -> str:
        if self._workdir is None:
            return ""
        try:
            return (Path(self._workdir) / "moto.out").read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def _wait_ready(self, proc: subprocess.Popen, endpoint: str) -> None:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + self.ready_timeout
        while True:
            code = proc.poll()
            if code is not None:
                raise S3ServerError(f"moto exited with {code} during start:\n{self._log_tail()}")
            try:
                with opener.open(endpoint + "/moto-api/", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError:
                return  # it answers
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise S3ServerError(
                    f"moto at {endpoint} did not answer within "
                    f"{self.ready_timeout:.0f}s:\n{self._log_tail()}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop moto (SIGTERM, then SIGKILL) and its watchdog; idempotent."""
        with self._lock:
            self._info = None
            self._kill_and_clean()

    def _kill_and_clean(self) -> None:
        proc, self._proc = self._proc, None
        watchdog, self._watchdog = self._watchdog, None
        workdir, self._workdir = self._workdir, None
        stop_server_process(proc, watchdog, workdir)

    def __enter__(self) -> S3ServerInfo:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
