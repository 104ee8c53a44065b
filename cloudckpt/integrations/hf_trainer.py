"""Hugging Face ``transformers.Trainer`` checkpoints on S3 through cloudckpt.

``CloudckptTrainer(checkpoint_url="s3://bucket/run", model=..., args=..., ...)`` is a
``transformers.Trainer`` whose checkpoints (at ``save_steps``, ``save_strategy``'s moments) are
cloudckpt checkpoints ``<checkpoint_url>/checkpoint-<global_step>``, written once, straight from
memory (the Trainer's own local folder is not written); ``CloudckptTrainerMixin`` is the same for a
Trainer subclass of your own (``class MyTrainer(CloudckptTrainerMixin, SFTTrainer)``).

Each checkpoint holds (``cloudckpt show`` lists them; ``metadata={"step": global_step}``):

- ``model``: the unwrapped model's ``state_dict()`` (export ``--prefix model.`` for
  ``from_pretrained``), and ``model_config``: its ``config`` as the JSON text of ``config.json``;
- ``optimizer``: ``optimizer.state_dict()`` as the optimizer gives it (int-keyed state, param
  groups), ``scheduler`` and ``scaler`` (when there is one): their ``state_dict()``;
- ``rng``: ``rank<N>``: each rank's torch, CUDA, numpy and Python generators, as tensors;
- ``trainer_state``: the Trainer's ``trainer_state.json`` text (a JSON record, no pickle).
With ``save_only_model`` only the first two.

``train(resume_from_checkpoint=...)`` takes, besides a local folder (the Trainer's own), a
checkpoint URL, or ``True`` / ``"latest"``: the newest complete ``checkpoint-<N>`` under
``checkpoint_url`` (``CheckpointNotFound`` if there is none; :meth:`latest_checkpoint` gives it
or None). Every rank reads the checkpoint once (``load_full``, CPU tensors, moved by the
model's and optimizer's ``load_state_dict``). The Trainer reads ``trainer_state.json`` from a
local folder itself, so that one small file is staged in a temporary folder for the length of
``train()`` and removed after. ``save_total_limit`` prunes the oldest complete checkpoints
through cloudckpt's safe deletion on the main process (the newest complete one and the best one
are never deleted; half-written ones are never listed, counted or resumed from).

With ``async_save=True`` a save blocks training only for the copy of the state to host memory
(:func:`cloudckpt.async_save`); the next save and the end of ``train()`` wait for the upload,
and pruning follows its commit.

Errors from S3 are cloudckpt's one-line errors; the run folder is listed when ``train()``
starts, so a wrong endpoint, bucket or credentials fail before the first step, not at the first
save. Not supported (``ConfigError`` at construction): DeepSpeed, FSDP, ``push_to_hub``,
``load_best_model_at_end``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cloudckpt.api.async_save import SaveHandle, async_save
from cloudckpt.api.load import load_full
from cloudckpt.api.save import save
from cloudckpt.errors import CheckpointNotFound, ConfigError, ManifestError
from cloudckpt.integrations.optional import import_framework
from cloudckpt.integrations.run_folder import complete_checkpoints, newest_complete, prune_to
from cloudckpt.layout import join_url
from cloudckpt.options import SaveResult
from cloudckpt.statedict.rng import RNGState

__all__ = ["CHECKPOINT_PREFIX", "CloudckptTrainer", "CloudckptTrainerMixin"]  # noqa: F822

#: transformers' ``PREFIX_CHECKPOINT_DIR`` and its separator: ``checkpoint-<global_step>``.
CHECKPOINT_PREFIX = "checkpoint-"
#: The Trainer's own name of the trainer state file (``TRAINER_STATE_NAME``).
TRAINER_STATE_FILE = "trainer_state.json"

log = logging.getLogger(__name__)


@dataclass
class _Resume:
    """A resume in progress: the checkpoint read, and the local folder standing in for it."""

    url: str
    folder: str
    state: dict[str, Any]
    best: str | None = None


def _is_url(text: str) -> bool:
    return "://" in text


def load_into(url: str, what: str, load_state_dict: Callable[..., Any], state: Any, **kw: Any):
    """``load_state_dict(state, **kw)``; its refusal of the stored state as one line."""
    try:
        load_state_dict(state, **kw)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ManifestError(
            f"{url}: the stored {what} cannot be loaded into this run ({first}): resume "
            "with the model, optimizer and scheduler the checkpoint was saved with"
        ) from exc


def _refuse(what: str, flag: Any, who: str) -> None:
    if flag:
        raise ConfigError(
            f"{who or 'CloudckptTrainer'} does not support {what} yet: use the Trainer's own "
            "local checkpoints for that run"
        )


class CloudckptTrainerMixin:
    """The checkpoint methods of :class:`CloudckptTrainer`, to put before a ``Trainer`` class.

    ``checkpoint_url``: the run folder (``s3://bucket/prefix``, ``file://`` or a path) that gets
    the ``checkpoint-<N>`` checkpoints; ``storage``: a :class:`cloudckpt.StorageOptions` (default:
    the process's). ``async_save``: training waits only for the copy of the state to host
    memory, the upload runs meanwhile (:func:`cloudckpt.async_save`; the next save, and the
    end of ``train()``, wait for it). Other arguments go to the Trainer.
    """

    def __init__(
        self,
        *args: Any,
        checkpoint_url: str,
        storage: Any = None,
        async_save: bool = False,
        **kwargs: Any,
    ):
        if not isinstance(checkpoint_url, str) or not checkpoint_url.strip("/"):
            raise ConfigError(f"checkpoint_url must be a run folder URL, got {checkpoint_url!r}")
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        _refuse("push_to_hub", getattr(targs, "push_to_hub", False), type(self).__name__)
        _refuse(
            "load_best_model_at_end",
            getattr(targs, "load_best_model_at_end", False),
            type(self).__name__,
        )
        super().__init__(*args, **kwargs)
        self.checkpoint_url = checkpoint_url.rstrip("/")
        self.checkpoint_storage = storage
        self.checkpoint_async = bool(async_save)
        self._cloud_resume: _Resume | None = None
        self._pending: tuple[SaveHandle, str] | None = None
        t: Any = self
        _refuse("DeepSpeed", t.is_deepspeed_enabled, type(self).__name__)
        _refuse("FSDP", t.is_fsdp_enabled, type(self).__name__)

    # -- where checkpoints are ------------------------------------------------------------------

    def latest_checkpoint(self) -> str | None:
        """The URL of the newest complete ``checkpoint-<N>`` under ``checkpoint_url``, or None."""
        found = newest_complete(
            self.checkpoint_url, CHECKPOINT_PREFIX, storage=self.checkpoint_storage
        )
        return None if found is None else found.url

    def _cloud_run_url(self, trial: Any) -> str:
        t: Any = self
        rel = os.path.relpath(t._get_output_dir(trial=trial), t.args.output_dir)
        return self.checkpoint_url if rel == os.curdir else join_url(self.checkpoint_url, rel)

    def _resume_url(self, resume: Any) -> str | None:
        if resume is True or resume == "latest":
            url = self.latest_checkpoint()
            if url is None:
                raise CheckpointNotFound(
                    f"no complete {CHECKPOINT_PREFIX}<N> checkpoint under {self.checkpoint_url} "
                    "to resume from: pass resume_from_checkpoint=None to start afresh"
                )
            return url
        if isinstance(resume, str) and _is_url(resume):
            return resume.rstrip("/")
        return None

    # -- train ----------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` may also be a checkpoint URL, or
        ``True`` / ``"latest"`` for the newest complete one under ``checkpoint_url``."""
        parent: Any = super()
        url = self._resume_url(resume_from_checkpoint)
        if url is None:
            # fail before the first step on a wrong endpoint, bucket or credentials
            complete_checkpoints(
                self.checkpoint_url, CHECKPOINT_PREFIX, storage=self.checkpoint_storage
            )
            try:
                return parent.train(
                    resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs
                )
            finally:
                self.wait_for_checkpoint()
        state = load_full(url, storage=self.checkpoint_storage)
        record = self._trainer_record(state, url)
        best = record.get("best_model_checkpoint")
        record["best_model_checkpoint"] = None  # an S3 URL: the Trainer would warn and drop it
        with tempfile.TemporaryDirectory(prefix="cloudckpt-resume-") as folder:
            with open(os.path.join(folder, TRAINER_STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(record, f)
            self._cloud_resume = _Resume(url=url, folder=folder, state=state, best=best)
            try:
                return parent.train(resume_from_checkpoint=folder, trial=trial, **kwargs)
            finally:
                self._cloud_resume = None
                self.wait_for_checkpoint()

    @staticmethod
    def _trainer_record(state: dict[str, Any], url: str) -> dict[str, Any]:
        text = state.get("trainer_state")
        try:
            record = json.loads(text) if isinstance(text, str) else None
        except ValueError as exc:
            raise ManifestError(f"{url}: its trainer_state is not JSON ({exc})") from exc
        if not isinstance(record, dict):
            raise ManifestError(
                f"{url} holds no trainer_state record: not a checkpoint of CloudckptTrainer"
            )
        trainer_state = import_framework("transformers", "hf").TrainerState
        try:
            trainer_state(**record)
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"{url}: its trainer_state is not the Trainer's ({exc})") from exc
        return record

    def _resume_for(self, checkpoint: Any) -> _Resume | None:
        r = self._cloud_resume
        return r if r is not None and checkpoint == r.folder else None

    # -- save -----------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t: Any = self
        step = t.state.global_step
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        run_url = self._cloud_run_url(trial)
        url = join_url(run_url, f"{CHECKPOINT_PREFIX}{step}")
        if t.state.best_global_step:
            best = join_url(run_url, f"{CHECKPOINT_PREFIX}{t.state.best_global_step}")
            if t.state.best_global_step == step or best in {
                c.url
                for c in complete_checkpoints(
                    run_url, CHECKPOINT_PREFIX, storage=self.checkpoint_storage
                )
            }:
                t.state.best_model_checkpoint = best
        self._export_callback_states()
        self.wait_for_checkpoint()
        if self.checkpoint_async:
            handle = async_save(
                self.cloud_state_dict(),
                url,
                storage=self.checkpoint_storage,
                metadata={"step": int(t.state.global_step)},
            )
            self._pending = (handle, run_url)
        else:
            self.save_cloud_checkpoint(url)
            self._prune(run_url)

    def wait_for_checkpoint(self) -> None:
        """With ``async_save``: wait until the checkpoint in flight is committed (its error, the
        same on every rank, is raised here), then prune. ``train()`` calls it before it returns
        and each save before it starts."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[0].result()
            self._prune(pending[1])

    def _prune(self, run_url: str) -> None:
        t: Any = self
        limit = t.args.save_total_limit
        if not t.args.should_save or limit is None or limit <= 0:
            return
        best_url = t.state.best_model_checkpoint
        for gone in prune_to(
            run_url,
            CHECKPOINT_PREFIX,
            keep=limit,
            protect=[best_url] if best_url else [],
            storage=self.checkpoint_storage,
        ):
            log.info("deleted %s (save_total_limit=%d)", gone, limit)

    def _export_callback_states(self) -> None:
        # the Trainer's own bookkeeping of ExportableState callbacks, as in _save_checkpoint
        t: Any = self
        if not t.args.should_save:
            return
        exportable = import_framework("transformers.trainer_callback", "hf").ExportableState
        for cb in [*t.callback_handler.callbacks, t.control]:
            if isinstance(cb, exportable):
                name = type(cb).__name__
                if isinstance(t.state.stateful_callbacks.get(name), list):
                    t.state.stateful_callbacks[name].append(cb.state())
                else:
                    t.state.stateful_callbacks[name] = cb.state()

    def cloud_state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds (see the module docstring), this rank's part."""
        t: Any = self
        model = t.accelerator.unwrap_model(t.model)
        state: dict[str, Any] = {
            "model": model.state_dict(),
            "trainer_state": json.dumps(dataclasses.asdict(t.state), indent=2, sort_keys=True),
        }
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            state["model_config"] = config.to_json_string()
        if not t.args.save_only_model:
            state["optimizer"] = t.optimizer.state_dict()
            if t.lr_scheduler is not None:
                state["scheduler"] = t.lr_scheduler.state_dict()
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
            state["rng"] = RNGState()  # saved as rank<N>: each rank's generators
        return state

    def save_cloud_checkpoint(self, url: str) -> SaveResult:
        """Save this Trainer's checkpoint at ``url`` now (every rank calls it: collective)."""
        t: Any = self
        return save(
            self.cloud_state_dict(),
            url,
            storage=self.checkpoint_storage,
            metadata={"step": int(t.state.global_step)},
        )

    # -- resume: the Trainer's loaders, reading the checkpoint instead of the staged folder ------

    def _init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        parent: Any = super()
        out = parent._init_training_state(*args, **kwargs)
        r = self._cloud_resume
        if r is not None:
            t: Any = self
            t.state.best_model_checkpoint = r.best
        return out

    def _load_from_checkpoint(self, resume_from_checkpoint: Any, model: Any = None) -> None:
        r = self._resume_for(resume_from_checkpoint)
        parent: Any = super()
        if r is None:
            return parent._load_from_checkpoint(resume_from_checkpoint, model)
        t: Any = self
        weights = r.state.get("model")
        if not isinstance(weights, dict):
            raise ManifestError(f"{r.url} holds no model weights")
        target = t.accelerator.unwrap_model(model if model is not None else t.model)
        load_into(r.url, "model weights", target.load_state_dict, weights)
        log.info("loaded the model weights from %s", r.url)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        r = self._resume_for(checkpoint)
        parent: Any = super()
        if r is None:
            return parent._load_optimizer_and_scheduler(checkpoint)
        t: Any = self
        if "optimizer" not in r.state:
            log.info("%s holds no optimizer state (saved with save_only_model)", r.url)
            return
        load_into(r.url, "optimizer state", t.optimizer.load_state_dict, r.state["optimizer"])
        if t.lr_scheduler is not None and "scheduler" in r.state:
            load_into(
                r.url, "scheduler state", t.lr_scheduler.load_state_dict, r.state["scheduler"]
            )

    def _load_scaler(self, checkpoint: Any) -> None:
        r = self._resume_for(checkpoint)
        parent: Any = super()
        if r is None:
            return parent._load_scaler(checkpoint)
        t: Any = self
        scaler = getattr(t.accelerator, "scaler", None)
        if scaler is not None and "scaler" in r.state:
            load_into(r.url, "scaler state", scaler.load_state_dict, r.state["scaler"])

    def _load_rng_state(self, checkpoint: Any) -> None:
        r = self._resume_for(checkpoint)
        parent: Any = super()
        if r is None:
            return parent._load_rng_state(checkpoint)
        t: Any = self
        rank = f"rank{t.args.process_index}"
        record = r.state.get("rng")
        if not isinstance(record, dict) or rank not in record:
            log.info("%s holds no random generator state for %s: not reproducible", r.url, rank)
            return
        load_into(r.url, "random generator states", RNGState().load_state_dict, record)


def __getattr__(name: str) -> Any:
    """``CloudckptTrainer``: built on first use (importing this module imports no transformers)."""
    if name != "CloudckptTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    trainer = import_framework("transformers", "hf").Trainer
    cls = type(
        "CloudckptTrainer",
        (CloudckptTrainerMixin, trainer),
        {
            "__module__": __name__,
            "__doc__": "A ``transformers.Trainer`` whose checkpoints go through cloudckpt "
            "(see the module docstring).",
        },
    )
    globals()[name] = cls
    return cls
