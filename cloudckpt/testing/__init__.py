"""Test infrastructure: a local SeaweedFS S3 endpoint and a multi-rank process harness.

Used by tests, examples and benchmarks; library code never imports this package.
- `cloudckpt.testing.servers.seaweed`: S3Server / S3ServerInfo / start_s3_server (SeaweedFS `weed mini`).
- `cloudckpt.testing.dist.world`: ProcessWorld (persistent gloo worlds), RankFailedError, WorldTimeoutError.

Names are re-exported lazily, so `python -m cloudckpt.testing.servers.seaweed` runs cleanly and importing
this package costs nothing.
"""

import importlib

_EXPORTS = {
    "S3Server": "servers.seaweed",
    "S3ServerError": "servers.weed_host",
    "S3ServerInfo": "servers.endpoint",
    "start_s3_server": "servers.seaweed",
    "ProcessWorld": "dist.world",
    "RankFailedError": "dist.world",
    "WorldTimeoutError": "dist.world",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"cloudckpt.testing.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'cloudckpt.testing' has no attribute {name!r}")
