"""cloudckpt: distributed PyTorch checkpoints on S3-compatible object stores.

```python
import cloudckpt
result = cloudckpt.save(state_dict, "s3://bucket/run/step-100")    # -> SaveResult
cloudckpt.load(state_dict, "s3://bucket/run/step-100")             # fills state_dict in place
full = cloudckpt.load_full("s3://bucket/run/step-100")             # one process, full tensors
handle = cloudckpt.async_save(state_dict, "s3://bucket/run/step-200")
mgr = cloudckpt.CheckpointManager("s3://bucket/run", keep_last=3)
```
"""

from cloudckpt import errors  # noqa: E402,F401
from cloudckpt.errors import *  # noqa: E402,F401,F403
from cloudckpt.version import __version__  # noqa: E402,F401

_LAZY = {
    "save": ("cloudckpt.api.save", "save"),
    "load": ("cloudckpt.api.load", "load"),
    "load_full": ("cloudckpt.api.load", "load_full"),
    "read_manifest": ("cloudckpt.api.load", "read_manifest"),
    "load_safetensors": ("cloudckpt.hf.load", "load_safetensors"),
    "async_save": ("cloudckpt.api.async_save", "async_save"),
    "SaveHandle": ("cloudckpt.api.async_save", "SaveHandle"),
    "verify": ("cloudckpt.api.verify", "verify"),
    "VerifyReport": ("cloudckpt.api.verify", "VerifyReport"),
    "SaveOptions": ("cloudckpt.options", "SaveOptions"),
    "LoadOptions": ("cloudckpt.options", "LoadOptions"),
    "SaveResult": ("cloudckpt.options", "SaveResult"),
    "LoadResult": ("cloudckpt.options", "LoadResult"),
    "StorageOptions": ("cloudckpt.storage", "StorageOptions"),
    "RetryOptions": ("cloudckpt.storage", "RetryOptions"),
    "GlobalPiece": ("cloudckpt.statedict.pieces", "GlobalPiece"),
    "RNGState": ("cloudckpt.statedict.rng", "RNGState"),
    "CheckpointManager": ("cloudckpt.runs.manager", "CheckpointManager"),
    "LocalTier": ("cloudckpt.runs.tier.options", "LocalTier"),
    "CheckpointInfo": ("cloudckpt.runs.pruning", "CheckpointInfo"),
    "exists": ("cloudckpt.runs.checkpoints", "exists"),
    "delete": ("cloudckpt.runs.checkpoints", "delete"),
    "list_checkpoints": ("cloudckpt.runs.checkpoints", "list_checkpoints"),
    "RetentionPolicy": ("cloudckpt.runs.retention", "RetentionPolicy"),
    "PreemptionHandler": ("cloudckpt.runs.preemption", "PreemptionHandler"),
    "Preempted": ("cloudckpt.runs.preemption", "Preempted"),
    "SpotNoticePoller": ("cloudckpt.runs.spot", "SpotNoticePoller"),
    "SpotNoticeOptions": ("cloudckpt.runs.spot", "SpotNoticeOptions"),
    "ManagedSaveHandle": ("cloudckpt.runs.manager", "ManagedSaveHandle"),
    "export_safetensors": ("cloudckpt.export.folder", "export_safetensors"),
    "convert": ("cloudckpt.dcp.convert", "convert"),
}


def __getattr__(name: str):
    """Import the public API lazily: ``import cloudckpt`` stays cheap (no torch import)."""
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'cloudckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
