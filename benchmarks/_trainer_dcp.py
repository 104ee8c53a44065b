"""Section of benchmarks/trainers.py: DCP-based trainers (torchtitan-style ``dcp.save`` loops).

One process, a state of about ``mib`` MiB: float32 "model" tensors of 4 MiB plus two
optimizer-like tensors per parameter (as AdamW's ``exp_avg`` / ``exp_avg_sq``), a step and an
LR schedule record, handed to DCP as a trainer does. Each method saves ``saves`` times, to a
new step each time, after one warm-up save (first-call costs are not a save's). Baseline: DCP's
own ``FileSystemWriter`` to a local folder (``dcp.save(state, checkpoint_id=folder)``, what
torchtitan does with a local ``checkpoint.folder``); then ``torch.save`` of the same state to a
local file; then :class:`cloudckpt.integrations.dcp_trainer.DCPRun` to the local SeaweedFS,
``save`` (blocked: the whole upload and commit) and ``async_save`` (blocked: until the call
returns, i.e. DCP's staging copy; the upload is awaited outside the timer); and, when s3fs is
installed, DCP's ``FsspecWriter`` to the same server (what torchtitan does with an ``s3://``
folder without cloudckpt).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Meter, MiB, remove_dir  # noqa: E402

TITLE = "DCP-based trainers (dcp.save / dcp.async_save, torchtitan-style)"


def available() -> str | None:
    try:
        import torch.distributed.checkpoint  # noqa: F401
    except ImportError:
        return "torch.distributed.checkpoint is not available"
    return None


def _state(mib: int) -> dict:
    import torch

    n = max(1, (mib * MiB // 3) // (4 * MiB))
    g = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(n)}
    optim = {
        "state": {
            k: {"exp_avg": v * 0.1, "exp_avg_sq": v * v, "step": 3.0} for k, v in model.items()
        },
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": sorted(model)}],
    }
    return {"model": model, "optim": optim, "lr_scheduler": {"last_epoch": 3}, "step": 3}


def _time(save, saves: int, after=None) -> tuple[float, int]:
    save(0)  # warm-up
    if after is not None:
        after()
    blocked, growth = [], 0
    for i in range(1, saves + 1):
        with Meter() as m:
            save(i)
        blocked.append(m.result.seconds)
        growth = max(growth, m.result.rss_growth)
        if after is not None:  # an asynchronous upload: training would run meanwhile
            after()
    return statistics.median(blocked), growth


def measure(server, args) -> list:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from trainers import Row

    from cloudckpt.integrations.dcp_trainer import DCPRun

    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    for key, value in server.info.env().items():
        os.environ[key] = value
    state = _state(args.mib)
    rows = []
    local = os.path.join(args.tmp, "dcp-local")

    s, rss = _time(lambda i: dcp.save(state, checkpoint_id=f"{local}/step-{i}"), args.saves)
    rows.append(Row(method="dcp.save, local folder", blocked_s=s, rss_bytes=rss))
    remove_dir(local)
    os.makedirs(local, exist_ok=True)
    s, rss = _time(lambda i: torch.save(state, f"{local}/step-{i}.pt"), args.saves)
    rows.append(Row(method="torch.save, local file", blocked_s=s, rss_bytes=rss))
    remove_dir(local)

    url = server.info.url("bench-dcp-trainer")
    run = DCPRun(f"{url}/sync", keep_last=2)
    s, rss = _time(lambda i: run.save(state, i), args.saves, after=run.wait)
    rows.append(Row(method="DCPRun.save, s3://", blocked_s=s, rss_bytes=rss, note="keep_last=2"))
    arun = DCPRun(f"{url}/async", keep_last=2)
    s, rss = _time(lambda i: arun.async_save(state, i), args.saves, after=arun.wait)
    rows.append(
        Row(
            method="DCPRun.async_save, s3://",
            blocked_s=s,
            rss_bytes=rss,
            note="staging copy; upload after the call",
        )
    )
    rows.extend(_fsspec_row(server, state, url, args))
    return rows


def _fsspec_row(server, state, url: str, args) -> list:
    from trainers import Row

    try:
        import s3fs  # noqa: F401
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    except ImportError:
        return []
    info = server.info
    opts = {
        "key": info.access_key,
        "secret": info.secret_key,
        "client_kwargs": {"endpoint_url": info.endpoint_url, "region_name": info.region},
    }

    def save(i: int) -> None:
        dcp.save(state, storage_writer=FsspecWriter(f"{url}/fsspec/step-{i}", **opts))

    try:
        s, rss = _time(save, args.saves)
    except Exception as exc:  # s3fs against this server: report, do not fail the section
        return [
            Row(
                method="dcp.save, FsspecWriter s3://",
                blocked_s=0.0,
                rss_bytes=0,
                note=str(exc)[:60],
            )
        ]
    return [Row(method="dcp.save, FsspecWriter s3://", blocked_s=s, rss_bytes=rss, note="s3fs")]
