"""Hugging Face safetensors export benchmark (issue 17): the streaming folder export against the
old single-file export.

    python benchmarks/interop_hf.py --quick            # ~64 MiB
    python benchmarks/interop_hf.py --gib 0.5          # the issue's figures (~512 MiB)

One SeaweedFS (started here, with credentials) holds a checkpoint of about ``--gib`` GiB
(float32 tensors of 4-32 MiB under "model" and "optim", a few hundred tiny ones and non-tensor
values). Each method exports all of its tensors in a fresh process (so no step inherits
another's allocator state) that measures its wall seconds and peak RSS growth (VmHWM, reset
at the start of the step):

- ``single-file``: ``cloudckpt export URL OUT.safetensors`` (``load_full``, then one file);
- ``folder-local``: ``export_safetensors(URL, DIR)`` into a local folder;
- ``folder-s3``: the same into an ``s3://`` prefix on the same server.

``--shard-mib`` sets the shard size (default 128 MiB, so the export makes several files).
:func:`run_export_benchmark` runs it all and returns the rows; another script can call it
with a server of its own (``info``: a ``cloudckpt.testing.servers.endpoint.S3ServerInfo``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)

METHODS = ("single-file", "folder-local", "folder-s3")


def make_state(total_bytes: int) -> dict:
    """About ``total_bytes`` of float32 tensors: 2/3 under "model", 1/3 under "optim"."""
    import torch

    g = torch.Generator().manual_seed(0)
    state: dict = {"model": {}, "optim": {}, "step": 1234, "name": "bench"}
    sizes = (4, 8, 16, 32)  # MiB
    left, i = total_bytes, 0
    while left > 0:
        mib = min(sizes[i % len(sizes)], max(1, left // C.MiB))
        part = "optim" if i % 3 == 2 else "model"
        state[part][f"layer{i}.weight"] = torch.randn(mib * 1024, 256, generator=g)
        left -= mib * C.MiB
        i += 1
    for k in range(300):
        state["model"][f"norm{k}.bias"] = torch.randn(64, generator=g)
    return state


def _measure(method: str, url: str, out: str, shard: int) -> dict:
    """One step, in this (fresh) process: import and warm up, then measure the export."""
    import torch

    import cloudckpt
    from cloudckpt.export.file import export
    from cloudckpt.testing.memory import PeakRSS

    with tempfile.TemporaryDirectory() as tmp:  # warm-up: imports, runtime thread, the store
        small = os.path.join(tmp, "ck")
        cloudckpt.save({"model": {"w": torch.ones(16)}}, small)
        export(small, os.path.join(tmp, "w.safetensors"))
        cloudckpt.export_safetensors(small, os.path.join(tmp, "w"), prefix="model.")
        cloudckpt.read_manifest(url)
    with C.Meter() as meter, PeakRSS() as rss:
        if method == "single-file":
            export(url, out)
            files = [out]
        else:
            result = cloudckpt.export_safetensors(url, out, max_shard_bytes=shard)
            files = list(result.files)
    return {
        "seconds": meter.result.seconds,
        "cpu": meter.result.cpu,
        "growth": rss.growth,
        "files": len(files),
    }


def run_export_benchmark(
    gib: float = 0.5,
    *,
    shard_mib: int = 128,
    info=None,
    workdir: str | None = None,
    methods=METHODS,
    log=print,
) -> list[dict]:
    """Run every method once; returns one row per method: ``method``, ``seconds``, ``mbps``
    (bytes exported / second, 10**6), ``growth`` (peak RSS growth, bytes), ``files``,
    ``bytes`` (the checkpoint's tensor bytes). ``info``: a running server's S3ServerInfo (one is
    started and stopped here otherwise)."""
    import cloudckpt

    C.repo_on_path()
    server = None
    if info is None:
        server = C.start_server()
        info = server.info
    env = dict(os.environ, **info.env(), PYTHONPATH=str(C.REPO_ROOT))
    os.environ.update(info.env())
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        try:
            state = make_state(int(gib * C.GiB))
            url = info.url("bench-hf/ck")
            cloudckpt.save(state, url)
            del state
            nbytes = cloudckpt.read_manifest(url).total_bytes()
            log(f"checkpoint {url}: {nbytes / C.MiB:.0f} MiB")
            for method in methods:
                out = {
                    "single-file": os.path.join(tmp, "model.safetensors"),
                    "folder-local": os.path.join(tmp, "hf"),
                    "folder-s3": info.url("bench-hf/hf"),
                }[method]
                res = subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--measure",
                        method,
                        url,
                        out,
                        str(shard_mib * C.MiB),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=3600,
                )
                if res.returncode != 0:
                    raise RuntimeError(f"{method} failed: {res.stderr[-2000:]}")
                row = json.loads(res.stdout.strip().splitlines()[-1])
                row.update(method=method, bytes=nbytes, mbps=nbytes / row["seconds"] / 1e6)
                rows.append(row)
        finally:
            C.s3_delete_prefix(info, "bench-hf/")
            if server is not None:
                server.stop()
    return rows


def export_table(rows: list[dict], title: str = "method") -> str:
    """The rows of :func:`run_export_benchmark` as a table."""
    table = C.Table((title, "exported MiB", "files", "seconds", "MB/s", "peak RSS growth MiB"))
    for r in rows:
        table.add(
            r["method"],
            C.fmt_mib(r["bytes"]),
            r["files"],
            C.fmt_s(r["seconds"]),
            f"{r['mbps']:.0f}",
            C.fmt_mib(r["growth"]),
        )
    return table.render()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--quick", action="store_true", help="about 64 MiB")
    p.add_argument("--shard-mib", type=int, default=128)
    p.add_argument("--workdir", default=None, help="where local files go (default: /tmp)")
    p.add_argument(
        "--measure", nargs=4, metavar=("METHOD", "URL", "OUT", "SHARD"), help=argparse.SUPPRESS
    )
    args = p.parse_args()
    if args.measure:
        method, url, out, shard = args.measure
        print(json.dumps(_measure(method, url, out, int(shard))))
        return
    gib = 1 / 16 if args.quick else args.gib
    shard = max(4, args.shard_mib // 8) if args.quick else args.shard_mib
    print(C.describe_machine())
    rows = run_export_benchmark(gib, shard_mib=shard, workdir=args.workdir)
    print(export_table(rows))
    print(f"shard size {shard} MiB")


if __name__ == "__main__":
    main()
