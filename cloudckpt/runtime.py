"""The background event loop that runs every coroutine of cloudckpt.

aiobotocore clients are bound to the loop they were created on, and a caller may already be
inside an event loop (a notebook, an async trainer). So cloudckpt owns one daemon thread with one
loop per process, created on first use, and synchronous entry points submit coroutines to it.

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
from typing import Any, Awaitable, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_stores: dict[tuple, Any] = {}
_pending_save: concurrent.futures.Future | None = None
_default_storage: Any = None
_finish_at_exit: list[tuple[concurrent.futures.Future, str]] = []
_failed_at_exit: list[str] = []

log = logging.getLogger(__name__)


def get_loop() -> asyncio.AbstractEventLoop:
    """Return cloudckpt's background loop, starting its thread on first use."""
    global _loop, _thread
    with _lock:
        if _loop is not None and _thread is not None and _thread.is_alive():
            return _loop
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def _serve() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=_serve, name="cloudckpt-loop", daemon=True)
        thread.start()
        ready.wait()
        _loop, _thread = loop, thread
        return loop


def in_loop_thread() -> bool:
    """True when called from cloudckpt's loop thread."""
    return _thread is not None and threading.current_thread() is _thread


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


def set_default_storage(options: Any) -> None:
    """Use ``options`` (a :class:`cloudckpt.storage.StorageOptions`) wherever a call gives none
    (``storage=None``): the command line sets them from its flags (``--timeout``). ``None``
    restores the default (the standard AWS chain)."""
    global _default_storage
    _default_storage = options


def shared_store(url: str, options: Any = None):
    """Return an open store for ``url``, sharing one connection per bucket and options.

    ``options`` is a :class:`cloudckpt.storage.StorageOptions` or ``None`` (those of
    :func:`set_default_storage`, else the standard AWS chain). For ``s3://bucket/path`` the bucket's store is opened once (one client, one
    connection pool, one request budget) and a child store for ``path`` is returned; local
    stores are cheap and opened per URL. Stores live on the background loop: use them only from
    coroutines run there. They are closed at interpreter exit.
    """
    from cloudckpt.storage import open_store, parse_store_url

    parsed = parse_store_url(url)  # ConfigError for a malformed URL, before anything is opened
    if options is None:
        options = _default_storage
    if parsed.kind == "s3":
        root = parsed.bucket_url
        with _lock:
            store = _stores.get((root, options))
            if store is None:
                store = open_store(root, options)
                _stores[(root, options)] = store
        path = parsed.prefix.strip("/")
        return store.child(path) if path else store
    return open_store(url, options)


def drop_store(url: str, options: Any = None) -> None:
    """Forget (and close) the shared connection of ``url``'s bucket; the next use reconnects
    (e.g. after the credentials in the environment changed)."""
    from cloudckpt.storage import parse_store_url

    parsed = parse_store_url(url)
    if parsed.kind != "s3":
        return
    root = parsed.bucket_url
    with _lock:
        store = _stores.pop((root, options), None)
    if store is not None and _loop is not None:
        try:
            run_coroutine(store.close(), timeout=30)
        except Exception:  # closing is best effort: the store is already forgotten
            pass


def set_pending_save(future: concurrent.futures.Future) -> None:
    """Record the background save in flight (one per process)."""
    global _pending_save
    _pending_save = future


def pending_save() -> concurrent.futures.Future | None:
    """The background save still running, or ``None``."""
    fut = _pending_save
    return fut if fut is not None and not fut.done() else None


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
    with _lock:
        _finish_at_exit[:] = [(f, u) for f, u in _finish_at_exit if not f.done()]
        _finish_at_exit.append((future, url))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def _wait_for_saves_at_exit() -> None:
    """threading exit hook: finish every registered save still running; report failures."""
    reported: set[str] = set()
    while True:
        with _lock:
            running = [(f, u) for f, u in _finish_at_exit if not f.done()]
            _finish_at_exit.clear()
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
                print(f"cloudckpt: the save to {url} did not complete before exit: "
                      f"{_one_line(exc)}", file=sys.stderr, flush=True)
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
    with _lock:
        stores = list(_stores.values())
        _stores.clear()
    if _loop is None or not stores:
        return

    async def _close() -> None:
        await asyncio.gather(*(s.close() for s in stores), return_exceptions=True)

    try:
        run_coroutine(_close(), timeout=10)
    except Exception:  # interpreter is exiting: nothing useful to do with a close failure
        pass


atexit.register(_exit_status_after_failed_save)
atexit.register(_close_all)
try:
    threading._register_atexit(_wait_for_saves_at_exit)  # as concurrent.futures does, see above
except RuntimeError:  # first imported while the interpreter exits: no save of ours can be running
    pass
