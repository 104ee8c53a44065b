"""``CloudModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` saving through cloudckpt.

Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel: DTensor parameters and optimizer
state) does not route its sharded saves through ``CheckpointIO``: it writes a torch DCP folder
itself. This subclass replaces those two methods:

- ``save_checkpoint``: every rank calls ``cloudckpt.save`` with Lightning's checkpoint dict as it
  is (its ``state_dict`` and ``optimizer_states`` hold this rank's DTensor shards; the rest is the
  same on every rank and stored once). Collective; a checkpoint already at that name is replaced.
- ``load_checkpoint``: every rank builds the model's and optimizers' sharded state dicts (their
  current layout, which may differ from the saved one: cloudckpt reshards), fills them with
  ``cloudckpt.load`` and sets them; the other entries are read in full and returned to the trainer
  (loops, callbacks, schedulers).
- removals (rank 0) and non-sharded paths go through its ``CloudCheckpointIO``.

``save_distributed_checkpoint=False`` (one full checkpoint gathered on rank 0) is not offered:
cloudckpt's sharded checkpoints load into any layout, or whole with ``cloudckpt.load_full``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from cloudckpt.api.load import load, read_manifest
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.lightning import library
from cloudckpt.integrations.lightning.checkpoint_io import (
    CloudCheckpointIO,
    checkpoint_metadata,
    naming_unsupported_values,
)
from cloudckpt.integrations.lightning.urls import checkpoint_url
from cloudckpt.options import SaveOptions
from cloudckpt.statedict.dtypes import torch_dtype
from cloudckpt.statedict.flatten import unflatten_state_dict

SHARDED = ("state_dict", "optimizer_states")
"""The entries of Lightning's checkpoint dict that hold DTensor shards."""


class CloudModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose checkpoints are cloudckpt's (every rank saves its shards).

    ``storage``, ``allow_pickle`` and ``options`` as :class:`CloudCheckpointIO`'s; the other
    arguments are ``ModelParallelStrategy``'s.
    """

    def __init__(
        self,
        *args: Any,
        storage: Any = None,
        allow_pickle: bool = False,
        options: SaveOptions | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise ConfigError(
                "CloudModelParallelStrategy saves sharded checkpoints only (they load into any "
                "layout, or whole with cloudckpt.load_full): drop save_distributed_checkpoint"
            )
        super().__init__(*args, **kwargs)
        self.storage = storage
        self.allow_pickle = allow_pickle
        self.options = options or SaveOptions()
        self.checkpoint_io = CloudCheckpointIO(
            storage=storage, allow_pickle=allow_pickle, options=self.options
        )

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        url = checkpoint_url(self.broadcast(os.fspath(filepath)))
        with naming_unsupported_values():
            library.save_replacing(
                checkpoint,
                url,
                whole_world=True,
                storage=self.storage,
                allow_pickle=self.allow_pickle,
                metadata={**checkpoint_metadata(checkpoint), "sharded": True},
                options=self.options,
            )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        url = checkpoint_url(self.broadcast(os.fspath(checkpoint_path)))
        allow_pickle = self.allow_pickle and weights_only is not True
        assert self.model is not None and self.lightning_module is not None
        target = _template(read_manifest(url, storage=self.storage, allow_pickle=allow_pickle))
        target["state_dict"] = get_model_state_dict(self.model)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        target["optimizer_states"] = [get_optimizer_state_dict(self.model, o) for o in optimizers]
        load(target, url, storage=self.storage, allow_pickle=allow_pickle)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(self.model, target.pop("state_dict"), options=_options(strict))
        for optimizer, state in zip(optimizers, target.pop("optimizer_states"), strict=True):
            set_optimizer_state_dict(self.model, optimizer, state)
        return target


def _options(strict: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=strict)


def _template(manifest: Any) -> dict:
    """The saved nesting, every tensor outside :data:`SHARDED` an empty full tensor to load into
    (they are small: loops, callbacks, schedulers), the sharded entries left to the caller."""
    leaves: dict[str, Any] = dict(manifest.values)
    for name, record in manifest.tensors.items():
        if name.split(".", 1)[0] in SHARDED:
            leaves[name] = None
        else:
            leaves[name] = torch.empty(tuple(record.shape), dtype=torch_dtype(record.dtype))
    return unflatten_state_dict(manifest.structure, leaves)
