"""A run's checkpoints: save by step, list, find the latest complete one, load, delete, prune.

``CheckpointManager("s3://bucket/run")`` keeps step ``s`` at ``<run>/step-<s:012d>/`` (steps are
ints >= 0). It also lists, loads, deletes and prunes checkpoints saved under other names right
under the run (``last``, ``epoch=0-step=10.ckpt``, ``checkpoint-500``: a trainer's names, see
:mod:`cloudckpt.layout`): wherever a method takes a ``step``, an ``int`` means ``step-<012d>`` and a
``str`` is a folder name. A run's checkpoints are ordered by step (the manifest's ``"step"``
metadata, else the last number in the name; none first), then by commit time.

A checkpoint is *complete* when its ``manifest.msgpack`` exists: the save writes it last, in
create mode, so a save still running or killed part-way is *incomplete*. Only complete ones are
returned by :meth:`~CheckpointManager.latest` or loaded; :meth:`list` shows the others with
``complete=False`` (unfinished multipart uploads are seen by :meth:`~CheckpointManager.prune`).

Cost contract:

- :meth:`list` / :meth:`latest` make one ListObjectsV2 walk of the run root with the delimiter
  ``"/data/"``, which yields each ``step-*/manifest.msgpack`` as a key and each ``step-*/data/``
  as a common prefix: about (2 x checkpoints) / 1,000 list requests, whatever the number of data
  objects, and no GET for folders named ``step-<N>`` (one manifest GET for each complete one of
  another name, for its step). Each checkpoint that looks incomplete costs one HEAD of its
  manifest (this also repairs SeaweedFS 4.48, whose paging after a ``.../data/`` common prefix
  skips the rest of that step's keys). ``total_bytes`` / ``objects`` / ``world_size`` come from
  the manifest and are read only when asked for (``list(details=True)``, :meth:`info`).
- Deleting is safe: the manifest goes first (the checkpoint stops being complete before any of
  its data goes), then its data objects in batches, then its unfinished uploads: only keys the
  layout owns (:func:`cloudckpt.layout.owned_key`); anything else under a folder is left and
  logged. Manifest keys are validated (no ``..``), so no manifest can name an object under another
  checkpoint's prefix. On a local path, a folder that is a symlink leading outside the run is
  refused (``AccessDenied``), nothing removed.
- :meth:`prune` deletes the complete checkpoints the retention policy does not keep (never the
  newest complete one) and *abandoned* saves: incomplete checkpoints whose newest object or
  upload is older than ``abandoned_after`` seconds (default 3600). Of an abandoned save it removes
  only owned objects and uploads older than that, so a save that starts again at the same step
  while a prune runs keeps its fresh objects. A save in progress is therefore never broken by a
  prune, as long as it keeps producing objects within the grace period. Ages compare the store's
  timestamps with this machine's clock.

Incremental runs (``incremental=True``): every save records a content hash of each chunk, and
every save after the first uses the newest complete checkpoint as its base: chunks whose bytes
did not change are not uploaded again, the new manifest points at the objects that hold them
(see ``cloudckpt.save(..., base=)``). Deleting a checkpoint (``delete``, ``prune``, the
clean-up of abandoned saves) then keeps the objects other checkpoints still reference: its
folder is *retained* (no manifest: not listed, not loadable) until the last checkpoint using
them is gone, and is collected then. ``list(details=True)`` tells each checkpoint's own bytes
from the bytes it shares with older ones.

In a ``torch.distributed`` job, :meth:`save` and :meth:`load` are collective (every rank of the
process group calls them with the same step); the pruning after a save and the choice of the
step to load are made by rank 0 of the group. :meth:`list`, :meth:`latest`, :meth:`delete` and
:meth:`prune` are plain calls of one process.

The manager composes :mod:`cloudckpt.layout`, :mod:`cloudckpt.runs.pruning` (listing, pruning),
:mod:`~cloudckpt.runs.cleanup` (deletions), :mod:`~cloudckpt.runs.retention` and the api.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from cloudckpt.layout import folder_name, join_url
from cloudckpt.options import LoadOptions, SaveOptions
from cloudckpt.runs.cleanup import (
    DeletionPlan,
    delete_checkpoint,
    plan_checkpoint,
    remove_stale_attempts,
    sweep_pins,
)
from cloudckpt.runs.pruning import (
    CheckpointInfo,
    checkpoint_details,
    folder_has_objects,
    latest_loadable,
    list_run,
    prune_run,
)
from cloudckpt.runs.retention import RetentionPolicy
from cloudckpt.runs.tier.options import LocalTier
from cloudckpt.runtime.context import current
from cloudckpt.runtime.loop import finish_before_exit, run_coroutine, shared_store
from cloudckpt.storage.urls import parse_store_url

__all__ = ["CheckpointManager", "ManagedSaveHandle"]

log = logging.getLogger(__name__)


class ManagedSaveHandle(Future):
    """The ``Future`` returned by ``CheckpointManager.save(..., blocking=False)``.

    Done once the save has committed (or failed) *and* the manager's follow-up work (stale
    attempts, pruning) has run. ``result()`` returns the ``SaveResult`` or raises the save's
    error; a failure of the follow-up work is logged and returned as ``retention_error``.
    ``inner`` is the ``cloudckpt.async_save`` handle. Done-callbacks run on cloudckpt's save
    thread: they must not wait for another async save.
    """

    def __init__(self, step: int, url: str, inner: Any):
        super().__init__()
        self.step = step
        self.url = url
        self.inner = inner


class CheckpointManager:
    """The checkpoints of one run (see the module docstring for the contracts).

    Retention is given either as ``retention=RetentionPolicy(...)`` or through the shortcuts
    ``keep_last``, ``keep_every``, ``keep_steps`` and ``keep_if`` (not both). When the policy has a
    rule, every successful :meth:`save` is followed by :meth:`prune` (on rank 0). ``storage``,
    ``allow_pickle``, ``save_options`` and ``load_options`` are passed to ``cloudckpt.save`` /
    ``cloudckpt.load``. ``local``: a :class:`~cloudckpt.runs.tier.options.LocalTier`: recent
    steps kept on each node and its peers, the object store behind them
    (:mod:`cloudckpt.runs.tier.flow`).
    """

    def __init__(
        self,
        url: str,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_steps: Iterable[int] = (),
        keep_if: Callable[[int], bool] | None = None,
        retention: RetentionPolicy | None = None,
        abandoned_after: float = 3600.0,
        storage=None,
        process_group=None,
        allow_pickle: bool = False,
        save_options=None,
        load_options=None,
        incremental: bool = False,
        local: LocalTier | None = None,
    ):
        shortcuts = RetentionPolicy(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_steps=frozenset(keep_steps),
            keep_if=keep_if,
        )
        if retention is not None and shortcuts.active:
            raise ValueError("pass either retention= or the keep_* shortcuts, not both")
        if abandoned_after < 0:
            raise ValueError(f"abandoned_after must be >= 0 seconds, got {abandoned_after}")
        url = parse_store_url(url).url  # a malformed URL fails here, before any I/O
        self.url = url.rstrip("/") if url.rstrip("/") else url
        self.retention = retention if retention is not None else shortcuts
        self.abandoned_after = float(abandoned_after)
        self.storage = storage
        self.process_group = process_group
        self.allow_pickle = allow_pickle
        self.save_options = save_options
        self.load_options = load_options
        self.incremental = bool(incremental)
        self._store: tuple[int, object] | None = None  # (runtime generation, store)
        self.tier = None  # the tier side of the manager (runs/tier/flow.py)
        if local is not None:
            from cloudckpt.runs.tier.flow import TierRun

            self.tier = TierRun(local, self)
        self._pending: ManagedSaveHandle | None = None

    def __repr__(self) -> str:
        return f"CheckpointManager({self.url!r}, retention={self.retention!r})"

    # -- plumbing -------------------------------------------------------------------------------

    @property
    def store(self):
        """The run root's ``ObjectStore``: cloudckpt's shared store for this URL and storage
        options (used on cloudckpt's loop only, closed at interpreter exit; opened again after
        ``runtime.reset()`` closed it, so a manager outlives a reset)."""
        generation = current().generation
        if self._store is None or self._store[0] != generation:
            self._store = (generation, shared_store(self.url, self.storage))  # contacts nothing yet
        return self._store[1]

    def close(self) -> None:
        """Wait for a pending asynchronous save (the shared store stays open). Idempotent."""
        self.wait()
        if self.tier is not None:
            self.tier.wait()  # its copies to the object store

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def step_url(self, step: int | str) -> str:
        """URL of step ``step``'s checkpoint (or of the folder named ``step``)."""
        return join_url(self.url, folder_name(step))

    # -- listing --------------------------------------------------------------------------------

    def list(
        self, *, details: bool = False, progress: Callable[[int], None] | None = None
    ) -> list[CheckpointInfo]:
        """Every checkpoint of the run, complete or not, oldest first (step, then commit time).

        ``details=True`` also reads each complete checkpoint's manifest (one GET each) to fill
        ``total_bytes``, ``objects``, ``world_size``, ``own_bytes``, ``shared_bytes`` and
        ``base_step``; ``progress(n)`` is called as manifests are read; a damaged one is
        reported in that checkpoint's ``damaged``.
        Retained folders (deleted, their objects held by pins) are listed with details only
        (``retained=True``, ``complete=False``), and every folder holding pins says what holds
        it (``held_by``: one listing of its pins, one GET of each referrer's manifest).
        """
        listed = run_coroutine(list_run(self.store, self.url, details=details, progress=progress))
        return listed if self.tier is None else self.tier.listing(listed)

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, or ``None`` when the run has none."""
        complete = [i for i in self.list() if i.complete]
        return complete[-1] if complete else None

    def info(self, step: int | str) -> CheckpointInfo:
        """Step ``step``'s checkpoint with details; ``CheckpointNotFound`` if it is not complete."""
        return run_coroutine(checkpoint_details(self.store, self.url, folder_name(step)))

    # -- save / load ----------------------------------------------------------------------------

    def wait(self) -> None:
        """Wait for the pending asynchronous save (and its follow-up work), if any.

        A failure of that save is logged here, not raised: it belongs to its handle."""
        pending, self._pending = self._pending, None
        if pending is not None:
            exc = pending.exception()
            if exc is not None:
                log.warning("asynchronous save of step %d failed: %s", pending.step, exc)

    def save(self, step: int, state_dict, *, blocking: bool = True, metadata: dict | None = None):
        """Save ``state_dict`` as step ``step`` (collective in a distributed job).

        Waits first for a pending asynchronous save of this manager. ``blocking=True`` returns the
        ``SaveResult``; ``blocking=False`` returns a :class:`ManagedSaveHandle` at once. The step
        is recorded in the manifest's metadata (``"step"``) unless ``metadata`` already has one.
        Raises ``CheckpointExists`` when the step is already complete (unless ``save_options``
        has ``if_exists="replace"``: the new checkpoint replaces it, see ``SaveOptions``). After
        a successful save, rank 0 removes leftovers of earlier killed attempts at the same step
        and, when the retention policy has a rule, prunes. A failure there does not fail the
        committed save: it is logged (WARNING) and returned as the result's ``retention_error``
        (``None`` when that work succeeded); :meth:`prune` retries it and raises on failure.
        """
        from cloudckpt.api.async_save import async_save
        from cloudckpt.api.save import save
        from cloudckpt.groups import group_rank

        url = self.step_url(step)
        self.wait()
        meta = dict(metadata or {})
        meta.setdefault("step", step)
        coordinator = group_rank(self.process_group) == 0
        leftovers = coordinator and self._has_objects(step)
        kwargs = dict(
            process_group=self.process_group,
            storage=self.storage,
            allow_pickle=self.allow_pickle,
            metadata=meta,
            options=self.save_options,
        )
        if self.incremental:  # the base is the coordinator's to choose (the others' is unused)
            kwargs.update(
                options=replace(self.save_options or SaveOptions(), content_hashes=True),
                base=self._base_for(step) if coordinator else None,
            )
        if self.tier is not None:  # blocks briefly; a background copy to the store may follow
            after = self._after_save if coordinator and self.retention.active else None
            result = self.tier.managed_save(step, state_dict, kwargs, after)
            if blocking:
                return result
            done = ManagedSaveHandle(step, url, None)
            done.set_result(result)
            return done
        if blocking:
            result = save(state_dict, url, **kwargs)
            if coordinator:
                result = self._after_save(step, leftovers, result)
            return result
        inner = async_save(state_dict, url, **kwargs)
        handle = ManagedSaveHandle(step, url, inner)

        def _follow_up() -> None:
            try:
                result = inner.result()
            except BaseException as exc:  # the handle carries the save's own error
                handle.set_exception(exc)
                return
            if coordinator:
                result = self._after_save(step, leftovers, result)
            handle.set_result(result)

        # on the context's save thread, queued behind this save's upload and commit (so
        # ``inner.result()`` is already there): no thread of its own per save
        current().save_executor().submit(_follow_up)
        finish_before_exit(handle, url)  # the follow-up work too, not only the save
        self._pending = handle
        return handle

    def _base_for(self, step: int) -> str | None:
        """The base of an incremental save of ``step``: the newest other complete checkpoint."""
        latest = [i for i in self.list() if i.complete and i.name != folder_name(step)]
        return latest[-1].url if latest else None

    def _has_objects(self, step: int) -> bool:
        """Whether anything (objects, uploads of a killed attempt) is under step ``step`` yet;
        True when that cannot be told (rank 0 must not fail before the collective)."""
        try:
            return run_coroutine(folder_has_objects(self.store, folder_name(step)))
        except Exception:  # the save itself will report a broken store
            return True

    def _after_save(self, step: int, leftovers: bool, result):
        """The clean-up after a committed save: ``result``, with its error (logged) if any."""
        try:
            if leftovers:
                run_coroutine(remove_stale_attempts(self.store, folder_name(step) + "/"))
            if self.incremental:  # pins of this step's killed attempts, once their lease is over
                run_coroutine(sweep_pins(self.store, folder=folder_name(step)))
            if self.retention.active:
                self.prune()
        except Exception as exc:  # the checkpoint is committed: do not fail the save
            log.warning(
                "step %d is saved, but the clean-up after it failed (checkpoints the "
                "retention policy drops may remain; prune() retries): %s",
                step,
                exc,
            )
            return replace(result, retention_error=exc)
        return result

    def load(
        self, state_dict, *, step: int | str | None = None, strict: bool = True
    ) -> int | str | None:
        """Load step ``step`` (default: the newest complete checkpoint) into ``state_dict``.

        Returns the step loaded (the folder name of a newest checkpoint that has no step), or
        ``None`` when ``step`` is ``None`` and the run has no complete checkpoint (``state_dict``
        is then untouched). Collective in a distributed job: rank 0
        picks the step and every rank loads that one. An explicit step that is not complete
        raises ``CheckpointNotFound``. When the newest complete checkpoint's manifest is damaged,
        every rank raises ``ManifestError`` naming it and the newest step that does decode
        (nothing is loaded; pass that ``step`` to resume from it).
        """
        from cloudckpt.api.load import load

        self.wait()
        if self.tier is not None:
            if isinstance(step, str):
                raise ValueError(f"a run with a local tier loads steps by number, got {step!r}")
            return self.tier.load(state_dict, step, strict)
        if step is None:
            step = self._agree_on_latest()
            if step is None:
                return None
        load(
            state_dict,
            self.step_url(step),
            process_group=self.process_group,
            storage=self.storage,
            allow_pickle=self.allow_pickle,
            strict=strict,
            options=self.load_options,
        )
        return step

    def _agree_on_latest(self) -> int | str | None:
        from cloudckpt.api.reports import LatestStep
        from cloudckpt.transport import ControlChannel

        options = self.load_options or LoadOptions()
        channel = ControlChannel(self.process_group, timeout=options.timeout)
        channel.join("CheckpointManager.load", self.url, options.join_timeout)
        if channel.size == 1:  # one process: the listing's own error, unwrapped
            return self._latest_step()
        with channel.phase("finding the latest checkpoint", LatestStep) as finding:
            if channel.is_coordinator:  # every rank learns of its failure, none hangs
                finding.report = LatestStep(step=self._latest_step())
        return finding.reports[0].step

    def _latest_step(self) -> int | str | None:
        """The newest complete checkpoint whose manifest decodes (its step when its folder is
        ``step-<N>``, else its name), else ``ManifestError`` naming the newest older one that
        does (:func:`~cloudckpt.runs.pruning.latest_loadable`)."""
        complete = [i for i in self.list() if i.complete]
        if not complete:
            return None
        name = run_coroutine(latest_loadable(self.store, self.url, [i.name for i in complete]))
        if name is None:
            return None
        info = next(i for i in complete if i.name == name)
        return info.step if info.step is not None and name == folder_name(info.step) else name

    # -- deleting -------------------------------------------------------------------------------

    def plan_delete(self, step: int | str) -> DeletionPlan:
        """What :meth:`delete` would remove now (keys relative to the run), removing nothing."""
        return run_coroutine(plan_checkpoint(self.store, folder_name(step) + "/"))

    def delete(self, step: int | str, *, progress: Callable[[int], None] | None = None) -> int:
        """Delete step ``step``'s checkpoint, complete or not; returns the objects removed.

        Manifest first, then data objects, then uploads; owned keys only (module docstring). A
        step that does not exist: 0. Do not delete a step that is being saved.
        """
        return run_coroutine(
            delete_checkpoint(
                self.store,
                folder_name(step) + "/",
                progress=progress,
                cutoff=time.time() - self.abandoned_after,
            )
        )

    def prune(
        self, *, dry_run: bool = False, progress: Callable[[int], None] | None = None
    ) -> builtins.list[CheckpointInfo]:
        """Apply the retention policy and remove abandoned saves; return what was removed.

        The result lists, oldest first (by step, then commit time), the complete checkpoints the
        policy does not keep (never the newest complete one, nor the last one committed when it
        has no step; none for a policy without rules) and the incomplete ones abandoned for
        longer than ``abandoned_after`` (unfinished uploads included). ``dry_run=True`` removes
        nothing and returns what would go. Only owned keys go (see :meth:`delete`).
        """
        return [info for info, _ in self.prune_plans(dry_run=dry_run, progress=progress)]

    def prune_plans(
        self, *, dry_run: bool = False, progress: Callable[[int], None] | None = None
    ) -> builtins.list[tuple[CheckpointInfo, DeletionPlan]]:
        """:meth:`prune`, returning each removed checkpoint with the exact keys and uploads that
        went (or, with ``dry_run=True``, would go)."""
        return run_coroutine(
            prune_run(
                self.store,
                self.retention,
                self.abandoned_after,
                dry_run=dry_run,
                progress=progress,
                run_url=self.url,
            )
        )
