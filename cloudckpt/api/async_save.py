"""``cloudckpt.async_save``: training blocks only for planning and the copy to host memory.

Contract:
- :func:`async_save` plans the save (collective, on cloudckpt's own gloo control group), copies
  every tensor this rank writes (after deduplication) into reusable host buffers, and returns a
  :class:`SaveHandle`. From then on the caller may modify its tensors; the checkpoint holds the
  values as of the call.
- Upload and commit run on a background thread. Their collectives use the dedicated control
  group, never the training's default group.
- One save in flight per process: a new ``async_save`` (or a sync ``save``/``load``) first waits
  for the previous one (``wait_for_previous=False`` raises :class:`SaveInProgress` instead).
- ``handle.result()`` returns the :class:`SaveResult` or raises the save's error, the same on
  every rank. At interpreter exit an unfinished save is completed, never dropped; its failure
  is reported on stderr and the exit status is 1 (see :mod:`cloudckpt.runtime.loop`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from cloudckpt.api.save import finish_save, prepare_save
from cloudckpt.errors import SaveInProgress
from cloudckpt.options import SaveOptions, SaveResult
from cloudckpt.runtime import loop as runtime
from cloudckpt.runtime.context import current

log = logging.getLogger(__name__)


class SaveHandle:
    """A future for one async save (``done``, ``result``, ``exception``, ``add_done_callback``)."""

    def __init__(
        self,
        future: concurrent.futures.Future,
        url: str,
        blocked_seconds: float,
        staging_allocations: int,
    ):
        self._future = future
        self.url = url
        self.blocked_seconds = blocked_seconds
        self.staging_allocations = staging_allocations

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle({self.url!r}, {state})"


def async_save(
    state_dict: Mapping[str, Any],
    url: str,
    *,
    process_group=None,
    storage=None,
    allow_pickle: bool = False,
    metadata: Mapping[str, Any] | None = None,
    options: SaveOptions | None = None,
    wait_for_previous: bool = True,
    base: str | None = None,
) -> SaveHandle:
    """Start saving ``state_dict`` to ``url``; return once the data is staged in host memory.

    Collective, like :func:`cloudckpt.save` (``process_group="self"``: this process alone;
    ``base``: an incremental save; the base is read
    and pinned, and the staged copies hashed, in the background). With
    ``options.max_async_staging_bytes`` set, a save whose staged copies would exceed it raises
    :class:`~cloudckpt.errors.StagingMemoryError` on every rank before anything is written.
    """
    start = time.perf_counter()
    if runtime.pending_save() is not None:
        if not wait_for_previous:
            raise SaveInProgress("an async save is still running")
        runtime.wait_for_pending_save()
    options = options or SaveOptions()
    prepared = prepare_save(
        state_dict,
        url,
        process_group=process_group,
        storage=storage,
        allow_pickle=allow_pickle,
        metadata=metadata,
        options=options,
        base=base,
        call="async_save",
    )
    context = current()
    with prepared.channel.phase("async save staging"):
        pool = context.staging_pool(options.max_async_staging_bytes)
        prepared = replace(prepared, items=pool.stage(prepared.items))
    blocked = time.perf_counter() - start
    fut = context.save_executor().submit(finish_save, prepared)
    runtime.set_pending_save(fut)
    runtime.finish_before_exit(fut, url)
    return SaveHandle(fut, url, blocked, pool.allocations)


def staging_allocations() -> int:
    """How many staging buffers were allocated so far in this process (reuse keeps it flat)."""
    return current().staging_allocations
