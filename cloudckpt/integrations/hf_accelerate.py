"""Hugging Face Accelerate's ``save_state`` / ``load_state``, to S3 through cloudckpt.

``save_state(accelerator, url)`` and ``load_state(accelerator, url)`` take the place of
``accelerator.save_state(dir)`` / ``accelerator.load_state(dir)``: one cloudckpt checkpoint,
written straight from memory (nothing on local disk), collective (every process calls them, as
with Accelerate's own). With ``ProjectConfiguration(automatic_checkpoint_naming=True)``, ``url``
is the run folder: ``save_state`` writes ``<url>/checkpoint_<iteration>`` and prunes to
``total_limit`` through cloudckpt's safe deletion (the newest complete checkpoint is never
deleted), ``load_state`` loads the newest complete ``checkpoint_<N>`` under it.

A checkpoint holds what Accelerate's folder holds, as tensors and plain values (no pickle):
``models``: each prepared model's unwrapped ``state_dict()`` (``models.0.`` is the
``--prefix`` of an export for ``from_pretrained``); ``optimizers``, ``schedulers``: their
``state_dict()`` lists; ``scaler``; ``custom``: the ``state_dict()`` of each object of
``register_for_checkpointing``; ``dataloaders``: each one's ``state_dict()`` when it is a
stateful dataloader, or its seedable sampler's epoch and seed; ``step``: ``accelerator.step``;
``rng``: ``rank<N>``: each process's torch, CUDA, numpy and Python generators. Accelerate's save
pre-hooks (``register_save_state_pre_hook``) run with the weights list and the URL. Every
process reads the whole checkpoint on load (``load_full``, CPU tensors). Not supported:
DeepSpeed, FSDP and Megatron-LM states (``ConfigError``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from cloudckpt.api.load import load_full
from cloudckpt.api.save import save
from cloudckpt.errors import CheckpointNotFound, ConfigError, ManifestError
from cloudckpt.integrations.hf_trainer import load_into
from cloudckpt.integrations.run_folder import newest_complete, prune_to
from cloudckpt.layout import join_url
from cloudckpt.statedict.rng import RNGState

__all__ = ["CHECKPOINT_PREFIX", "load_state", "save_state"]

#: Accelerate's automatic checkpoint names: ``checkpoint_<iteration>``.
CHECKPOINT_PREFIX = "checkpoint_"

log = logging.getLogger(__name__)


def _check(accelerator: Any) -> None:
    kind = str(getattr(accelerator, "distributed_type", ""))
    for unsupported in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        if kind.endswith(unsupported):
            raise ConfigError(
                f"cloudckpt's save_state does not support {unsupported} yet: use "
                "accelerator.save_state for that run"
            )


def _automatic(accelerator: Any) -> bool:
    return bool(getattr(accelerator.project_configuration, "automatic_checkpoint_naming", False))


def state_dict(accelerator: Any) -> dict[str, Any]:
    """What :func:`save_state` stores, this process's part (see the module docstring)."""
    _check(accelerator)
    state: dict[str, Any] = {
        "models": [accelerator.unwrap_model(m).state_dict() for m in accelerator._models],
        "optimizers": [o.state_dict() for o in accelerator._optimizers],
        "schedulers": [s.state_dict() for s in accelerator._schedulers],
        "custom": [o.state_dict() for o in accelerator._custom_objects],
        "dataloaders": [_dataloader_state(d) for d in accelerator._dataloaders],
        "step": int(accelerator.step),
        "rng": RNGState(),  # saved as rank<N>: each process's generators
    }
    if accelerator.scaler is not None:
        state["scaler"] = accelerator.scaler.state_dict()
    return state


