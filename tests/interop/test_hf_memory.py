"""A safetensors export's memory stays bounded by a window, the read buffers and (S3) a few
parts, whatever the checkpoint's or the file's size (issue 17: the single-file export of a 320
MB checkpoint peaked at 723 MB; until the S3 destination streamed, it held one whole file).

A 64 MiB checkpoint (twelve 4 MiB tensors and one 16 MiB tensor, larger than the window) is
exported with a 4 MiB window and 4 MiB of read buffers, in a fresh process that measures its
own peak RSS growth (``tests/interop/hf_memory_probe.py``): into one 64 MiB S3 file streamed in
5 MiB parts, two in flight; into a local folder and an s3:// prefix in 16 MiB shards. See
docs/reliability.md (sections 22 and 30) for the figures measured.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import cloudckpt
from tests.reliability.stores import REPO, cli_env

MiB = 1 << 20
SHARD, WINDOW, READ = 16 * MiB, 4 * MiB, 4 * MiB
PART, INFLIGHT = 5 * MiB, 2
SLACK = 8 * MiB  # threads, connections, allocator


def test_export_memory_is_a_window_and_a_few_parts(tmp_path, s3_server, s3_url):
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}": torch.randn(1024, 1024, generator=g) for i in range(12)}
    state["big"] = torch.randn(4096, 1024, generator=g)
    total = sum(t.nbytes for t in state.values())
    src = str(tmp_path / "ck")
    cloudckpt.save(state, src)
    del state
    common = {"window": WINDOW, "read": READ}
    streamed = {"part_size": PART, "multipart_threshold": PART, "concurrency": INFLIGHT}
    spec = [
        {
            "name": "s3-one-file",
            "dst": f"{s3_url}/one",
            "shard": 2 * total,
            "storage": streamed,
            **common,
        },
        {"name": "local", "dst": str(tmp_path / "out"), "shard": SHARD, "storage": None, **common},
        {"name": "s3", "dst": f"{s3_url}/hf", "shard": SHARD, "storage": None, **common},
    ]
    res = subprocess.run(
        [sys.executable, "-m", "tests.interop.hf_memory_probe", src, json.dumps(spec)],
        cwd=REPO,
        env=cli_env(s3_server),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout.strip().splitlines()[-1])
    one = found["s3-one-file"]
    print(
        f"checkpoint {total / MiB:.0f} MiB, growth: "
        + ", ".join(f"{k} {v['growth'] / MiB:.1f} MiB" for k, v in found.items())
    )
    # one file of the whole checkpoint, streamed: 13 parts, never more than a few held
    assert one["files"] == ["model.safetensors"] and one["requests"]["upload_part"] == 13
    assert one["growth"] <= PART * (INFLIGHT + 1) + WINDOW + READ + SLACK <= total / 2
    assert len(found["local"]["files"]) == 5 == len(found["s3"]["files"])  # 4 shards + index
    assert found["local"]["growth"] <= WINDOW + READ + SLACK <= total / 4
    assert found["s3"]["growth"] <= SHARD + WINDOW + READ + SLACK <= total / 2
