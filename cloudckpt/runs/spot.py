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
  retried once at once with a new one; after another 4xx the next poll asks for a new token.
  IMDSv1 (a GET without a token) is never used.
- A 200 answer is a notice (JSON such as ``{"action": "terminate", "time": "..."}``; ``action``
  may also be ``stop`` or ``hibernate``; a body that is not a JSON object is kept as
  ``{"raw": text}`` and still counts). At the first notice the poller calls ``on_notice()``
  exactly once, from its thread, logs a warning, keeps the notice in :attr:`notice` and stops
  polling. An exception from the callback is logged, not retried.
- Nothing a poll meets is raised, and nothing a hostile or broken endpoint answers ends the
  thread: a refused connection, a request past its deadline, a dropped connection, an error
  status, an answer that is not HTTP, a token that is not one, even a bug of the poller's own
  are logged and the next poll comes ``interval`` seconds later. Each kind of failure
  (``unreachable``, ``timed out``, ``connection dropped``, ``HTTP error``, ``not HTTP``,
  ``TLS``, ``unexpected``) is logged once at WARNING per unhealthy episode, further ones at
  DEBUG; the episode ends, with one INFO, after ``RECOVERY_POLLS`` good polls in a row (a minute
  at the default interval), so a failure that comes and goes warns once, not once per flap.
  Off EC2 the poller therefore only logs one warning.
- Each request has a total deadline of ``timeout`` seconds, from name resolution to the last
  byte of the answer (an endpoint that drips bytes or never closes is cut there). At most 16 KiB
  of status line and headers and 64 KiB of body are read; a non-200 answer's body is not read;
  redirects are not followed. A 200 to the notice GET is a notice even when its body is cut
  short (a reset, the deadline, the size limit): a notice is acted on rather than missed.
- Requests go straight to ``endpoint``, never through ``HTTP(S)_PROXY``. :meth:`stop` (or
  leaving the ``with`` block) returns within a second: a request in progress is abandoned
  within ``STOP_SLICE_S``; only a callback still running keeps the (daemon) thread alive
  longer. It is idempotent.
- The endpoint is ``options.endpoint``, else ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, else
  ``http://169.254.169.254``. In a container the token's PUT answer must be allowed one more hop:
  the instance's ``HttpPutResponseHopLimit`` must be at least 2.

Every rank may run a poller, or one per node (``LOCAL_RANK == 0``): :meth:`PreemptionHandler.
should_stop` spreads one rank's flag to all ranks at the next agreed step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cloudckpt.runs.spot_http import STOP_SLICE_S, Deadline, RequestFailed, Stopped, exchange

__all__ = [
    "SpotNoticeOptions",
    "SpotNoticePoller",
    "DEFAULT_ENDPOINT",
    "RECOVERY_POLLS",
    "STOP_SLICE_S",
    "STOP_WAIT_S",
]

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
_TOKEN_RENEW_MARGIN_S = 60.0
RECOVERY_POLLS = 12  # good polls in a row that end an unhealthy episode (1 min at 5 s)
STOP_WAIT_S = 1.0  # the longest stop() waits for the thread
MAX_NOTICE_BYTES = 65536
_MAX_TOKEN_BYTES = 4096  # real tokens are 56 characters
_TOKEN = re.compile(r"[\x21-\x7e]+")  # printable ASCII: it goes back in a header
_LOGGED_NOTICE_CHARS = 300


