"""``CloudCheckpointIO``: Lightning's ``CheckpointIO`` plugin, saving through cloudckpt.

Lightning hands the plugin its whole checkpoint dict (on global rank 0 only, under every
strategy that routes saves through ``CheckpointIO``) and a path; the plugin stores the dict as one
cloudckpt checkpoint at that path (a folder: ``s3://bucket/run/epoch=0-step=100.ckpt/``):

- ``save_checkpoint``: ``cloudckpt.save`` with ``process_group="self"`` (this process alone, no
  collective), replacing a checkpoint already at that name atomically (Lightning rewrites
  ``last.ckpt`` in place); ``metadata`` records ``step`` and ``epoch`` (``cloudckpt ls`` shows
  them). With ``async_save=True``: ``cloudckpt.async_save``, training is blocked only while the
  tensors are copied to host memory; the next save, load or removal and ``teardown`` wait for it.
- ``load_checkpoint``: ``cloudckpt.load_full`` (full tensors, placed by ``map_location``).
- generator states: each save adds ``cloudckpt.RNGState`` (the saving rank's torch, CUDA, numpy
  and Python generators; Lightning saves none) and a trainer's load restores them, on the rank
  that saved them (under DDP, rank 0: the other ranks keep theirs).
- ``remove_checkpoint``: ``cloudckpt.delete`` (never an object another checkpoint still
  references). A removal asked for while an async save is uploading runs after that save has
  committed, and not at all if it failed: the newest complete checkpoint is never deleted.

No pickle unless ``allow_pickle=True``: a value msgpack cannot hold exactly (an
``argparse.Namespace`` in the hyper-parameters) raises ``UnsupportedValueError`` naming its key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from typing_extensions import override

from cloudckpt.api.async_save import SaveHandle
from cloudckpt.errors import CheckpointNotFound, UnsupportedValueError
from cloudckpt.integrations.lightning import library
from cloudckpt.integrations.lightning.urls import checkpoint_url
from cloudckpt.options import SaveOptions


class CloudCheckpointIO(CheckpointIO):
    """Save, load and remove Lightning checkpoints through cloudckpt.

    ``storage``: a :class:`cloudckpt.storage.StorageOptions` (default: the standard AWS chain).
    ``options``: the :class:`cloudckpt.SaveOptions` of every save. ``async_save``: return once
    the data is staged, upload in the background (one save in flight at a time).
    """

    def __init__(
        self,
        *,
        storage: Any = None,
        allow_pickle: bool = False,
        async_save: bool = False,
        options: SaveOptions | None = None,
    ) -> None:
        self.storage = storage
        self.allow_pickle = allow_pickle
        self.async_save = async_save
        self.options = options or SaveOptions()
        self._pending: SaveHandle | None = None
        self._removals: list[str] = []

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "CloudCheckpointIO.save_checkpoint takes no storage_options: pass "
                "CloudCheckpointIO(storage=cloudckpt.StorageOptions(...), options=...)"
            )
        url = checkpoint_url(path)
        self.wait()
        with naming_unsupported_values():
            saver = library.async_save_replacing if self.async_save else library.save_replacing
            handle = saver(
                library.with_rng_states(checkpoint),
                url,
                whole_world=False,
                storage=self.storage,
                allow_pickle=self.allow_pickle,
                metadata=checkpoint_metadata(checkpoint),
                options=self.options,
            )
        if isinstance(handle, SaveHandle):
            self.hold(handle)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()
        checkpoint = library.load_whole(
            checkpoint_url(path),
            storage=self.storage,
            allow_pickle=self.allow_pickle and weights_only is not True,
            map_location=map_location,
        )
        library.restore_rng_states(checkpoint)  # random ops go on as in an uninterrupted run
        return checkpoint

    @override
    def remove_checkpoint(self, path: Any) -> None:
        url = checkpoint_url(path)
        if self._pending is not None and not self._pending.done():
            self._removals.append(url)  # after the save in flight commits
            return
        self.wait()
        _remove(url, self.storage)

    @override
    def teardown(self) -> None:
        self.wait()

    def hold(self, handle: SaveHandle) -> None:
        """Make ``handle`` the save in flight: removals asked for until it commits wait for it
        (the sharded strategy's async saves are held by its plugin this way)."""
        self.wait()
        self._pending = handle

    def wait(self) -> None:
        """Wait for the save in flight (raising its error), then run the removals it held."""
        pending, self._pending = self._pending, None
        removals, self._removals = self._removals, []
        if pending is not None:
            pending.result()  # a failed save keeps the checkpoints it would have replaced
        for url in removals:
            _remove(url, self.storage)


def checkpoint_metadata(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What ``cloudckpt ls`` shows of a Lightning checkpoint: its step and epoch."""
    out: dict[str, Any] = {"trainer": "lightning"}
    for key, name in (("global_step", "step"), ("epoch", "epoch")):
        value = checkpoint.get(key)
        if isinstance(value, int):
            out[name] = value
    return out


def _remove(url: str, storage: Any) -> None:
    try:
        library.delete(url, storage)
    except CheckpointNotFound:
        pass  # as Lightning's own: removing what is not there is no error


@contextlib.contextmanager
def naming_unsupported_values() -> Iterator[None]:
    """Add the Lightning ways out to a refused value's error (one line)."""
    try:
        yield
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(
            f"{exc}; with Lightning: CloudCheckpointIO(allow_pickle=True), or keep the value "
            f"out of the checkpoint (hyper-parameters: self.save_hyperparameters(ignore=[...]))"
        ) from exc
