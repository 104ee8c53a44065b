"""``LightningModule.load_from_checkpoint`` for a checkpoint cloudckpt saved.

The classmethod reads its argument with fsspec and ``torch.load`` and bypasses every plugin, so a
cloudckpt folder fails there. :func:`load_from_checkpoint` reads the checkpoint with
``cloudckpt.load_full`` and then does what the classmethod does with the dict (migrations,
hyper-parameters and their overrides, ``on_load_checkpoint``, ``load_state_dict``): Lightning's
private helpers for that are used here and nowhere else.
"""

from __future__ import annotations

from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.saving import _load_state
from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

from cloudckpt.integrations.lightning import library
from cloudckpt.integrations.lightning.urls import checkpoint_url, is_remote

M = TypeVar("M", bound="pl.LightningModule")


def load_from_checkpoint(
    cls: type[M],
    url: str,
    *,
    map_location: Any = None,
    strict: bool | None = None,
    storage: Any = None,
    allow_pickle: bool = False,
    **hparams: Any,
) -> M:
    """An instance of the LightningModule ``cls`` built and filled from the checkpoint at ``url``.

    As ``cls.load_from_checkpoint``: ``hparams`` override the saved hyper-parameters, ``strict``
    is passed to ``load_state_dict``, ``map_location`` places the tensors (default: CPU). The
    module is in the state the classmethod leaves it (``eval()`` is the caller's).
    """
    url = checkpoint_url(url)
    checkpoint = library.load_whole(
        url, storage=storage, allow_pickle=allow_pickle, map_location=map_location
    )
    checkpoint.pop(library.RNG_KEY, None)  # loading a module leaves the generators alone
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=url)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(hparams)
    model = _load_state(cls, checkpoint, strict=strict, **hparams)
    assert isinstance(model, cls)
    state = checkpoint.get("state_dict") or {}
    device = next((t.device for t in state.values() if isinstance(t, torch.Tensor)), None)
    return model.to(device) if device is not None else model


class CloudLoadable:
    """Mix into a LightningModule (first) so that ``MyModule.load_from_checkpoint(url)`` reads
    cloudckpt checkpoints; local paths and file objects go to Lightning's own."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(checkpoint_path, str) and is_remote(checkpoint_path) and not args:
            if kwargs.pop("hparams_file", None) is not None:
                raise TypeError("hparams_file is not supported for a cloudckpt checkpoint")
            kwargs.pop("weights_only", None)  # nothing is unpickled unless allow_pickle=True
            return load_from_checkpoint(cls, checkpoint_path, **kwargs)  # type: ignore[type-var]
        parent: Any = super()
        return parent.load_from_checkpoint(checkpoint_path, *args, **kwargs)