@dataclass(frozen=True, kw_only=True)
class SpotNoticeOptions:
    """How :class:`SpotNoticePoller` polls.

    - ``endpoint``: ``http(s)://host[:port]`` of the instance metadata service; ``None`` takes
      ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, else ``http://169.254.169.254``.
    - ``interval``: seconds between polls (AWS suggests 5; the notice comes 120 s ahead).
    - ``timeout``: seconds each HTTP request may take in all (its total deadline).
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
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path.strip("/")
        or parts.query
        or parts.fragment
    ):
        raise ValueError(
            f"{what} must be http://host[:port] or https://host[:port] with no path, got {value!r}"
        )
    return value


class _PollFailed(Exception):
    """One poll could not tell whether there is a notice (logged by the loop, never raised)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class SpotNoticePoller:
    """Polls the instance metadata for a spot interruption notice; calls ``on_notice()`` once.

    ``on_notice`` takes no argument (``PreemptionHandler.request`` fits); :attr:`notice` holds
    the notice once seen. Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self, on_notice: Callable[[], Any], *, options: SpotNoticeOptions = SpotNoticeOptions()
    ):
        if not callable(on_notice):
            raise TypeError(f"on_notice must be callable, got {on_notice!r}")
        self.on_notice = on_notice
        self.options = options
        self.endpoint = options.resolved_endpoint()
        self._token: str | None = None
        self._token_expires = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()  # kinds of failure warned about in this unhealthy episode
        self._good_polls = 0
        self._notice: dict | None = None
        self._delivered = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> SpotNoticePoller:
        """Start the polling thread (once); returns ``self``."""
        if self._thread is not None:
            raise RuntimeError("SpotNoticePoller.start() was already called")
        self._thread = threading.Thread(target=self._run, name="cloudckpt-spot-notice", daemon=True)
        self._thread.start()
        log.info(
            "cloudckpt: polling %s%s every %gs for a spot interruption notice",
            self.endpoint,
            NOTICE_PATH,
            self.options.interval,
        )
        return self

    def stop(self) -> None:
        """Stop polling; returns within ``STOP_WAIT_S`` (the thread has ended by then unless
        ``on_notice`` is still running)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_WAIT_S)

    def __enter__(self) -> SpotNoticePoller:
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
            except Stopped:
                return
            except _PollFailed as exc:
                self._failed(exc.kind, str(exc))
            except Exception as exc:  # a bug of ours must not end the only watch for a notice
                self._failed("unexpected", f"{type(exc).__name__}: {exc}", exc_info=True)
            else:
                self._succeeded()
                if notice is not None:
                    self._deliver(notice)
                    return
            self._stop.wait(self.options.interval)

    def _failed(self, kind: str, message: str, exc_info: bool = False) -> None:
        self._good_polls = 0
        if kind in self._warned:
            log.debug("cloudckpt: spot notice poll failed again (%s): %s", kind, message)
            return
        self._warned.add(kind)
        log.warning(
            "cloudckpt: spot notice poll failed (%s; retrying every %gs, logging "
            "further failures of this kind at DEBUG): %s",
            kind,
            self.options.interval,
            message,
            exc_info=exc_info,
        )

    def _succeeded(self) -> None:
        if not self._warned:
            return
        self._good_polls += 1
        if self._good_polls >= RECOVERY_POLLS:
            log.info(
                "cloudckpt: spot notice polls work again (%s: %d good polls in a row)",
                self.endpoint,
                self._good_polls,
            )
            self._warned.clear()
            self._good_polls = 0

    def _deliver(self, notice: dict) -> None:
        self._notice = notice
        log.warning(
            "cloudckpt: spot interruption notice %s: requesting a preemption save",
            json.dumps(notice, sort_keys=True)[:_LOGGED_NOTICE_CHARS],
        )
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
            answer = self._request("GET", NOTICE_PATH, {TOKEN_HEADER: token}, MAX_NOTICE_BYTES)
            if answer.status == 404:
                return None
            if answer.status == 200:  # even cut short: a notice is acted on, never missed
                return _parse_notice(answer.body.decode("utf-8", "replace"))
            if answer.status == 401 and attempt == 0:  # expired or revoked: once more, new token
                self._token = None
                continue
            if 400 <= answer.status < 500:  # the token may be what is refused: the next poll
                self._token = None  # asks for a new one
            raise _PollFailed(
                "HTTP error", f"GET {self.endpoint}{NOTICE_PATH}: HTTP {answer.status}"
            )
        return None  # pragma: no cover - the loop returns or raises

    def _valid_token(self) -> str:
        if self._token is not None and time.monotonic() < self._token_expires:
            return self._token
        ttl = self.options.token_ttl
        where = f"PUT {self.endpoint}{TOKEN_PATH}"
        answer = self._request("PUT", TOKEN_PATH, {TOKEN_TTL_HEADER: str(ttl)}, _MAX_TOKEN_BYTES)
        if answer.status != 200:
            raise _PollFailed("HTTP error", f"{where}: HTTP {answer.status} (IMDSv2 token refused)")
        token = answer.body.decode("latin-1").strip()
        if not answer.complete or not _TOKEN.fullmatch(token):
            raise _PollFailed(
                "not HTTP",
                f"{where}: the answer is not an IMDSv2 token "
                f"({len(answer.body)} bytes"
                f"{'' if answer.complete else ', cut short'})",
            )
        self._token = token
        self._token_expires = time.monotonic() + max(ttl - _TOKEN_RENEW_MARGIN_S, ttl / 2)
        return self._token

    def _request(self, method: str, path: str, headers: dict[str, str], max_body: int):
        try:
            return exchange(
                self.endpoint,
                method,
                path,
                headers,
                max_body=max_body,
                deadline=Deadline(self.options.timeout, self._stop),
            )
        except RequestFailed as exc:
            raise _PollFailed(exc.kind, str(exc)) from exc


def _parse_notice(body: str) -> dict:
    try:
        notice = json.loads(body)
    except (ValueError, RecursionError):  # nesting deep enough exhausts the parser's stack
        notice = None
    return notice if isinstance(notice, dict) else {"raw": body[:1000]}
