"""The functions that run cloudckpt's coroutines and saves, over the process's runtime context.

aiobotocore clients are bound to the loop they were created on, and a caller may already be
inside an event loop (a notebook, an async trainer). So cloudckpt owns one daemon thread with one
loop per process, created on first use, and synchronous entry points submit coroutines to it.
The loop, the shared stores and the saves in flight are pieces of
:class:`cloudckpt.runtime.context.RuntimeContext`, with every other piece of process state; this
module is their functional interface and holds the exit hooks.

Contract:
- :func:`run_coroutine` blocks the calling thread until the coroutine finishes and returns its
  result or raises its exception. Calling it *from* the loop thread is an error (it would deadlock).
- :func:`get_loop` returns the loop (for ``asyncio.run_coroutine_threadsafe``).
- Stores opened through :func:`shared_store` share one connection per bucket and options, and
  are closed at exit.
- Nothing is lost at exit: a save registered with :func:`finish_before_exit` that is still running
  when the interpreter starts to exit is completed first, while this loop and every executor are
  still alive (the wait runs as a ``threading`` exit hook, ahead of ``concurrent.futures``' own,
  so it also precedes the join of non-daemon threads and every ``atexit`` handler). If such a save
  fails, stderr gets one line per URL (``cloudckpt: the save to URL did not complete before
  exit: Error: message``) and the process exits with status 1 once the ``atexit`` handlers
  registered after cloudckpt was imported have run (a script's own non-zero status becomes 1 too).
- :func:`reset` returns the process to the state before cloudckpt's first call (waits for saves,
  closes stores, stops the loop; see :meth:`cloudckpt.runtime.context.RuntimeContext.reset`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # registers its exit hook first, so that ours runs before it
import logging
import os
import sys
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

from cloudckpt.runtime.context import current

T = TypeVar("T")

_failed_at_exit: list[str] = []  # URLs whose save failed at exit: the exit status becomes 1

log = logging.getLogger(__name__)


def get_loop() -> asyncio.AbstractEventLoop:
    """Return cloudckpt's background loop, starting its thread on first use."""
    return current().loop.get()


def in_loop_thread() -> bool:
    """True when called from cloudckpt's loop thread."""
    return current().loop.owns_current_thread()


