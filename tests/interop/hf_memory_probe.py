"""Run as ``python -m tests.interop.hf_memory_probe SRC SPEC``: exports the checkpoint SRC once
per entry of SPEC (JSON: a list of ``{"name", "dst", "shard", "window", "read", "storage"}``,
``storage`` None or ``StorageOptions`` fields) after a small warm-up export per entry that loads
every module and starts the runtime and the store, and prints one JSON line: per name, the
export's peak RSS growth in bytes (``cloudckpt.testing.memory.PeakRSS``), the files it wrote and
the requests of the destination store."""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main(argv: list[str]) -> None:
    import torch

    import cloudckpt
    from cloudckpt.export.folder import export_safetensors
    from cloudckpt.options import LoadOptions
    from cloudckpt.runtime.loop import shared_store
    from cloudckpt.testing.memory import PeakRSS

    src, spec = argv[0], json.loads(argv[1])
    with tempfile.TemporaryDirectory() as tmp:  # warm-up: imports, runtime thread, stores
        small = os.path.join(tmp, "ck")
        cloudckpt.save({"w": torch.ones(1024)}, small)
        for i, e in enumerate(spec):
            e["storage"] = e["storage"] and cloudckpt.StorageOptions(**e["storage"])
            warm = f"{e['dst']}-warmup" if e["dst"].startswith("s3://") else f"{tmp}/w{i}"
            export_safetensors(
                small,
                warm,
                window_bytes=e["window"],
                storage=e["storage"],
                options=LoadOptions(max_read_bytes=e["read"]),
            )
    out = {}
    for e in spec:
        store = shared_store(e["dst"], e["storage"])
        store.stats.reset()
        with PeakRSS() as m:
            result = export_safetensors(
                src,
                e["dst"],
                max_shard_bytes=e["shard"],
                window_bytes=e["window"],
                storage=e["storage"],
                options=LoadOptions(max_read_bytes=e["read"]),
            )
        out[e["name"]] = {
            "growth": m.growth,
            "files": list(result.files),
            "requests": dict(store.stats.requests),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
