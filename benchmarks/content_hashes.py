"""What recording content hashes on every save costs (issue 27): `cloudckpt.save` with
`SaveOptions(content_hashes=False)` against `content_hashes=True` (the default since this
benchmark's PASS: both are set explicitly, so the comparison means the same whatever the
default), no base, world 2. A hashed save without a base runs the same phases and collectives
as one without hashes; what it adds is the hashing pass and 8 bytes a chunk in the manifest.

    python benchmarks/content_hashes.py --quick         # 64 MiB, a few minutes
    python benchmarks/content_hashes.py                 # 1 GiB and 64 MiB, the issue's figures

Two gloo processes (`cloudckpt.testing.ProcessWorld`) hold save_load.py's sharded state (4 large
tensors, 48 medium, 400 tiny, a few values) of each `--mib` size; one SeaweedFS started here.
For each size, `--repeat` pairs of saves, the order within a pair alternating (off, on / on, off),
each to a fresh prefix, after one unmeasured save of each kind (imports, client, the plan cache).
Per save: wall seconds from a barrier before the call to the slowest rank's return, the ranks'
CPU seconds (every thread: the hashing runs in worker threads) and the server's.

Target (PASS/MISS): median seconds with hashes / median without <= 1.03 (at most 3% more), per
size. The CPU lines say what the hashing itself costs (ranks' CPU seconds with - without, per GiB
of state), which is steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)
import save_load as SL  # noqa: E402

LIMIT = 1.03


def rank_save(url: str, hashes: bool) -> dict:
    import torch.distributed as dist

    import cloudckpt

    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    result = cloudckpt.save(
        SL._CTX["src"],
        url,
        storage=SL._storage_options(),
        options=cloudckpt.SaveOptions(content_hashes=hashes),
    )
    return {
        "seconds": time.perf_counter() - started,
        "cpu": time.process_time() - cpu,
        "written": result.bytes_written,
    }


def measure(args, server) -> list[tuple[str, bool | None]]:
    from cloudckpt.testing import ProcessWorld

    info, lines = server.info, []
    rank_args = {
        "dcp_threads": 1,
        "raw_concurrency": 16,
        "raw_object_mib": 16,
        "fsync": False,
        "no_plan_cache": False,
    }
    table = C.Table(("state", "hashes", "median s", "min s", "max s", "rank CPU s", "server CPU s"))
    with ProcessWorld(2, timeout=args.timeout) as world:
        for mib in args.mib:
            total = int(mib * C.MiB)
            world.run(SL.rank_build, "sharded", total, 0, info, rank_args, None, False)
            state = sum(s["nbytes"] for s in SL.make_specs(total))
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for rep in range(-1, args.repeat):
                for hashes in (False, True) if rep % 2 == 0 else (True, False):
                    prefix = f"hashes/{mib:g}/{'on' if hashes else 'off'}-{rep + 1}"
                    cpu0 = C.proc_cpu_seconds(server.pid)
                    res = world.run(
                        rank_save, f"s3://{info.bucket}/{prefix}", hashes, timeout=args.timeout
                    )
                    rec = {
                        "seconds": max(r["seconds"] for r in res),
                        "cpu": sum(r["cpu"] for r in res),
                        "server": C.proc_cpu_seconds(server.pid) - cpu0,
                    }
                    C.s3_delete_prefix(info, prefix + "/")
                    if rep >= 0:  # rep -1: the unmeasured first save of each kind
                        runs[hashes].append(rec)
                    print(
                        f"  {mib:g} MiB hashes={hashes!s:5} rep {rep + 1}: {rec['seconds']:.3f} s,"
                        f" ranks CPU {rec['cpu']:.2f} s, server CPU {rec['server']:.2f} s",
                        flush=True,
                    )
            med = {}
            for hashes, recs in runs.items():
                secs = [r["seconds"] for r in recs]
                med[hashes] = {
                    k: statistics.median(r[k] for r in recs) for k in ("seconds", "cpu", "server")
                }
                table.add(
                    C.fmt_mib(state),
                    "on" if hashes else "off",
                    C.fmt_s(med[hashes]["seconds"]),
                    C.fmt_s(min(secs)),
                    C.fmt_s(max(secs)),
                    C.fmt_s(med[hashes]["cpu"]),
                    C.fmt_s(med[hashes]["server"]),
                )
            extra = med[True]["cpu"] - med[False]["cpu"]
            lines.append(
                C.ratio_line(
                    f"{C.fmt_mib(state)} save with content hashes (default) / without (median of "
                    f"{args.repeat}; ranks' CPU +{extra:.3f} s = {extra / (state / C.GiB):.2f} s "
                    f"per GiB)",
                    med[True]["seconds"],
                    med[False]["seconds"],
                    LIMIT,
                )
            )
    print()
    print(table.render())
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mib", default="1024,64", help="state sizes in MiB (comma separated)")
    p.add_argument("--repeat", type=int, default=4, help="pairs of saves per size")
    p.add_argument("--quick", action="store_true", help="64 MiB only, 2 pairs")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per step")
    a = p.parse_args(argv)
    if a.quick:
        a.mib, a.repeat = "64", 2
    a.mib = [float(m) for m in a.mib.split(",") if m]
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    C.repo_on_path()
    server = C.start_server()
    t0 = time.perf_counter()
    lines: list = []
    failed = False
    try:
        C.warm_up_server(server.info)
        lines = measure(args, server)
    except BaseException:
        traceback.print_exc()
        failed = True
    finally:
        server.stop()
    print(f"\n# content hashes ({C.describe_machine()}; load average {os.getloadavg()[0]:.1f})")
    C.print_targets(lines)
    print(f"\ntotal wall {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    import content_hashes  # re-import under its module name so ProcessWorld can pickle functions

    sys.exit(content_hashes.main())