def submit(coro: Awaitable[T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the background loop and return a concurrent future."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop())  # type: ignore[arg-type]


class BackgroundTask:
    """A coroutine running on the background loop, started by :func:`start_task`.

    Unlike the future of :func:`submit`, :meth:`cancel_and_wait` returns only once the
    coroutine has really stopped, so nothing it does (such as writing fetched bytes into a
    caller's tensors) can happen after that.
    """

    def __init__(self, task: asyncio.Task):
        self._task = task

    def result(self) -> Any:
        """Wait for the coroutine and return its result (or raise its exception)."""
        return asyncio.run_coroutine_threadsafe(_await_task(self._task), get_loop()).result()

    def cancel_and_wait(self, timeout: float | None = None) -> None:
        """Cancel the coroutine and wait until it has stopped (its outcome is discarded)."""
        asyncio.run_coroutine_threadsafe(_cancel_task(self._task), get_loop()).result(timeout)


async def _start_task(coro) -> asyncio.Task:
    return asyncio.ensure_future(coro)


async def _await_task(task: asyncio.Task):
    return await asyncio.shield(task)


async def _cancel_task(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def start_task(coro: Awaitable[T]) -> BackgroundTask:
    """Start ``coro`` on the background loop (see :class:`BackgroundTask`)."""
    return BackgroundTask(run_coroutine(_start_task(coro)))


def run_coroutine(coro: Awaitable[T], timeout: float | None = None) -> T:
    """Run ``coro`` on the background loop and wait for it (at most ``timeout`` seconds).

    On timeout the coroutine is cancelled and ``TimeoutError`` is raised.
    """
    if in_loop_thread():
        raise RuntimeError("run_coroutine called from cloudckpt's own loop thread")
    fut = submit(coro)
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError as exc:
        fut.cancel()
        raise TimeoutError(f"cloudckpt operation did not finish within {timeout} s") from exc
    finally:
        # a raised exception's traceback holds this frame, the frame the future, the future the
        # exception: without this, each expected miss (a HEAD's ObjectNotFound) is a cycle
        del fut


def set_default_storage(options: Any) -> None:
    """Use ``options`` (a :class:`cloudckpt.storage.StorageOptions`) wherever a call gives none
    (``storage=None``): the command line sets them from its flags (``--timeout``). ``None``
    restores the default (the standard AWS chain)."""
    current().default_storage = options


def shared_store(url: str, options: Any = None):
    """Return an open store for ``url``, sharing one connection per bucket and options.

    ``options`` is a :class:`cloudckpt.storage.StorageOptions` or ``None`` (those of
    :func:`set_default_storage`, else the standard AWS chain). For ``s3://bucket/path`` the
    bucket's store is opened once (one client, one connection pool, one request budget) and a
    child store for ``path`` is returned; local stores are cheap and opened per URL. Stores live
    on the background loop: use them only from coroutines run there. They are closed by
    :func:`reset` and at interpreter exit.
    """
    from cloudckpt.storage.stores import open_store
    from cloudckpt.storage.urls import parse_store_url

    parsed = parse_store_url(url)  # ConfigError for a malformed URL, before anything is opened
    if options is None:
        options = current().default_storage
    if parsed.kind == "s3":
        store = current().bucket_store(parsed.bucket_url, options)
        path = parsed.prefix.strip("/")
        return store.child(path) if path else store
    return open_store(url, options)


def open_in_background(store) -> None:
    """Start opening ``store``'s connection (an S3 client: botocore's session and service model,
    a good tenth of a second) on the background loop while the caller goes on planning; a
    cheap no-op once it is open, and for stores that have none. An error is left to the
    store's first real request, which raises it."""
    opener = getattr(getattr(store, "connection", None), "client", None)
    if callable(opener):
        submit(opener()).add_done_callback(lambda f: f.cancelled() or f.exception())


def drop_store(url: str, options: Any = None) -> None:
    """Forget (and close) the shared connection of ``url``'s bucket; the next use reconnects
    (e.g. after the credentials in the environment changed)."""
    from cloudckpt.storage.urls import parse_store_url

    parsed = parse_store_url(url)
    if parsed.kind == "s3":
        current().drop_bucket_store(parsed.bucket_url, options)


def set_pending_save(future: concurrent.futures.Future) -> None:
    """Record the background save in flight (one per process)."""
    current().set_pending_save(future)


def pending_save() -> concurrent.futures.Future | None:
    """The background save still running, or ``None``."""
    return current().pending_save()


def wait_for_pending_save(timeout: float | None = None) -> None:
    """Block until the background save (if any) finished. Its error stays with its handle.

    Every collective entry point calls this first, so cloudckpt's control traffic of two
    operations never interleaves.
    """
    fut = pending_save()
    if fut is not None:
        concurrent.futures.wait([fut], timeout=timeout)


def finish_before_exit(future: concurrent.futures.Future, url: str) -> None:
    """Make interpreter exit wait for ``future`` (a save to ``url``) and report its failure.

    See the module docstring. Futures already done are forgotten at the next registration.
    """
    current().finish_before_exit(future, url)


def reset() -> None:
    """Return cloudckpt's process state to what it was before the first call.

    Waits for every async save (their errors stay with their handles), closes the shared stores,
    stops the loop and save threads, releases the staging buffers and clears the plan caches; the
    next call starts afresh. cloudckpt's process groups are kept: they live as long as the
    default process group they belong to and are replaced automatically after it is destroyed,
    so this may be called on any subset of ranks. Call it when no other cloudckpt call runs in
    the process. See :mod:`cloudckpt.runtime.context`.
    """
    current().reset()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def _wait_for_saves_at_exit() -> None:
    """threading exit hook: finish every registered save still running; report failures."""
    reported: set[str] = set()
    while True:
        running = current().take_saves_to_finish()
        if not running:
            return
        for future, url in running:
            log.info("cloudckpt: finishing the save to %s before exit", url)
            try:
                exc = future.exception()
            except concurrent.futures.CancelledError as cancelled:
                exc = cancelled
            except KeyboardInterrupt as interrupted:
                exc = interrupted
                future.cancel()
            if exc is None or url in reported:
                continue
            reported.add(url)
            _failed_at_exit.append(url)
            try:
                print(
                    f"cloudckpt: the save to {url} did not complete before exit: {_one_line(exc)}",
                    file=sys.stderr,
                    flush=True,
                )
            except (OSError, ValueError):  # stderr closed: the exit status still tells
                pass


def _exit_status_after_failed_save() -> None:
    """atexit handler (registered first, so it runs after those registered later): exit 1
    when a save failed at exit."""
    if not _failed_at_exit:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(1)


def _close_all() -> None:
    current().close_stores()  # the interpreter is exiting: a close failure changes nothing


atexit.register(_exit_status_after_failed_save)
atexit.register(_close_all)
try:
    # as concurrent.futures does, see above; private to CPython and absent from typeshed
    threading._register_atexit(_wait_for_saves_at_exit)  # type: ignore[attr-defined]
except RuntimeError:  # first imported while the interpreter exits: no save of ours can be running
    pass
