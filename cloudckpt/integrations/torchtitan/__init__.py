"""torchtitan's ``CheckpointManager`` with its checkpoints on cloudckpt (torchtitan 0.3).

```python
from cloudckpt.integrations.torchtitan import CheckpointManager
checkpoint = CheckpointManager.Config(enable=True, folder="s3://bucket/run", keep_latest_k=3)
```

A subclass of ``torchtitan.components.checkpoint.CheckpointManager`` (use its ``Config`` where
a trainer's config names torchtitan's, or build it as torchtitan does). It keeps torchtitan's
behaviour (intervals, what is saved, ``async_mode``, the last-step export, initial loads) and
sends the checkpoint I/O of ``checkpoint.folder`` through cloudckpt, S3 or local alike, without
fsspec or s3fs:

- DCP saves and loads go through :class:`cloudckpt.dcp.StorageWriter` / ``StorageReader``
  (``<folder>/step-<N>/``, DCP's layout, torchtitan's names); torchtitan's HF safetensors paths
  (``last_save_in_hf``, ``initial_load_in_hf``) stay torchtitan's own, on local folders.
- Step discovery (``load_step=-1``) is :meth:`cloudckpt.integrations.dcp_trainer.DCPRun.latest`:
  complete checkpoints only (``.metadata`` present), chosen by rank 0 and sent to every rank.
- ``keep_latest_k`` prunes through cloudckpt on rank 0 in the background: the newest complete
  checkpoint is never deleted, a save in flight or half-written folder is never counted as one
  of the k nor deleted while fresh (torchtitan's own purge deletes by name).

``CheckpointManager.configure(storage=..., options=..., allow_pickle=...)`` sets the
:class:`cloudckpt.storage.StorageOptions`, :class:`cloudckpt.dcp.DCPOptions` and reader option
for the managers built afterwards (the Config holds only torchtitan's plain fields); without it
the standard AWS chain is used. Needs ``pip install 'cloudckpt[torchtitan]'`` (torchtitan).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from cloudckpt.errors import CheckpointNotFound, ConfigError
from cloudckpt.integrations.dcp_trainer import DCPRun, one_line_errors

try:
    import torch
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpoint import MODEL, AsyncMode
    from torchtitan.components.checkpoint import CheckpointManager as _TitanManager
    from torchtitan.tools.logging import logger
    from torchtitan.tools.utils import GarbageCollection
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ConfigError(
        f"cloudckpt.integrations.torchtitan needs torchtitan ({exc}): "
        "pip install 'cloudckpt[torchtitan]'"
    ) from exc

__all__ = ["CheckpointManager"]


class CheckpointManager(_TitanManager):
    """torchtitan's ``CheckpointManager`` on cloudckpt (see the module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanManager.Config):
        """torchtitan's checkpoint config; ``folder`` may be an ``s3://`` URL."""

    _settings: ClassVar[dict[str, Any]] = {}
    _after_commit: concurrent.futures.Future | None = None

    @classmethod
    def configure(cls, *, storage=None, options=None, allow_pickle: bool = False) -> None:
        """Storage options, DCP options and ``allow_pickle`` of the managers built from now on."""
        cls._settings = {"storage": storage, "options": options, "allow_pickle": allow_pickle}

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        theirs = getattr(self, "purge_thread", None)
        if theirs is not None:  # torchtitan's purge removes folders by name: cloudckpt prunes
            self.purge_queue.put(None)
            theirs.join()
            self.purge_thread = None
        self.run = DCPRun(self.folder, keep_last=self.keep_latest_k or None, **type(self)._settings)

    # -- what torchtitan calls --------------------------------------------------------------------

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ):
        if to_hf:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        writer = self._writer(checkpoint_id)
        if async_mode == AsyncMode.ASYNC:
            ret: Any = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            ret = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        else:
            with one_line_errors(checkpoint_id, self._setting("storage"), reading=False):
                dcp.save(state_dict, storage_writer=writer)
            ret = None
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        from cloudckpt.dcp.reader import StorageReader

        reader = StorageReader(
            checkpoint_id,
            self._setting("storage"),
            options=self._setting("options"),
            allow_pickle=bool(self._setting("allow_pickle")),
        )
        with one_line_errors(checkpoint_id, self._setting("storage"), reading=True):
            dcp.load(state_dict, storage_reader=reader)
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        run = self.run if not folder else DCPRun(folder, **type(self)._settings)
        step = run.latest()
        return -1 if step is None else step

    def _purge_stale_checkpoints(self) -> None:
        # rank 0 of the run's group, in the background; after an async save, once it committed
        # (torchtitan calls this right after staging: the save in flight is not complete yet)
        pending = self.save_future
        if pending is None:
            self.run.after_save()
            return

        settled: concurrent.futures.Future = concurrent.futures.Future()

        def committed(f) -> None:
            try:
                if not f.cancelled() and f.exception() is None:
                    self.run.after_save()
            finally:
                settled.set_result(None)

        self._after_commit = settled
        pending.add_done_callback(committed)

    def _load(self, step: int = -1) -> bool:
        load_step = self._find_load_step() if step == -1 else step
        if load_step == -1:
            return self._initial_load()
        checkpoint_id = self._create_checkpoint_id(load_step)
        logger.info(f"Loading the checkpoint from {checkpoint_id}.")
        begin = time.monotonic()
        if step != -1 and step not in [c.step for c in self.run.list() if c.complete]:
            raise CheckpointNotFound(
                f"--checkpoint.load_step={step}: no complete checkpoint at {checkpoint_id}"
            )
        states = self._states_to_load(model_only=load_step == 0)
        self.dcp_load(states, checkpoint_id, from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        logger.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _wait_for_saving(self) -> None:
        with one_line_errors(self.folder, reading=False):
            super()._wait_for_saving()
        self._settle()

    def _close(self) -> None:
        super()._close()
        if hasattr(self, "run"):
            self._settle()
            self.run.wait()

    def _settle(self) -> None:
        """Wait until the prune started by the last async save's commit was handed on."""
        after, self._after_commit = getattr(self, "_after_commit", None), None
        if after is not None:
            after.result()

    # -- helpers ----------------------------------------------------------------------------------

    def _initial_load(self) -> bool:
        """torchtitan's load when the folder has no checkpoint yet (``initial_load_path``, or
        HF weights at ``hf_assets_path``)."""
        from_hf = self.initial_load_in_hf
        if self.initial_load_path:
            checkpoint_id = self.initial_load_path
        elif from_hf and self.sd_adapter is not None and self.sd_adapter.hf_assets_path:
            checkpoint_id = self.sd_adapter.hf_assets_path
        else:
            logger.info("No checkpoint was provided, this is a fresh start.")
            return False
        logger.info(f"Loading the initial checkpoint from {checkpoint_id}.")
        states = self._states_to_load(self.initial_load_model_only or from_hf)
        self.dcp_load(
            states,
            checkpoint_id,
            from_hf=from_hf,
            from_quantized=self.initial_load_in_hf_quantized,
        )
        return True

    def _writer(self, checkpoint_id: str):
        from cloudckpt.dcp.writer import StorageWriter

        return StorageWriter(
            checkpoint_id, self._setting("storage"), options=self._setting("options")
        )

    def _setting(self, name: str):
        return type(self)._settings.get(name)
