"""Every piece of state cloudckpt keeps in a process between calls, held by one object.

:func:`current` returns the process's :class:`RuntimeContext`. It is created empty at import;
each piece below is created on first use, and :meth:`RuntimeContext.reset` returns the whole
context to that empty state (``cloudckpt.runtime.loop.reset()`` is the public way to call it).

==================  =========================================  ===================================
piece               what it holds                              lifetime
==================  =========================================  ===================================
``loop``            the background event loop and its daemon   started by the first coroutine run;
                    thread (:class:`LoopThread`)               stopped by ``reset``; at exit it
                                                               dies with the process
``open_stores``     one open store per S3 bucket root and      opened on first use; closed by
                    ``StorageOptions`` (one client, one        ``reset`` and at interpreter exit
                    connection pool, one request budget)
``groups``          the gloo groups cloudckpt created (control those of one default process group:
                    lanes, broadcast subgroups), by key        dropped when it is destroyed or
                    (:class:`GroupCache`)                      replaced (see GroupCache); kept
                                                               by ``reset``
``joins``           the count of collective calls joined, per  the same as ``groups``
                    group of ranks and lane
                    (``cloudckpt.groups.join``; a GroupCache)
``save_plans``      global save plans by every rank's          cleared by ``reset``
                    fingerprints (``SavePlanCache``, 8 plans)
``staging``         host copies of async saves                 created by the first async save;
                    (``runtime.staging.StagingPool``), reused  buffers released by ``reset``
                    between saves
``save_executor``   the one thread that runs async saves'      created by the first async save;
                    uploads and commits (and then the          shut down by ``reset``
                    manager's follow-up work)
``pending_save``,   the async save in flight; every save       until done; ``reset`` and exit wait
``finish_at_exit``  that interpreter exit must complete        for them (``runtime`` exit hooks)
==================  =========================================  ===================================

Outside the context, only pure memos stay in modules: the decoded plan headers of the plan codecs
(``planning.lru.LRUCache``, 16 each; ``reset`` clears them) and the table of combined error
classes (``errors.checkpoint_error_class``). They are functions of their keys and never stale.

Process groups are kept by ``reset`` on purpose: they are torch's, valid exactly as long as the
default group they were created in, and every rank must create a group together; forgetting them
on one rank would make its next save create groups the other ranks do not (a hang), and would
leave torch holding the old ones. ``reset`` may therefore be called on any subset of ranks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from cloudckpt.planning.memos import clear_header_caches
from cloudckpt.planning.save.cache import SavePlanCache

if TYPE_CHECKING:  # imported on first use: importing the context does not import torch
    from cloudckpt.runtime.staging import StagingPool


class LoopThread:
    """cloudckpt's background event loop, on its own daemon thread, started on first use.

    aiobotocore clients are bound to the loop they were created on, and a caller may already be
    inside an event loop (a notebook, an async trainer), so every coroutine of cloudckpt runs
    here. :meth:`stop` ends the thread; the next :meth:`get` starts a new one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def get(self) -> asyncio.AbstractEventLoop:
        """The running loop, starting its thread if needed."""
        with self._lock:
            if self._loop is not None and self._thread is not None and self._thread.is_alive():
                return self._loop
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def _serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            thread = threading.Thread(target=_serve, name="cloudckpt-loop", daemon=True)
            thread.start()
            ready.wait()
            self._loop, self._thread = loop, thread
            return loop

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def owns_current_thread(self) -> bool:
        """True when called from the loop's own thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what still runs on the loop, stop it and join its thread (no-op if stopped)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None or not thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(_wind_down(), loop).result(timeout)
        except Exception:  # best effort: the loop is stopped below whatever happened
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        if not thread.is_alive():
            loop.close()


async def _wind_down() -> None:
    me = asyncio.current_task()
    others = [t for t in asyncio.all_tasks() if t is not me]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    loop = asyncio.get_running_loop()
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()


class GroupCache:
    """Process groups cloudckpt created, by key, for one default process group (the world).

    :meth:`get` takes the current world's group object (``torch.distributed.group.WORLD``, read
    by the caller: this module does not import torch). When it is not the object the cached
    groups were created under (the default group was destroyed, and maybe created again), every
    cached group is dropped first: torch destroyed them with their world. Identity is checked
    through a weak reference, so a destroyed world's object is never kept alive and a new world
    can never be mistaken for it. Reading torch's private ``_world`` bookkeeping, or hooking
    ``destroy_process_group``, would do the same less robustly.

    Groups are created under the cache's lock, by the ``create`` callable: creation is collective,
    and every rank must create the same groups in the same order (see ``transport``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._world: weakref.ref | None = None
        self._groups: dict[Hashable, Any] = {}

    def get(self, world: Any, key: Hashable, create: Callable[[], Any]) -> Any:
        """The group of ``key`` in ``world``, created by ``create()`` the first time."""
        with self._lock:
            if self._world is None or self._world() is not world:
                self._groups.clear()
                self._world = weakref.ref(world)
            group = self._groups.get(key)
            if group is None:
                group = create()
                self._groups[key] = group
            return group

    def snapshot(self, world: Any) -> dict[Hashable, Any]:
        """The groups held for ``world`` (empty when they belong to another one)."""
        with self._lock:
            if self._world is None or self._world() is not world:
                return {}
            return dict(self._groups)


class RuntimeContext:
    """The process's cloudckpt state (see the module docstring for each piece's lifetime)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loop = LoopThread()
        self.groups = GroupCache()
        self.joins = GroupCache()
        self.save_plans = SavePlanCache(maxsize=8)
        self._stores: dict[tuple, Any] = {}
        self.default_storage: Any = None
        """``StorageOptions`` used where a call gives none (the CLI's flags); kept by ``reset``."""
        self._staging: StagingPool | None = None
        self._save_executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._save_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._pending_save: concurrent.futures.Future | None = None
        self._finish_at_exit: list[tuple[concurrent.futures.Future, str]] = []
        self.generation = 0
        """Counts resets: an object holding a store of an earlier generation opens a new one."""

    # -- stores -----------------------------------------------------------------------------------

    def bucket_store(self, root: str, options: Any):
        """The shared open store of ``root`` (``s3://bucket``) and ``options``."""
        from cloudckpt.storage.stores import open_store

        with self._lock:
            store = self._stores.get((root, options))
            if store is None:
                store = open_store(root, options)
                self._stores[(root, options)] = store
            return store

    def drop_bucket_store(self, root: str, options: Any) -> None:
        """Forget the shared store of ``root`` and ``options`` and close it (best effort): the
        next use opens a new one (e.g. after the credentials in the environment changed)."""
        with self._lock:
            store = self._stores.pop((root, options), None)
        if store is None or not self.loop.running:
            return
        try:
            asyncio.run_coroutine_threadsafe(store.close(), self.loop.get()).result(30)
        except Exception:  # closing is best effort: the store is forgotten already
            pass

    @property
    def open_stores(self) -> tuple[tuple[str, Any], ...]:
        """The ``(bucket root, options)`` of every shared store open now."""
        with self._lock:
            return tuple(self._stores)

    def close_stores(self, timeout: float = 10.0) -> None:
        """Forget every shared store and close them on the loop (best effort)."""
        with self._lock:
            stores = list(self._stores.values())
            self._stores.clear()
        if not stores or not self.loop.running:
            return

        async def _close() -> None:
            await asyncio.gather(*(s.close() for s in stores), return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_close(), self.loop.get()).result(timeout)
        except Exception:  # closing is best effort: the stores are forgotten already
            pass

    # -- async saves ------------------------------------------------------------------------------

    def staging_pool(self, limit_bytes: int | None) -> StagingPool:
        """The pool async saves stage into, bounded by ``limit_bytes`` (``None``: unbounded).

        The limit is each save's ``SaveOptions.max_async_staging_bytes``: it is set when the
        pool is created and changed only when a save comes with another value. One save stages
        at a time (async_save waits for the previous one), so the limit in force is always that
        of the save being staged.
        """
        with self._lock:
            if self._staging is None:
                from cloudckpt.runtime.staging import StagingPool

                self._staging = StagingPool(limit_bytes=limit_bytes)
            elif self._staging.limit_bytes != limit_bytes:
                self._staging.limit_bytes = limit_bytes
            return self._staging

    @property
    def staging(self) -> StagingPool | None:
        """The staging pool, or ``None`` before the first async save."""
        return self._staging

    @property
    def staging_allocations(self) -> int:
        """Staging buffers allocated in this process so far (reuse keeps it flat)."""
        pool = self._staging
        return pool.allocations if pool is not None else 0

    def save_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one thread running async saves' uploads and commits (and the manager's follow-up
        work after each, queued behind it)."""
        with self._lock:
            if self._save_executor is None:
                self._save_executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix="cloudckpt-save",
                    initializer=lambda: self._save_threads.add(threading.current_thread()),
                )
            return self._save_executor

    def set_pending_save(self, future: concurrent.futures.Future) -> None:
        self._pending_save = future

    def pending_save(self) -> concurrent.futures.Future | None:
        fut = self._pending_save
        return fut if fut is not None and not fut.done() else None

    def finish_before_exit(self, future: concurrent.futures.Future, url: str) -> None:
        """Register ``future`` (a save to ``url``); futures already done are forgotten."""
        with self._lock:
            self._finish_at_exit[:] = [(f, u) for f, u in self._finish_at_exit if not f.done()]
            self._finish_at_exit.append((future, url))

    def take_saves_to_finish(self) -> list[tuple[concurrent.futures.Future, str]]:
        """The registered saves still running; the registry is emptied."""
        with self._lock:
            running = [(f, u) for f, u in self._finish_at_exit if not f.done()]
            self._finish_at_exit.clear()
            return running

    # -- lifetime ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """Return to the empty state: wait for every async save (their errors stay with their
        handles), close the shared stores, stop the loop thread and the save thread, release the
        staging buffers, clear the plan caches. Process groups stay (module docstring).

        Call it when no other cloudckpt call is running in this process; not from cloudckpt's own
        threads (a done-callback of a save), which raises ``RuntimeError``.
        """
        me = threading.current_thread()
        if self.loop.owns_current_thread() or me in self._save_threads:
            raise RuntimeError("cloudckpt's runtime cannot be reset from one of its own threads")
        with self._lock:
            waiting = [f for f, _ in self._finish_at_exit]
            if self._pending_save is not None:
                waiting.append(self._pending_save)
        concurrent.futures.wait(waiting)
        with self._lock:
            self._finish_at_exit.clear()
            self._pending_save = None
            executor, self._save_executor = self._save_executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self.close_stores()
        self.loop.stop()
        if self._staging is not None:
            self._staging.release()
        self.save_plans.clear()
        clear_header_caches()
        self.generation += 1


_CONTEXT = RuntimeContext()


def current() -> RuntimeContext:
    """The process's runtime context (one per process, for its whole life)."""
    return _CONTEXT
