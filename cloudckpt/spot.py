"""Turn an EC2 spot interruption notice into the same stop a SIGTERM gives (optional).

AWS announces a spot interruption in the instance metadata two minutes ahead; the SIGTERM, if
one comes at all (a node termination handler, Karpenter, a Slurm plugin), may come much later.
:class:`SpotNoticePoller` reads the notice and calls a callback, meant to be
:meth:`cloudckpt.PreemptionHandler.request`, which sets the flag a SIGTERM sets::

    with cloudckpt.PreemptionHandler(mgr) as preempt, \\
            cloudckpt.SpotNoticePoller(preempt.request):
        ...   # the training loop, unchanged: checkpoint_if_preempted(step, state) every step

Contract:

- A daemon thread polls every ``interval`` seconds, first at :meth:`start`. One poll is IMDSv2:
  ``PUT {endpoint}/latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` (the token is
  kept until a minute before its ``token_ttl`` ends), then
  ``GET {endpoint}/latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``.
  404 means no notice. 401 means the token is no longer valid: it is dropped and the poll is
  retried once at once with a new one. IMDSv1 (a GET without a token) is never used.
- A 200 answer is a notice (JSON such as ``{"action": "terminate", "time": "..."}``; ``action``
  may also be ``stop`` or ``hibernate``; a body that is not a JSON object is kept as
  ``{"raw": text}`` and still counts). At the first notice the poller calls ``on_notice()``
  exactly once, from its thread, logs a warning, keeps the notice in :attr:`notice` and stops
  polling. An exception from the callback is logged, not retried.
- Nothing a poll meets is raised: a refused connection, a timeout, a 5xx, a token refused are
  logged (the first failure at WARNING, further ones at DEBUG, the recovery at INFO) and the next
  poll comes ``interval`` seconds later. Off EC2 the poller therefore only logs one warning.
- Requests go straight to ``endpoint``, never through ``HTTP(S)_PROXY``; each is bounded by
  ``timeout``. :meth:`stop` (or leaving the ``with`` block) waits for the poll in progress (at
  most four requests: token, 401, new token, GET), then the thread has ended; it is idempotent.
- The endpoint is ``options.endpoint``, else ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, else
  ``http://169.254.169.254``. In a container the token's PUT answer must be allowed one more hop:
  the instance's ``HttpPutResponseHopLimit`` must be at least 2.

Every rank may run a poller, or one per node (``LOCAL_RANK == 0``): :meth:`PreemptionHandler.
should_stop` spreads one rank's flag to all ranks at the next agreed step.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["SpotNoticeOptions", "SpotNoticePoller", "DEFAULT_ENDPOINT"]

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
_TOKEN_RENEW_MARGIN_S = 60.0


@dataclass(frozen=True, kw_only=True)
class SpotNoticeOptions:
    """How :class:`SpotNoticePoller` polls.

    - ``endpoint``: ``http(s)://host[:port]`` of the instance metadata service; ``None`` takes
      ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, else ``http://169.254.169.254``.
    - ``interval``: seconds between polls (AWS suggests 5; the notice comes 120 s ahead).
    - ``timeout``: seconds each HTTP request may take.
    - ``token_ttl``: lifetime asked for each IMDSv2 token, 1..21600 seconds.
    """

    endpoint: str | None = None
    interval: float = 5.0
    timeout: float = 2.0
    token_ttl: int = 21600

    def __post_init__(self):
        for name in ("interval", "timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SpotNoticeOptions.{name} must be a number > 0, got {value!r}")
        ttl = self.token_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= 21600:
            raise ValueError(f"SpotNoticeOptions.token_ttl must be an int in 1..21600, got {ttl!r}")
        if self.endpoint is not None:
            _check_endpoint(self.endpoint, "SpotNoticeOptions.endpoint")

    def resolved_endpoint(self) -> str:
        """The endpoint polled: the option, else the environment variable, else the default."""
        if self.endpoint is not None:
            return self.endpoint.rstrip("/")
        from_env = os.environ.get(ENDPOINT_ENV)
        if from_env:
            return _check_endpoint(from_env, ENDPOINT_ENV).rstrip("/")
        return DEFAULT_ENDPOINT


def _check_endpoint(value: str, what: str) -> str:
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") \
            or parts.query or parts.fragment:
        raise ValueError(f"{what} must be http://host[:port] or https://host[:port] with no path, got {value!r}")
    return value


class _PollFailed(Exception):
    """One poll could not tell whether there is a notice (logged by the loop, never raised)."""


class SpotNoticePoller:
    """Polls the instance metadata for a spot interruption notice; calls ``on_notice()`` once.

    ``on_notice`` takes no argument (``PreemptionHandler.request`` fits); :attr:`notice` holds
    the notice once seen. Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, on_notice: Callable[[], Any], *,
                 options: SpotNoticeOptions = SpotNoticeOptions()):
        if not callable(on_notice):
            raise TypeError(f"on_notice must be callable, got {on_notice!r}")
        self.on_notice = on_notice
        self.options = options
        self.endpoint = options.resolved_endpoint()
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._token: str | None = None
        self._token_expires = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._notice: dict | None = None
        self._delivered = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "SpotNoticePoller":
        """Start the polling thread (once); returns ``self``."""
        if self._thread is not None:
            raise RuntimeError("SpotNoticePoller.start() was already called")
        self._thread = threading.Thread(target=self._run, name="cloudckpt-spot-notice",
                                        daemon=True)
        self._thread.start()
        log.info("cloudckpt: polling %s%s every %gs for a spot interruption notice",
                 self.endpoint, NOTICE_PATH, self.options.interval)
        return self

    def stop(self) -> None:
        """Stop polling and wait for the thread (at most the poll in progress)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> "SpotNoticePoller":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the polling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def notice(self) -> dict | None:
        """The notice seen (``{"action": ..., "time": ...}``), or ``None``."""
        return self._notice

    def wait_for_notice(self, timeout: float | None = None) -> bool:
        """Block until a notice was delivered (or ``timeout``); whether it was."""
        return self._delivered.wait(timeout)

    # -- polling --------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self._poll_once()
            except _PollFailed as exc:
                if not self._failing:
                    log.warning("cloudckpt: spot notice poll failed (will retry every %gs): %s",
                                self.options.interval, exc)
                else:
                    log.debug("cloudckpt: spot notice poll failed again: %s", exc)
                self._failing = True
            else:
                if self._failing:
                    log.info("cloudckpt: spot notice polls work again (%s)", self.endpoint)
                    self._failing = False
                if notice is not None:
                    self._deliver(notice)
                    return
            self._stop.wait(self.options.interval)

    def _deliver(self, notice: dict) -> None:
        self._notice = notice
        log.warning("cloudckpt: spot interruption notice %s: requesting a preemption save",
                    json.dumps(notice, sort_keys=True))
        try:
            self.on_notice()
        except Exception:  # the callback's failure must not end the process from this thread
            log.exception("cloudckpt: the spot notice callback failed")
        finally:
            self._delivered.set()

    def _poll_once(self) -> dict | None:
        """One poll: the notice, or ``None`` when there is none; ``_PollFailed`` if unknown."""
        for attempt in range(2):
            token = self._valid_token()
            status, body = self._request("GET", NOTICE_PATH, {TOKEN_HEADER: token})
            if status == 404:
                return None
            if status == 200:
                return _parse_notice(body)
            if status == 401 and attempt == 0:  # expired or revoked: one retry with a new token
                self._token = None
                continue
            raise _PollFailed(f"GET {NOTICE_PATH}: HTTP {status}")
        return None  # pragma: no cover - the loop returns or raises

    def _valid_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_expires:
            return self._token
        ttl = self.options.token_ttl
        status, body = self._request("PUT", TOKEN_PATH, {TOKEN_TTL_HEADER: str(ttl)})
        if status != 200 or not body.strip():
            raise _PollFailed(f"PUT {TOKEN_PATH}: HTTP {status} (IMDSv2 token refused)")
        self._token = body.strip()
        self._token_expires = time.monotonic() + max(ttl - _TOKEN_RENEW_MARGIN_S, ttl / 2)
        return self._token

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        request = urllib.request.Request(self.endpoint + path, method=method, headers=headers)
        try:
            with self._opener.open(request, timeout=self.options.timeout) as response:
                return response.status, response.read(65536).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, ""
        except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, reset, timeout
            raise _PollFailed(f"{method} {self.endpoint}{path}: {exc}") from exc


def _parse_notice(body: str) -> dict:
    try:
        notice = json.loads(body)
    except ValueError:
        notice = None
    return notice if isinstance(notice, dict) else {"raw": body[:1000]}
