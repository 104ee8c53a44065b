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
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from typing import Any, Awaitable, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_stores: dict[tuple, Any] = {}
_pending_save: concurrent.futures.Future | None = None


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


def shared_store(url: str, options: Any = None):
    """Return an open store for ``url``, sharing one connection per bucket and options.

    ``options`` is a :class:`cloudckpt.storage.StorageOptions` or ``None`` (the standard AWS
    chain). For ``s3://bucket/path`` the bucket's store is opened once (one client, one
    connection pool, one request budget) and a child store for ``path`` is returned; local
    stores are cheap and opened per URL. Stores live on the background loop: use them only from
    coroutines run there. They are closed at interpreter exit.
    """
    from cloudckpt.storage import open_store

    if isinstance(url, str) and url.startswith("s3://"):
        bucket, _, path = url[len("s3://"):].partition("/")
        root = f"s3://{bucket}"
        with _lock:
            store = _stores.get((root, options))
            if store is None:
                store = open_store(root, options)
                _stores[(root, options)] = store
        path = path.strip("/")
        return store.child(path) if path else store
    return open_store(url, options)


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


atexit.register(_close_all)
