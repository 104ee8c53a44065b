"""The choke point every backend request goes through: bounded concurrency, per-attempt cap,
overall deadline, exponential full-jitter backoff, request counting, logging and error
translation.

A backend supplies ``classify(exc, op, key, name) -> Verdict`` (``name`` is the object's URL, for
messages): whether the failure is worth another
attempt, and the ``cloudckpt.errors`` exception to raise when it is not (or when attempts run
out, as ``RetriesExhausted.last_cause``'s translation). Logs name the operation, key and attempt;
error texts are the server's code and message, which never carry secrets.

The deadline of an operation counts from when it is called, and every wait inside it counts
against it: for a request slot (the store's concurrency limit), for buffer memory (the store's
byte budget, see :meth:`Retrier.wait`), for a request, and between attempts. An operation still
waiting when its deadline passes stops waiting and raises ``RetriesExhausted`` ("deadline passed
while waiting for ..."), the error that running out of time between attempts raises: it never
waits on and then sends a request it has no time left for. An operation whose attempts got no
answer at all (``Verdict.stalled``: connect or read timeouts) ``RetryOptions.max_stalls`` times in
a row gives up too: a dead endpoint fails in about ``max_stalls * read_timeout``, not at the
deadline.

Logging: at most one WARNING per operation (its first retry); later retries at DEBUG; the
final error (``RetriesExhausted``: operation, object, attempts, seconds spent, last cause,
endpoint) is raised, not logged above DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from cloudckpt.errors import RetriesExhausted
from cloudckpt.storage.base import StoreStats
from cloudckpt.storage.options import RetryOptions
from cloudckpt.wording import plural, seconds

logger = logging.getLogger("cloudckpt.storage")

T = TypeVar("T")


@dataclass(frozen=True)
class Verdict:
    """How to handle one failed attempt: retry it, or raise ``error`` (``None``: re-raise as is)."""

    retry: bool
    error: BaseException | None = None
    reason: str = ""
    stalled: bool = False  #: the attempt got no answer at all (connect or read timeout)


class AttemptTimeout(TimeoutError):
    """An attempt ran past ``RetryOptions.attempt_timeout`` (retriable)."""


class _WaitExpired(Exception):
    """A wait for a slot or for memory outlived the operation's deadline."""


if sys.version_info >= (3, 11):

    async def _with_timeout(coro: Awaitable[T], seconds: float) -> T:
        cap = asyncio.timeout(seconds)
        try:
            async with cap:
                return await coro
        except TimeoutError as exc:
            if not cap.expired():  # the attempt's own timeout (a read timeout...): keep it
                raise
            raise AttemptTimeout(f"attempt exceeded {seconds:.1f}s") from exc
        finally:
            # the Timeout holds the task, the task its error, the error's traceback this frame:
            # a reference cycle for every failed request, unless the frame lets go of it
            del cap

    async def _wait_until(coro: Awaitable[T], deadline: float) -> T:
        try:
            async with asyncio.timeout_at(deadline):
                return await coro
        except TimeoutError as exc:
            raise _WaitExpired() from exc
else:  # pragma: no cover - Python 3.10

    async def _with_timeout(coro: Awaitable[T], seconds: float) -> T:
        try:
            return await asyncio.wait_for(coro, seconds)
        except asyncio.TimeoutError as exc:
            raise AttemptTimeout(f"attempt exceeded {seconds:.1f}s") from exc

    async def _wait_until(coro: Awaitable[T], deadline: float) -> T:
        try:
            return await asyncio.wait_for(coro, deadline - asyncio.get_running_loop().time())
        except asyncio.TimeoutError as exc:
            raise _WaitExpired() from exc


def _name(where: str, key: str | None) -> str:
    return f"{where.rstrip('/')}/{key}" if key else where


