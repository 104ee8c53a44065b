"""Test infrastructure: a local SeaweedFS S3 endpoint and a multi-rank process harness.

Used by tests, examples and benchmarks; library code never imports this package.
- `servers/`: local S3 endpoints: `seaweed/` (`server`: S3Server, start_s3_server; SeaweedFS
  `weed mini`), `endpoint` (S3ServerInfo, S3ServerError), `moto`, `imds`, `tlsca`.
- `ranks/`: `world` (ProcessWorld: persistent gloo worlds, RankFailedError, WorldTimeoutError),
  with its `zygote` and `worker` processes.
- `faults/`: proxies that inject faults in front of an endpoint; `cluster/`: a simulated cluster
  in network namespaces; `memory`: memory measurement helpers.

Names are re-exported lazily, so `python -m cloudckpt.testing.servers.seaweed` runs cleanly and
importing this package costs nothing.
"""

import importlib

_EXPORTS = {
    "S3Server": "servers.seaweed.server",
    "S3ServerError": "servers.endpoint",
    "S3ServerInfo": "servers.endpoint",
    "start_s3_server": "servers.seaweed.server",
    "ProcessWorld": "ranks.world",
    "RankFailedError": "ranks.world",
    "WorldTimeoutError": "ranks.world",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = importlib.import_module(f"cloudckpt.testing.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'cloudckpt.testing' has no attribute {name!r}")