def _dataloader_state(dataloader: Any) -> dict[str, Any]:
    if getattr(dataloader, "use_stateful_dataloader", False):
        return {"state": dataloader.state_dict()}
    sampler = dataloader.get_sampler() if hasattr(dataloader, "get_sampler") else None
    if sampler is not None and hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch"):
        return {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    return {}


def save_state(accelerator: Any, url: str, *, storage: Any = None) -> str:
    """Save the accelerator's state at ``url`` (with automatic checkpoint naming: under it);
    returns the checkpoint's URL. Collective: every process calls it."""
    state = state_dict(accelerator)
    config = accelerator.project_configuration
    target = url.rstrip("/")
    if _automatic(accelerator):
        target = join_url(target, f"{CHECKPOINT_PREFIX}{config.iteration}")
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(accelerator._models, state["models"], target)
    save(state, target, storage=storage, metadata={"step": int(accelerator.step)})
    if _automatic(accelerator):
        config.iteration += 1
        if config.total_limit is not None and accelerator.is_main_process:
            for gone in prune_to(
                url.rstrip("/"), CHECKPOINT_PREFIX, keep=config.total_limit, storage=storage
            ):
                log.info("deleted %s (total_limit=%d)", gone, config.total_limit)
    return target


def load_state(
    accelerator: Any,
    url: str,
    *,
    storage: Any = None,
    strict: bool = True,
    missing_ok: bool = False,
) -> str | None:
    """Load the state of the checkpoint at ``url`` (with automatic checkpoint naming: the newest
    complete one under it) into the accelerator's prepared objects; returns the URL loaded.
    Every process calls it. ``missing_ok`` (automatic naming): None, nothing loaded, when the
    run has no complete checkpoint yet (a first start), instead of ``CheckpointNotFound``."""
    _check(accelerator)
    target = url.rstrip("/")
    if _automatic(accelerator):
        newest = newest_complete(target, CHECKPOINT_PREFIX, storage=storage)
        if newest is None:
            if missing_ok:
                return None
            raise CheckpointNotFound(
                f"no complete {CHECKPOINT_PREFIX}<N> checkpoint under {target} to load"
            )
        target = newest.url
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(accelerator._models, target)
    state = load_full(target, storage=storage)
    _restore(accelerator, state, target, strict)
    if _automatic(accelerator):
        m = re.search(r"(\d+)$", target)
        if m is not None:
            accelerator.project_configuration.iteration = int(m.group(1)) + 1
    return target


def _items(state: dict[str, Any], key: str, want: int, url: str) -> list[Any]:
    items = state.get(key, [])
    if not isinstance(items, list) or len(items) != want:
        got = len(items) if isinstance(items, list) else "no list"
        raise ManifestError(
            f"{url} holds {got} {key} where the accelerator has {want} prepared: prepare the "
            "same objects (and register_for_checkpointing the same ones) as the run that saved it"
        )
    return items


def _restore(accelerator: Any, state: dict[str, Any], url: str, strict: bool) -> None:
    models = _items(state, "models", len(accelerator._models), url)
    optimizers = _items(state, "optimizers", len(accelerator._optimizers), url)
    schedulers = _items(state, "schedulers", len(accelerator._schedulers), url)
    custom = _items(state, "custom", len(accelerator._custom_objects), url)
    for i, (model, weights) in enumerate(zip(accelerator._models, models)):
        load_into(
            url,
            f"model {i}",
            accelerator.unwrap_model(model).load_state_dict,
            weights,
            strict=strict,
        )
    for i, (opt, opt_state) in enumerate(zip(accelerator._optimizers, optimizers)):
        load_into(url, f"optimizer {i}", opt.load_state_dict, opt_state)
    for i, (sched, sched_state) in enumerate(zip(accelerator._schedulers, schedulers)):
        load_into(url, f"scheduler {i}", sched.load_state_dict, sched_state)
    for i, (obj, obj_state) in enumerate(zip(accelerator._custom_objects, custom)):
        load_into(url, f"custom object {i}", obj.load_state_dict, obj_state)
    for dl, dl_state in zip(accelerator._dataloaders, state.get("dataloaders", [])):
        if isinstance(dl_state, dict) and "state" in dl_state:
            dl.load_state_dict(dl_state["state"])
        elif isinstance(dl_state, dict) and "epoch" in dl_state:
            sampler = dl.get_sampler()
            sampler.initial_seed = int(dl_state["initial_seed"])
            sampler.set_epoch(int(dl_state["epoch"]))
    if accelerator.scaler is not None and "scaler" in state:
        accelerator.scaler.load_state_dict(state["scaler"])
    if isinstance(state.get("step"), int):
        accelerator.step = state["step"]
    record = state.get("rng")
    if not isinstance(record, dict) or f"rank{accelerator.process_index}" not in record:
        log.info("%s holds no random generator state for this process", url)
    else:
        load_into(url, "random generator states", RNGState().load_state_dict, record)
