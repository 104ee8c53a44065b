"""cloudckpt for PyTorch Lightning 2.x (``pip install 'cloudckpt[lightning]'``).

```python
from cloudckpt.integrations.lightning import CloudCheckpointIO, CloudModelCheckpoint
ckpt = CloudModelCheckpoint(dirpath="s3://bucket/run", every_n_train_steps=100, save_last=True)
trainer = L.Trainer(plugins=[CloudCheckpointIO()], callbacks=[ckpt])
trainer.fit(model, ckpt_path="last")                         # or "s3://bucket/run/<name>.ckpt"
model = load_from_checkpoint(MyModule, "s3://bucket/run/last.ckpt")
```

- :class:`CloudCheckpointIO` (``checkpoint_io``): the ``CheckpointIO`` plugin: every save, load
  and removal of the trainer goes through cloudckpt (one checkpoint folder per Lightning path).
- :class:`CloudModelCheckpoint` (``model_checkpoint``): ``ModelCheckpoint`` with an ``s3://``
  ``dirpath``, listings and ``ckpt_path="last"`` answered by cloudckpt (no s3fs).
- :class:`CloudModelParallelStrategy` (``model_parallel``): ``ModelParallelStrategy`` (FSDP2 /
  DTensor) whose sharded saves and loads are cloudckpt's, every rank writing its shards
  (Lightning routes sharded saves around ``CheckpointIO``).
- :func:`load_from_checkpoint` (``loading``): ``LightningModule.load_from_checkpoint`` for a
  cloudckpt URL (the classmethod reads files through fsspec and ``torch.load``);
  :class:`CloudLoadable` makes ``MyModule.load_from_checkpoint(url)`` itself do it.

Lightning is imported when one of these names is first used; without it, a ``ConfigError``
names the extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "CloudCheckpointIO": "checkpoint_io",
    "CloudModelCheckpoint": "model_checkpoint",
    "CloudModelParallelStrategy": "model_parallel",
    "load_from_checkpoint": "loading",
    "CloudLoadable": "loading",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from cloudckpt.integrations.optional import import_framework

    import_framework("lightning", "lightning")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
