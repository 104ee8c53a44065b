"""Test infrastructure: a local SeaweedFS S3 endpoint and a multi-rank process harness.

Used by tests, examples and benchmarks; library code never imports this package.
- `cloudckpt.testing.s3server`: S3Server / S3ServerInfo / start_s3_server (SeaweedFS `weed mini`).
- `cloudckpt.testing.dist`: ProcessWorld (persistent gloo worlds), RankFailedError, WorldTimeoutError.

Names are re-exported lazily, so `python -m cloudckpt.testing.s3server` runs cleanly and importing
this package costs nothing.
"""

import importlib

_EXPORTS = {
    "S3Server": "s3server", "S3ServerError": "s3server", "S3ServerInfo": "s3server",
    "start_s3_server": "s3server",
    "ProcessWorld": "dist", "RankFailedError": "dist", "WorldTimeoutError": "dist",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"cloudckpt.testing.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'cloudckpt.testing' has no attribute {name!r}")
