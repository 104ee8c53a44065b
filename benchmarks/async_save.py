"""Async save benchmark (issue 6): how long training is blocked by ``cloudckpt.async_save``.

    python benchmarks/async_save.py --quick         # ~64 MiB, well under a minute
    python benchmarks/async_save.py --gib 1.0       # the issue's figures

World 2 (gloo on 127.0.0.1), the state of benchmarks/save_load.py (default: the sharded case,
each rank holding about half of `--gib` GiB). One SeaweedFS with credentials, started here.
Per rank, after an unmeasured warm-up (a sync and an async save of a ~1 MiB state, so the
first measured save pays no imports or connection setup), in this order:
1. `clone()` of every local tensor, `--clones` times (fresh allocations each time, like a
   training step that snapshots its state), and `copy_()` into existing buffers (reference only);
2. the first `async_save` (staging buffers allocated), waited for to completion;
3. `--repeat` more async saves (buffers reused: the steady state), each waited for;
4. `--repeat` synchronous `cloudckpt.save` of the same state.
Blocked time is `SaveHandle.blocked_seconds` (and the wall time around the call, printed too).
Targets (steady state): blocked <= 1.2x clone, and >= 10x less than the synchronous save.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402
import save_load as SL  # noqa: E402  (state specs and builder shared with the save/load benchmark)

# -- rank side -------------------------------------------------------------------------------------


def _tensors():
    return list(SL._CTX["local_src"].values())


def rank_clone(clones: int) -> dict:
    """Time `clone()` of every local tensor (fresh memory each time) and `copy_` into buffers."""
    import torch.distributed as dist

    out = {"clone": [], "clone_growth": [], "clone_cpu": []}
    for _ in range(clones):
        dist.barrier()
        with C.Meter() as m:
            copies = [t.clone() for t in _tensors()]
        out["clone"].append(m.result.seconds)
        out["clone_growth"].append(m.result.rss_growth)
        out["clone_cpu"].append(m.result.cpu)
        del copies
    buffers = [t.clone() for t in _tensors()]
    dist.barrier()
    with C.Meter() as m:
        for b, t in zip(buffers, _tensors()):
            b.copy_(t)
    out["copy_into"] = m.result.seconds
    out["bytes"] = sum(t.numel() * t.element_size() for t in _tensors())
    del buffers
    return out


def rank_async(url: str) -> dict:
    """One async save: time blocked in the call, then time until the save is complete."""
    import torch.distributed as dist

    import cloudckpt

    storage = SL._storage_options()
    dist.barrier()
    with C.Meter() as call:
        handle = cloudckpt.async_save(SL._CTX["src"], url, storage=storage)
    with C.Meter() as rest:
        result = handle.result()
    dist.barrier()
    return {
        "blocked": handle.blocked_seconds,
        "call_wall": call.result.seconds,
        "call_cpu": call.result.cpu,
        "call_growth": call.result.rss_growth,
        "call_peak": call.result.peak_rss,
        "background": rest.result.seconds,
        "bg_growth": rest.result.rss_growth,
        "bg_peak": rest.result.peak_rss,
        "total": call.result.seconds + rest.result.seconds,
        "allocations": handle.staging_allocations,
        "bytes_written": result.bytes_written,
        "objects": result.objects,
        "rss_after": C.rss_bytes(),
    }


def rank_sync(url: str) -> dict:
    import torch.distributed as dist

    import cloudckpt

    storage = SL._storage_options()
    dist.barrier()
    with C.Meter() as m:
        result = cloudckpt.save(SL._CTX["src"], url, storage=storage)
    dist.barrier()
    return {
        "seconds": m.result.seconds,
        "cpu": m.result.cpu,
        "growth": m.result.rss_growth,
        "peak": m.result.peak_rss,
        "bytes_written": result.bytes_written,
    }


# -- driver ---------------------------------------------------------------------------------------


def _max(runs, key):
    return max(r[key] for r in runs)


def _med(values):
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=1.0, help="total state size in GiB (default 1.0)")
    p.add_argument("--quick", action="store_true", help="~64 MiB (development)")
    p.add_argument("--case", default="sharded", choices=("sharded", "replicated"))
    p.add_argument("--repeat", type=int, default=2, help="steady-state async saves and sync saves")
    p.add_argument("--clones", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    if a.quick:
        a.gib = 1 / 16
    total = int(a.gib * C.GiB)
    C.repo_on_path()
    from cloudckpt.testing import ProcessWorld, RankFailedError, WorldTimeoutError

    server = C.start_server()
    info = server.info
    failures: list[str] = []
    clone = first = None
    steady: list = []
    syncs: list = []
    t0 = time.perf_counter()
    try:
        C.warm_up_server(info, max(64 * C.MiB, total // 8))
        rank_args = {"dcp_threads": 1, "raw_concurrency": 16, "raw_object_mib": 16, "fsync": False}
        with ProcessWorld(2, timeout=a.timeout) as world:
            # warm-up (not measured): imports, S3 client and connections, on a ~1 MiB state
            world.run(SL.rank_build, a.case, 1 << 20, a.seed, info, rank_args, with_dest=False)
            world.run(rank_sync, info.url("warmup/sync"))
            world.run(rank_async, info.url("warmup/async"))
            world.run(SL.rank_build, a.case, total, a.seed, info, rank_args, with_dest=False)
            clone = world.run(rank_clone, a.clones)
            print(f"  clone: {[f'{x:.3f}' for x in clone[0]['clone']]} s (rank 0)", flush=True)
            first = world.run(rank_async, info.url("async/first"))
            print(
                f"  async #1: blocked {_max(first, 'blocked'):.3f} s, "
                f"total {_max(first, 'total'):.3f} s",
                flush=True,
            )
            for k in range(a.repeat):
                steady.append(world.run(rank_async, info.url(f"async/steady{k}")))
                print(
                    f"  async #{k + 2}: blocked {_max(steady[-1], 'blocked'):.3f} s, "
                    f"total {_max(steady[-1], 'total'):.3f} s",
                    flush=True,
                )
            for k in range(a.repeat):
                syncs.append(world.run(rank_sync, info.url(f"sync/s{k}")))
                print(f"  sync save: {_max(syncs[-1], 'seconds'):.3f} s", flush=True)
    except (RankFailedError, WorldTimeoutError) as exc:
        detail = getattr(exc, "failures", None) or getattr(exc, "stacks", {})
        failures.append(
            f"{exc}\n" + "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(detail.items()))
        )
    except BaseException:
        failures.append(traceback.format_exc())
    finally:
        server.stop()

    state = sum(s["nbytes"] for s in SL.make_specs(total))
    print(f"\n# async_save results  ({C.describe_machine()})")
    print(
        f"state: {state / C.MiB:,.1f} MiB in total, case {a.case}, world 2; per-rank figures "
        f"as rank0/rank1; times are the max over ranks"
    )
    if clone:
        print(f"local tensor bytes per rank: {'/'.join(C.fmt_mib(r['bytes']) for r in clone)} MiB")
    t = C.Table(
        [
            "step",
            "blocked s",
            "call wall s",
            "total s",
            "call CPU s",
            "RSS growth in call MiB",
            "RSS growth after MiB",
            "peak RSS MiB",
            "staging allocs",
        ]
    )
    clone_s = _med([max(c["clone"][i] for c in clone) for i in range(a.clones)]) if clone else None
    if clone:
        t.add(
            f"clone() x{a.clones} (median)",
            "",
            C.fmt_s(clone_s),
            "",
            "/".join(f"{_med(c['clone_cpu']):.2f}" for c in clone),
            "/".join(f"{max(c['clone_growth']) / C.MiB:.0f}" for c in clone),
            "",
            "",
            "",
        )
        t.add(
            "copy_() into existing buffers",
            "",
            C.fmt_s(_max(clone, "copy_into")),
            "",
            "",
            "",
            "",
            "",
            "",
        )

    def async_row(label, runs):
        t.add(
            label,
            C.fmt_s(_max(runs, "blocked")),
            C.fmt_s(_max(runs, "call_wall")),
            C.fmt_s(_max(runs, "total")),
            "/".join(f"{r['call_cpu']:.2f}" for r in runs),
            "/".join(f"{r['call_growth'] / C.MiB:.0f}" for r in runs),
            "/".join(f"{r['bg_growth'] / C.MiB:.0f}" for r in runs),
            "/".join(f"{max(r['call_peak'], r['bg_peak']) / C.MiB:.0f}" for r in runs),
            "/".join(str(r["allocations"]) for r in runs),
        )

    if first:
        async_row("async_save #1 (first)", first)
    for k, runs in enumerate(steady):
        async_row(f"async_save #{k + 2} (steady)", runs)
    for k, runs in enumerate(syncs):
        t.add(
            f"cloudckpt.save (sync) #{k + 1}",
            "",
            C.fmt_s(_max(runs, "seconds")),
            C.fmt_s(_max(runs, "seconds")),
            "/".join(f"{r['cpu']:.2f}" for r in runs),
            "/".join(f"{r['growth'] / C.MiB:.0f}" for r in runs),
            "",
            "/".join(f"{r['peak'] / C.MiB:.0f}" for r in runs),
            "",
        )
    print(t.render())

    # what training experiences: the larger of blocked_seconds and the wall time around the call
    def blocked(runs):
        return max(_max(runs, "blocked"), _max(runs, "call_wall"))

    blocked_steady = _med([blocked(r) for r in steady]) if steady else None
    sync_s = _med([_max(r, "seconds") for r in syncs]) if syncs else None
    blocked_first = blocked(first) if first else None
    print(
        "\n## targets (measured / baseline; blocked = max(blocked_seconds, call wall), "
        "steady = median of the steady saves)"
    )
    lines = [
        C.ratio_line("steady async blocked / clone", blocked_steady, clone_s, 1.2),
        C.ratio_line("steady async blocked / sync save (>=10x less)", blocked_steady, sync_s, 0.1),
        C.ratio_line("first async blocked / clone (informational)", blocked_first, clone_s, 1.2),
        C.ratio_line("first async blocked / sync save (informational)", blocked_first, sync_s, 0.1),
    ]
    C.print_targets(lines)
    if failures:
        print("\n## failures")
        for f in failures:
            print(f)
    print(f"\ntotal wall {time.perf_counter() - t0:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    import async_save  # re-import under its module name so ProcessWorld can pickle rank functions

    sys.exit(async_save.main())
