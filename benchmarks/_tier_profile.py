"""Profile of a tiered resume after a lost node (issue 25, step 1; not a benchmark).

    python benchmarks/_tier_profile.py [N] [MiB]

Saves 2 steps with a tier at N nodes (simulated cluster), wipes node N-1's tier, loads once
with the tier (warm-up in the same processes: a new manager, like the benchmark) and reports
per rank: phases (names, count), peer/S3 requests by method, CPU seconds and wall seconds
before the data phase ("load") starts, the whole load; rank 0's cProfile top lines.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cluster_recovery as RR  # noqa: E402

MiB = 1 << 20


def rank_profile(url: str, total: int, step: int, fresh: bool) -> dict:
    import cProfile
    import io
    import pstats

    import torch.distributed as dist

    import cloudckpt.api.load as L
    import cloudckpt.runs.tier.reading  # noqa: F401
    import cloudckpt.transport as T
    from cloudckpt import CheckpointManager
    from cloudckpt.storage.peer.client import PeerStore

    if fresh:  # forget what earlier managers of this process cached
        import cloudckpt.runs.tier.node as N
        import cloudckpt.runs.tier.peers as P

        for module, name in ((P, "_NODES"), (P, "_HOSTS"), (N, "_LISTED")):
            getattr(module, name, {}).clear()
    phases: list[str] = []
    marks: list[tuple[str, float]] = []
    peer: dict[str, int] = {}
    first_byte: dict[str, float] = {}
    orig_phase, orig_move, orig_req = T.ControlChannel.phase, L.move_data, PeerStore._request
    orig_join = T.ControlChannel.join
    orig_enter, orig_exit = T.Phase.__enter__, T.Phase.__exit__

    def enter(self):
        marks.append((f"{self.what}>", time.perf_counter()))
        return orig_enter(self)

    def exit_(self, *exc):
        marks.append((f"{self.what}:agree", time.perf_counter()))
        try:
            return orig_exit(self, *exc)
        finally:
            marks.append((f"{self.what}<", time.perf_counter()))

    def phase(self, what, *a, **k):
        phases.append(what)
        return orig_phase(self, what, *a, **k)

    def join(self, call, *a, **k):
        phases.append(f"join:{call}")
        marks.append((f"join {call}>", time.perf_counter()))
        try:
            return orig_join(self, call, *a, **k)
        finally:
            marks.append((f"join {call}<", time.perf_counter()))

    def move(*a, **k):
        first_byte.setdefault("cpu", time.process_time())
        first_byte.setdefault("wall", time.perf_counter())
        return orig_move(*a, **k)

    async def request(self, method, key, **k):
        peer[method] = peer.get(method, 0) + 1
        return await orig_req(self, method, key, **k)

    T.ControlChannel.phase, L.move_data, PeerStore._request = phase, move, request
    T.ControlChannel.join = join
    T.Phase.__enter__, T.Phase.__exit__ = enter, exit_
    import cloudckpt.runs.tier.node as N
    import cloudckpt.runs.tier.reading as R

    orig_list, orig_inv = R.list_run, N.NodeTier.inventory

    async def list_run(*a, **k):
        t = time.perf_counter()
        try:
            return await orig_list(*a, **k)
        finally:
            marks.append((f"[store listing {(time.perf_counter() - t) * 1000:.0f} ms]", t))

    def inventory(self):
        t = time.perf_counter()
        try:
            return orig_inv(self)
        finally:
            marks.append((f"[own inventory {(time.perf_counter() - t) * 1000:.0f} ms]", t))

    R.list_run, N.NodeTier.inventory = list_run, inventory
    try:
        mgr = CheckpointManager(url, local=RR._tier({"replicas": 1, "keep": 2}))
        s3 = mgr.store.stats
        s3_before = dict(s3.requests)
        state = RR._state(total, 0, blank=True)
        dist.barrier()
        prof = cProfile.Profile()
        c0, w0 = time.process_time(), time.perf_counter()
        prof.enable()
        loaded = mgr.load(state)
        prof.disable()
        c1, w1 = time.process_time(), time.perf_counter()
    finally:
        T.ControlChannel.phase, L.move_data, PeerStore._request = orig_phase, orig_move, orig_req
        T.ControlChannel.join = orig_join
        T.Phase.__enter__, T.Phase.__exit__ = orig_enter, orig_exit
        R.list_run, N.NodeTier.inventory = orig_list, orig_inv
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
    return {
        "loaded": loaded,
        "phases": phases,
        "peer_requests": peer,
        "s3_requests": {
            k: v - s3_before.get(k, 0) for k, v in s3.requests.items() if v - s3_before.get(k, 0)
        },
        "cpu_before_data": first_byte.get("cpu", c1) - c0,
        "wall_before_data": first_byte.get("wall", w1) - w0,
        "cpu_load": c1 - c0,
        "wall_load": w1 - w0,
        "marks": " ".join(f"{m}@{(t - w0) * 1000:.0f}" for m, t in marks),
        "profile": out.getvalue() if dist.get_rank() == 0 else "",
    }


def main() -> None:
    import _tier_profile as TP

    from cloudckpt.testing.cluster.simulated import Cluster

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    mib = float(sys.argv[2]) if len(sys.argv) > 2 else 16
    total = int(mib * MiB)
    shutil.rmtree(RR.TIER_ROOT, ignore_errors=True)
    with Cluster(nodes=n, frontend_mbit=50, backend_mbit=500, bucket="bench", timeout=300) as c:
        c.run(RR.rank_save, "s3://bench/tiered", total, True, timeout=300)
        shutil.rmtree(os.path.join(RR.TIER_ROOT, f"node{n - 1}"))
        for label, fresh in (("fresh process cache", True), ("warm (2nd manager)", False)):
            rows = c.run(TP.rank_profile, "s3://bench/tiered", total, 2, fresh, timeout=300)
            print(f"\n== N={n}, {label} ==")
            for r, row in enumerate(rows):
                print(
                    f"rank {r}: loaded {row['loaded']} phases {len(row['phases'])} "
                    f"{row['phases']}\n   peer {row['peer_requests']} s3 {row['s3_requests']}"
                    f"\n   before data: cpu {row['cpu_before_data']:.3f} s wall "
                    f"{row['wall_before_data']:.3f} s; load cpu {row['cpu_load']:.3f} s wall "
                    f"{row['wall_load']:.3f} s\n   ms: {row['marks']}"
                )
            print(rows[0]["profile"][:6000])
    shutil.rmtree(RR.TIER_ROOT, ignore_errors=True)


if __name__ == "__main__":
    main()


def rank_save_phases(url: str, total: int) -> list:
    """Steps 1 and 2 saved with a tier (as the benchmark does): the phases of each, with the
    milliseconds at which each was left."""
    import torch.distributed as dist

    import cloudckpt.transport as T
    from cloudckpt import CheckpointManager

    orig_exit = T.Phase.__exit__
    marks: list[str] = []
    t0 = [0.0]

    def exit_(self, *exc):
        try:
            return orig_exit(self, *exc)
        finally:
            marks.append(f"{self.what}@{(time.perf_counter() - t0[0]) * 1000:.0f}")

    T.Phase.__exit__ = exit_
    out = []
    try:
        mgr = CheckpointManager(url, local=RR._tier({"replicas": 1, "keep": 2}))
        for step in (1, 2):
            state = RR._state(total, step)
            dist.barrier()
            marks.clear()
            t0[0] = time.perf_counter()
            mgr.save(step, state)
            out.append((step, round((time.perf_counter() - t0[0]) * 1000), list(marks)))
            mgr.close()
            dist.barrier()
    finally:
        T.Phase.__exit__ = orig_exit
    return out
