"""A training run saved with torch DCP (``dcp.save`` / ``dcp.async_save`` / ``dcp.load``) on
cloudckpt's storage, with step discovery and retention: the adapter for DCP-based trainers.

```python
from cloudckpt.integrations.dcp_trainer import DCPRun
run = DCPRun("s3://bucket/run", keep_last=3)
start = run.load(state)                  # newest complete step (None: nothing yet), every rank
run.save(state, step)                    # or: future = run.async_save(state, step)
```

``state`` is what the trainer hands DCP (``{"model": ..., "optim": ..., "train": Stateful}``,
DTensors of FSDP2/TP included). Step ``s`` goes to ``<run>/step-<s>/`` in DCP's own layout, the
folders torchtitan writes, through :class:`cloudckpt.dcp.StorageWriter` (crc32c of every block,
``.metadata`` committed last in create mode) and is read by :class:`cloudckpt.dcp.StorageReader`.

Contract:

- :meth:`DCPRun.save`, :meth:`~DCPRun.async_save`, :meth:`~DCPRun.load` and
  :meth:`~DCPRun.latest` are collective: every rank of ``process_group`` calls them, with the
  same step. The step to resume is chosen by rank 0 of the group from one listing and sent to
  every rank, so all ranks load the same one; when rank 0's listing fails every rank raises.
- Only complete checkpoints (``.metadata`` present) are chosen or loaded; a half-written one
  (killed save, save in flight) is never resumed from (:mod:`cloudckpt.dcp.run`).
- Retention (``keep_last`` or ``retention=``): after each save commits, rank 0 prunes in the
  background (training is not blocked): complete checkpoints the policy does not keep, never
  the newest complete one; owned objects of incomplete folders older than ``abandoned_after``
  seconds. A failed prune is logged (WARNING) and does not fail the save.
- :meth:`~DCPRun.async_save` returns DCP's future (done once ``.metadata`` committed); the next
  save, load, :meth:`~DCPRun.wait` or :meth:`~DCPRun.close` waits for it first. DCP's
  collectives of an asynchronous save run in its background thread while training runs its
  own: they go over a gloo group of the run's ranks made on the first ``async_save`` (every
  rank of the world calls ``new_group`` then), unless ``process_group=`` is passed to it.
- Errors: DCP's ``CheckpointException`` (every rank's traceback) is raised as the cloudckpt
  error that caused it (``CheckpointExists``, ``ManifestError``, a storage error), one line.
- :meth:`~DCPRun.list` and :meth:`~DCPRun.prune` are plain calls of one process.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from cloudckpt.dcp.options import DCPOptions
from cloudckpt.dcp.run import DCPCheckpoint, latest_complete, list_run, prune_run
from cloudckpt.errors import CloudCkptError, ConfigError
from cloudckpt.runs.retention import RetentionPolicy
from cloudckpt.runtime.loop import run_coroutine, shared_store, submit

log = logging.getLogger(__name__)

__all__ = ["DCPRun", "DCPCheckpoint"]


def step_folder(step: int) -> str:
    """The folder of step ``step`` in a run: ``step-<step>`` (torchtitan's name)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"a step is an int >= 0, got {step!r}")
    return f"step-{step}"


@contextlib.contextmanager
def one_line_errors(url: str, storage=None, *, reading: bool) -> Iterator[None]:
    """DCP's ``CheckpointException`` (every rank's traceback) raised as the cloudckpt error that
    caused it when one did (for a load DCP could not read the metadata of, the reason cloudckpt's
    reader gives for ``url``), else as it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        cause = next(
            (e for _, (e, _tb) in sorted(exc.failures.items()) if isinstance(e, CloudCkptError)),
            None,
        )
        if cause is None and reading:
            cause = _why_unreadable(url, storage)
        if cause is None:
            raise
        raise cause from exc


def _why_unreadable(url: str, storage) -> CloudCkptError | None:
    from cloudckpt.dcp.reader import load_checkpoint_metadata

    try:
        load_checkpoint_metadata(shared_store(url, storage), url)
    except CloudCkptError as exc:
        return exc
    return None


class DCPRun:
    """The DCP checkpoints of one run at ``url`` (see the module doc).

    ``keep_last``: keep the N newest complete checkpoints (or a full
    :class:`~cloudckpt.RetentionPolicy` as ``retention``; neither: keep all). ``storage``:
    :class:`cloudckpt.storage.StorageOptions`; ``options``: :class:`cloudckpt.dcp.DCPOptions`;
    ``allow_pickle``: see :class:`cloudckpt.dcp.StorageReader`; ``process_group``: the ranks that
    save and load together (default: the world); ``timeout``: seconds rank 0's choice of the
    step may take before every rank raises.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        keep_last: int | None = None,
        retention: RetentionPolicy | None = None,
        abandoned_after: float = 3600.0,
        storage=None,
        options: DCPOptions | None = None,
        allow_pickle: bool = False,
        process_group=None,
        timeout: float = 600.0,
    ):
        from cloudckpt.storage.urls import parse_store_url

        if retention is not None and keep_last is not None:
            raise ConfigError("pass either keep_last= or retention=, not both")
        if abandoned_after < 0:
            raise ConfigError(f"abandoned_after must be >= 0 seconds, got {abandoned_after}")
        text = os.fspath(url)
        parse_store_url(text)  # a malformed URL fails here, before any I/O
        self.url = text.rstrip("/") or text
        self.retention = (
            retention if retention is not None else RetentionPolicy(keep_last=keep_last)
        )
        self.abandoned_after = float(abandoned_after)
        self.storage = storage
        self.options = options
        self.allow_pickle = allow_pickle
        self.process_group = process_group
        self.timeout = float(timeout)
        self._saving: concurrent.futures.Future | None = None
        self._pruning: concurrent.futures.Future | None = None
        self._background_group = None

    def __repr__(self) -> str:
        return f"DCPRun({self.url!r}, retention={self.retention!r})"

    # -- where ----------------------------------------------------------------------------------

    def step_url(self, step: int) -> str:
        """URL of step ``step``'s checkpoint: ``<run>/step-<step>``."""
        return f"{self.url}/{step_folder(step)}"

    def writer(self, step: int):
        """A :class:`cloudckpt.dcp.StorageWriter` for step ``step`` (for a trainer that calls
        ``dcp.save(..., storage_writer=)`` itself; it then calls :meth:`after_save`)."""
        from cloudckpt.dcp.writer import StorageWriter

        return StorageWriter(self.step_url(step), self.storage, options=self.options)

    def reader(self, step: int):
        """A :class:`cloudckpt.dcp.StorageReader` for step ``step``."""
        from cloudckpt.dcp.reader import StorageReader

        return StorageReader(
            self.step_url(step), self.storage, options=self.options, allow_pickle=self.allow_pickle
        )

    # -- saving ---------------------------------------------------------------------------------

    def save(self, state: dict[str, Any], step: int) -> None:
        """``dcp.save(state)`` to step ``step`` (collective), then prune in the background."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        with one_line_errors(self.step_url(step), self.storage, reading=False):
            dcp.save(state, storage_writer=self.writer(step), process_group=self.process_group)
        self.after_save()

    def async_save(self, state: dict[str, Any], step: int, **kwargs) -> Any:
        """``dcp.async_save(state)`` to step ``step`` (collective): returns once DCP staged the
        state, what DCP returns (a future done once the checkpoint committed, or with a stager an
        ``AsyncSaveResponse``); pruned in the background after the commit. ``kwargs`` go to
        ``dcp.async_save`` (``async_checkpointer_type``, ``async_stager``, ``process_group``)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        if "process_group" not in kwargs:
            kwargs["process_group"] = self._async_group()
        with one_line_errors(self.step_url(step), self.storage, reading=False):
            got = dcp.async_save(state, storage_writer=self.writer(step), **kwargs)
        upload: Any = getattr(got, "upload_completion", got)  # AsyncSaveResponse, or the future
        settled: concurrent.futures.Future = concurrent.futures.Future()

        def done(f: concurrent.futures.Future) -> None:
            try:
                with one_line_errors(self.step_url(step), self.storage, reading=False):
                    f.result()
            except BaseException as exc:  # handed on to wait()
                settled.set_exception(exc)
                return
            self.after_save()  # before wait() can return: it waits for settled
            settled.set_result(None)

        self._saving = settled
        upload.add_done_callback(done)
        return got

    def after_save(self) -> None:
        """Prune in the background on rank 0 of the group when the policy has a rule (called
        after every save; call it after a ``dcp.save`` made with :meth:`writer`)."""
        if not self.retention.active or self._group_rank() != 0:
            return
        previous = self._pruning

        async def prune_after() -> None:
            if previous is not None:
                await asyncio.wrap_future(previous)
            try:
                await prune_run(self._store(), self.retention, abandoned_after=self.abandoned_after)
            except Exception as exc:  # the save committed: a failed prune is only logged
                log.warning("%s: pruning after a save failed: %s", self.url, exc)

        self._pruning = submit(prune_after())

    def wait(self) -> None:
        """Wait for the pending asynchronous save (raises its error) and the pruning after it."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.result()
        pruning = self._pruning
        if pruning is not None:
            pruning.result()

    def close(self) -> None:
        """:meth:`wait`. Idempotent."""
        self.wait()

    def __enter__(self) -> DCPRun:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- loading --------------------------------------------------------------------------------

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint, as rank 0 of the group sees it, on every
        rank (collective); ``None`` when there is none."""
        from cloudckpt.api.reports import LatestStep
        from cloudckpt.transport import ControlChannel

        channel = ControlChannel(self.process_group, timeout=self.timeout)
        if channel.size == 1:
            return self._latest_here()
        with channel.phase("finding the latest DCP checkpoint", LatestStep) as finding:
            if channel.is_coordinator:
                finding.report = LatestStep(step=self._latest_here())
        return finding.reports[0].step

    def load(self, state: dict[str, Any], step: int | None = None) -> int | None:
        """``dcp.load(state)`` from step ``step`` (default: :meth:`latest`); collective. Returns
        the step loaded, or ``None`` (``state`` untouched) when the run has no complete one."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        if step is None:
            step = self.latest()
            if step is None:
                return None
        with one_line_errors(self.step_url(step), self.storage, reading=True):
            dcp.load(state, storage_reader=self.reader(step), process_group=self.process_group)
        return step

    # -- one process ----------------------------------------------------------------------------

    def list(self) -> list[DCPCheckpoint]:
        """Every folder of the run, complete or not, oldest step first (not collective)."""
        return run_coroutine(list_run(self._store()))

    def prune(self, *, dry_run: bool = False) -> builtins.list[DCPCheckpoint]:
        """Apply the retention policy now; return what was (or would be) deleted (not
        collective: call it on one rank)."""
        return run_coroutine(
            prune_run(
                self._store(), self.retention, abandoned_after=self.abandoned_after, dry_run=dry_run
            )
        )

    def _latest_here(self) -> int | None:
        found = latest_complete(self.list())
        return found.step if found is not None else None

    def _async_group(self):
        """A gloo group of the run's ranks for DCP's background collectives (the training's
        collectives keep the default group: two threads must never share one)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        if self._background_group is None:
            from cloudckpt.groups import group_ranks

            ranks = list(group_ranks(self.process_group))
            self._background_group = dist.new_group(ranks, backend="gloo")
        return self._background_group

    def _group_rank(self) -> int:
        from cloudckpt.groups import group_rank

        return group_rank(self.process_group)

    def _store(self):
        return shared_store(self.url, self.storage)
