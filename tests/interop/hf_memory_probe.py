"""Run as ``python -m tests.interop.hf_memory_probe SRC DST_LOCAL [DST_S3] SHARD WINDOW READ``:
exports the checkpoint SRC to each destination (after a small warm-up export that loads every
module and starts the runtime) and prints one JSON line: each export's peak RSS growth in
bytes (``cloudckpt.testing.memory.PeakRSS``) and the files it wrote."""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main(argv: list[str]) -> None:
    import torch

    import cloudckpt
    from cloudckpt.hf.export import export_safetensors
    from cloudckpt.options import LoadOptions
    from cloudckpt.testing.memory import PeakRSS

    src, dsts = argv[0], argv[1:-3]
    shard, window, read = (int(x) for x in argv[-3:])
    options = LoadOptions(max_read_bytes=read)
    with tempfile.TemporaryDirectory() as tmp:  # warm-up: imports, runtime thread, stores
        small = os.path.join(tmp, "ck")
        cloudckpt.save({"w": torch.ones(1024)}, small)
        for i, dst in enumerate(dsts):
            warm = f"{dst}-warmup" if dst.startswith("s3://") else os.path.join(tmp, f"w{i}")
            export_safetensors(small, warm, window_bytes=window, options=options)
    out = {}
    for dst in dsts:
        with PeakRSS() as m:
            result = export_safetensors(src, dst, max_shard_bytes=shard, window_bytes=window,
                                        options=options)
        out["s3" if dst.startswith("s3://") else "local"] = {"growth": m.growth,
                                                             "files": list(result.files)}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
