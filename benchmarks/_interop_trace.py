"""Request trace of interop.py's native save/load next to the DCP adapter's (issue 27; a
profiling aid, not a benchmark).

    python benchmarks/_interop_trace.py [--gib 0.5] [--methods cloudckpt-dcp,cloudckpt]

The state, world and server of ``interop.py``. Each method saves then loads once after a warm-up;
every S3 request of each rank is recorded (operation, key, body bytes, start and end from the
step's start) with each protocol phase, and printed per method: the timeline per rank, objects
written, requests in flight over time, and where the wall time went.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
import interop as I  # noqa: E402

_LOG: list[tuple] = []
_CLOCK: list = []  # this process's PhaseClock, once hooked


def rank_hook() -> None:
    """Wrap the S3 choke point and the protocol phases of this process (once)."""
    from cloudckpt.storage.s3.conn import S3Connection
    from cloudckpt.storage.s3.rangeget import RangeGetter

    if getattr(S3Connection, "_traced", False):
        return
    send, ranged = S3Connection.send, RangeGetter.__dict__.get("fetch")

    async def traced_send(self, method, *, body=None, **params):
        t0 = time.perf_counter()
        try:
            return await send(self, method, body=body, **params)
        finally:
            size = sum(len(v) for v in body) if body else 0
            key = params.get("Key", "")
            _LOG.append(("s3", method, key, size, t0, time.perf_counter()))

    S3Connection.send = traced_send
    if ranged is not None:

        async def traced_fetch(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return await ranged(self, *a, **k)
            finally:
                _LOG.append(("s3", "ranged_get", "", 0, t0, time.perf_counter()))

        RangeGetter.fetch = traced_fetch
    _CLOCK.append(C.PhaseClock())
    S3Connection._traced = True


def rank_traced_step(method: str, action: str, target: str) -> dict:
    import torch.distributed as dist

    rank_hook()
    dist.barrier()
    _LOG.clear()
    start = time.perf_counter()
    _CLOCK[0].start(start)
    I._do(method, action, target)
    end = time.perf_counter()
    dist.barrier()
    _LOG.extend(("phase", what, "", 0, a, b, c) for what, a, b, c in _CLOCK[0].marks)
    log = [(e[0], e[1], e[2], e[3], e[4] - start, *(x - start for x in e[5:])) for e in _LOG]
    return {"seconds": end - start, "log": log, "rank": dist.get_rank()}


def _report(method: str, action: str, res: list[dict]) -> None:
    print(f"\n## {method} {action}: wall {max(r['seconds'] for r in res):.3f} s")
    for r in res:
        s3 = [e for e in r["log"] if e[0] == "s3"]
        phases = [e for e in r["log"] if e[0] == "phase"]
        ops: dict[str, list] = {}
        for e in s3:
            ops.setdefault(e[1], []).append(e)
        first = min((e[4] for e in s3), default=0.0)
        last = max((e[5] for e in s3), default=0.0)
        print(
            f" rank {r['rank']}: {r['seconds']:.3f} s; first request at {first:.3f}, last ends "
            f"{last:.3f}"
        )
        for op, es in sorted(ops.items()):
            durs = sorted(e[5] - e[4] for e in es)
            mib = sum(e[3] for e in es) / C.MiB
            print(
                f"   {op:24s} n={len(es):3d} {mib:8.1f} MiB  median {durs[len(durs) // 2]:.3f} s"
                f"  max {durs[-1]:.3f} s  span {min(e[4] for e in es):.3f}-"
                f"{max(e[5] for e in es):.3f}"
            )
        for e in phases:
            print(f"   phase {e[1]:22s} {e[4]:.3f} -> {e[5]:.3f} (+exchange to {e[6]:.3f})")
        # requests with a body in flight, sampled every 50 ms
        bodies = [e for e in s3 if e[3] > 0]
        if bodies:
            samples = []
            t = first
            while t < last:
                samples.append(sum(1 for e in bodies if e[4] <= t < e[5]))
                t += 0.05
            print(
                f"   uploads in flight (50 ms samples): mean {sum(samples) / len(samples):.1f}, "
                f"max {max(samples)}, zero in {sum(1 for s in samples if s == 0)} of "
                f"{len(samples)}"
            )
            objs: dict[str, list] = {}
            for e in bodies:
                objs.setdefault(e[2], []).append(e)
            for key, es in objs.items():
                print(
                    f"   object ...{key[-40:]:40s} parts {len(es):2d} "
                    f"{sum(e[3] for e in es) / C.MiB:6.1f} MiB  {min(e[4] for e in es):.3f}-"
                    f"{max(e[5] for e in es):.3f}"
                )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--methods", default="cloudckpt-dcp,cloudckpt")
    a = p.parse_args()
    total = int(a.gib * (1 << 30))
    methods = a.methods.split(",")
    server = C.start_server()
    try:
        C.warm_up_server(server.info, max(64 * C.MiB, total // 8))
        _run(server.info, total, methods)
    finally:
        server.stop()


def _run(info, total: int, methods: list[str]) -> None:
    from cloudckpt.testing import ProcessWorld

    with ProcessWorld(2, timeout=600, env=info.env()) as w:
        args = {"dcp_threads": 4}
        warm = {m: info.url(f"trace/warm/{m}") for m in methods}
        w.run(I.rank_warmup, methods, warm, info, args, timeout=600)
        w.run(I.rank_build, total, 0, info, args, timeout=600)
        for m in methods:
            target = info.url(f"trace/run/{m}")
            for action in ("save", "load"):
                _report(m, action, w.run(rank_traced_step, m, action, target, timeout=600))


if __name__ == "__main__":
    import _interop_trace  # under its module name, so that ProcessWorld can pickle rank functions

    _interop_trace.main()