class Retrier:
    """Runs the attempts of one operation under the store's concurrency limit: ``slots`` is
    held only while an attempt runs (not while sleeping between attempts).

    Logging: the first retry of an operation is one WARNING (what failed, that it is retried);
    later retries are DEBUG; giving up is the raised error itself (logged at DEBUG). The error
    names the operation, the object, the attempts made and the seconds spent, the last cause,
    and ``describe()`` (the backend's words for where the requests went: the endpoint)."""

    def __init__(
        self,
        *,
        options: RetryOptions,
        stats: StoreStats,
        slots: asyncio.Semaphore,
        classify: Callable[[BaseException, str, str | None, str], Verdict],
        describe: Callable[[], str] | None = None,
    ):
        self.options = options
        self.stats = stats
        self.slots = slots
        self.classify = classify
        self.describe = describe

    def deadline(self) -> float:
        """The deadline (event loop time) of an operation starting now."""
        return asyncio.get_running_loop().time() + self.options.deadline

    async def wait(
        self,
        waiting: Awaitable[T],
        *,
        what: str,
        op: str,
        key: str | None,
        where: str,
        deadline: float,
    ) -> T:
        """Await ``waiting`` (an acquisition that undoes itself when cancelled, such as
        ``ByteBudget.acquire``) unless ``deadline`` passes first: then ``RetriesExhausted``
        ("deadline passed while waiting for ``what``"), as for an operation out of time."""
        try:
            return await _wait_until(waiting, deadline)
        except _WaitExpired:
            name = _name(where, key)
            raise self._exhausted(
                op,
                key,
                name,
                0,
                None,
                f"deadline passed while waiting for {what}",
                deadline - self.options.deadline,
            ) from None

    async def call(
        self,
        op: str,
        key: str | None,
        attempt: Callable[[int], Awaitable[T]],
        *,
        where: str,
        deadline: float | None = None,
    ) -> T:
        """Run ``attempt(n)`` (n = 1, 2, ...) until it returns, fails for good, or runs out of
        attempts or time. ``key`` is the store-relative key (or None), ``where`` the store URL
        (messages name ``where/key``). ``deadline`` (event loop time) is that of the operation
        this call belongs to when it started earlier (see :meth:`deadline`); by default the
        call starts one. Waiting for a request slot counts against it (module docstring)."""
        name = _name(where, key)
        opts = self.options
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + opts.deadline
        started = deadline - opts.deadline

        def give_up(attempts: int, why: str) -> RetriesExhausted:
            return self._exhausted(op, key, name, attempts, last, why, started)

        n = stalls = 0
        last: BaseException | None = None
        verdict: Verdict | None = None
        try:
            while True:
                n += 1
                if deadline - loop.time() <= 0:
                    raise give_up(n - 1, "its deadline passed") from last
                try:
                    if self.slots.locked():
                        await _wait_until(self.slots.acquire(), deadline)
                    else:
                        await self.slots.acquire()  # free: returns at once, no timer needed
                except _WaitExpired:
                    raise give_up(
                        n - 1, "deadline passed while waiting for a request slot"
                    ) from last
                try:  # the slot is held only while the attempt runs; its cap counts from here
                    self._count(op, n)
                    cap = min(opts.attempt_timeout, max(deadline - loop.time(), 0.001))
                    return await _with_timeout(attempt(n), cap)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    verdict = self.classify(exc, op, key, name)
                    if not verdict.retry:
                        if verdict.error is None:
                            raise
                        raise verdict.error from exc
                    last = exc
                    reason = verdict.reason or type(exc).__name__
                    stalls = stalls + 1 if verdict.stalled else 0
                finally:
                    self.slots.release()
                if stalls >= opts.max_stalls:
                    raise give_up(
                        n,
                        f"no answer: {plural(stalls, 'attempt')} in a row timed out "
                        f"(connect timeout {opts.connect_timeout:g} s, read timeout "
                        f"{opts.read_timeout:g} s)",
                    ) from last
                if n >= opts.max_attempts:
                    raise give_up(n, "every attempt failed") from last
                delay = random.uniform(0.0, min(opts.max_delay, opts.base_delay * (2 ** (n - 1))))
                if loop.time() + delay >= deadline:
                    raise give_up(n, "its deadline would pass before the next attempt") from last
                if n == 1:
                    logger.warning(
                        "%s %s failed (%s); retrying in %.2fs, at most %d attempts "
                        "within %s (further retries are logged at DEBUG)",
                        op,
                        name,
                        reason,
                        delay,
                        opts.max_attempts,
                        seconds(opts.deadline),
                    )
                else:
                    logger.debug(
                        "%s %s attempt %d/%d failed (%s); retrying in %.2fs",
                        op,
                        name,
                        n,
                        opts.max_attempts,
                        reason,
                        delay,
                    )
                await asyncio.sleep(delay)
        finally:
            # a raised error's traceback holds this frame, and the frame the error (``verdict``,
            # ``last``, ``give_up``'s cell): without this every failed request, an expected
            # miss included (a HEAD's 404), is a reference cycle left for the garbage collector
            last = verdict = None

    def _count(self, op: str, n: int) -> None:
        self.stats.count(op)
        if n > 1:
            self.stats.retries += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s attempt %d", op, n)

    def _exhausted(
        self,
        op: str,
        key: str | None,
        name: str,
        attempts: int,
        last: BaseException | None,
        why: str,
        started: float,
    ) -> RetriesExhausted:
        spent = max(asyncio.get_running_loop().time() - started, 0.0)
        text = (
            f"{op} {name}: gave up after {plural(attempts, 'attempt')} in {seconds(spent)}, {why}"
        )
        if last is not None:
            text += f"; last error: {type(last).__name__}: {last}"
        if self.describe is not None:
            text += f"; {self.describe()}"
        logger.debug("%s", text)
        return RetriesExhausted(text, key=key, operation=op, attempts=attempts, last_cause=last)
