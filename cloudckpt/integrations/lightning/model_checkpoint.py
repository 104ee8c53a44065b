"""``CloudModelCheckpoint``: Lightning's ``ModelCheckpoint`` with a ``dirpath`` on S3, no s3fs.

Every argument is ``ModelCheckpoint``'s, and so is every decision (when to save, which names,
which to remove). What changes for a URL ``dirpath``:

- existence checks and listings come from cloudckpt (a checkpoint exists when its manifest
  does: a half-written one is never seen, never resumed from);
- ``ckpt_path="last"`` finds the newest committed ``last*.ckpt`` under ``dirpath``;
- removals (``save_top_k``, the previous ``last``) go through the strategy to
  ``CloudCheckpointIO.remove_checkpoint`` (``cloudckpt.delete``), never the checkpoint the
  trainer resumed from and never one outside ``dirpath``, as Lightning does for local folders;
- ``save_last="link"`` is refused (object stores have no links), as Lightning does for remote
  folders.

It needs the trainer to save through cloudckpt (``plugins=[CloudCheckpointIO()]``, or
``CloudModelParallelStrategy``) and says so at setup otherwise. A local ``dirpath`` behaves as
``ModelCheckpoint`` does.
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from cloudckpt.errors import ConfigError
from cloudckpt.integrations.lightning import folder_view, library
from cloudckpt.integrations.lightning.urls import aliased, checkpoint_url, is_remote


class CloudModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``dirpath`` may be ``s3://bucket/prefix``."""

    def __init__(self, dirpath: Any = None, *args: Any, **kwargs: Any) -> None:
        self._remote = dirpath is not None and is_remote(dirpath)
        # the base resolves a dirpath through fsspec (s3fs for s3://): give it none, then set it
        super().__init__(None if self._remote else dirpath, *args, **kwargs)
        if self._remote:
            folder_view.register()
            self.dirpath = checkpoint_url(dirpath).rstrip("/")
            self._fs = folder_view.CheckpointFolderView()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self._remote:
            super().setup(trainer, pl_module, stage)
            return
        self._fs = folder_view.CheckpointFolderView(storage=_storage_of(trainer, self.dirpath))
        self.dirpath = trainer.strategy.broadcast(self.dirpath)
        if self.save_last == "link":
            raise ValueError(
                f"CloudModelCheckpoint(save_last='link') needs a local dirpath, got {self.dirpath}"
            )
        if trainer.is_global_zero and stage == "fit" and self.save_top_k != 0:
            if library.list_committed(str(self.dirpath), self._fs.storage):
                rank_zero_warn(f"Checkpoint directory {self.dirpath} exists and is not empty.")

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        if not self._remote:
            return super()._find_last_checkpoints(trainer)
        storage = _storage_of(trainer, str(self.dirpath))
        pattern = re.compile(
            rf"^{self.CHECKPOINT_NAME_LAST}(-(\d+))?{re.escape(self.FILE_EXTENSION)}$"
        )
        found = set()
        for listed in library.list_committed(str(self.dirpath), storage):
            if pattern.match(listed.name):
                folder_view.remember_storage(listed.url, storage)
                found.add(aliased(listed.url))  # fsspec resolves it through folder_view
        return found

    @override
    def _should_remove_checkpoint(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        if not self._remote:
            return super()._should_remove_checkpoint(trainer, previous, current)
        previous, current = checkpoint_url(previous), checkpoint_url(current)
        if previous == current:
            return False
        resumed = trainer.ckpt_path
        if resumed is not None and checkpoint_url(resumed) == previous:
            return False
        return previous.rpartition("/")[0] == str(self.dirpath)


def _storage_of(trainer: pl.Trainer, dirpath: Any) -> Any:
    """The storage options of the trainer's cloudckpt saves; a ConfigError if it has none."""
    from cloudckpt.integrations.lightning.checkpoint_io import CloudCheckpointIO
    from cloudckpt.integrations.lightning.model_parallel import CloudModelParallelStrategy

    strategy = trainer.strategy
    if isinstance(strategy, CloudModelParallelStrategy):
        return strategy.storage
    io: Any = strategy.checkpoint_io
    while not isinstance(io, CloudCheckpointIO) and getattr(io, "checkpoint_io", None) is not None:
        io = io.checkpoint_io  # Lightning's AsyncCheckpointIO and other wrappers
    if not isinstance(io, CloudCheckpointIO):
        raise ConfigError(
            f"CloudModelCheckpoint(dirpath={dirpath!r}) saves through cloudckpt: pass "
            f"Trainer(plugins=[CloudCheckpointIO()]) (or strategy=CloudModelParallelStrategy())"
        )
    return io.storage
