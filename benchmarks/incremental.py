"""Incremental checkpoints (issue 18): what a save writes, how long it takes and what a run stores
when most of the state does not change.

    python benchmarks/incremental.py --quick        # ~64 MiB, well under a minute
    python benchmarks/incremental.py --gib 1.0      # the issue's figures

World 2 (two gloo processes, cloudckpt.testing.ProcessWorld) against one SeaweedFS started here.
The state is about `--gib` GiB of float32 tensors, each rank holding half the rows of each
(GlobalPiece): 24 "frozen" tensors (90% of the bytes: a frozen base model) and 8 "trained" ones
(10%: adapters, heads), plus a few values. Cases:

(a) fine-tuning: before each save the trained tensors change, the frozen ones do not. A full save
    (no hashes: what a non-incremental run does) is the baseline; then an incremental run: the
    first write, then `--saves - 1` saves against the newest checkpoint. Targets: every save after
    the first writes at most 12% of the state's bytes and takes at most 0.25x the full save's time.
(b) every tensor changes before each save: incremental saves (base: the previous one; the hashing
    finds nothing to skip) against full saves, interleaved `--repeat` times. Target: at most 5%
    slower (medians).
(c) storage: the incremental run of (a) (`--saves` checkpoints) against `--saves` full saves
    (the full save's stored bytes times `--saves`).
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

N_FROZEN, N_TRAINED = 24, 8
COLS = 1024
_CTX: dict = {}


def make_specs(total_bytes: int) -> list[tuple[str, int, bool]]:
    """(name, rows, frozen) of every tensor: 90% of the bytes frozen; rows even (two ranks)."""
    frozen_rows = max(2, int(0.9 * total_bytes / N_FROZEN / (COLS * 4)) // 2 * 2)
    trained_rows = max(2, int(0.1 * total_bytes / N_TRAINED / (COLS * 4)) // 2 * 2)
    return [(f"base.layer{i}.weight", frozen_rows, True) for i in range(N_FROZEN)] + [
        (f"adapter{i}.weight", trained_rows, False) for i in range(N_TRAINED)
    ]


def rank_build(total_bytes: int, info) -> dict:
    import torch
    import torch.distributed as dist

    import cloudckpt
    from cloudckpt.storage import StorageOptions

    rank, world = dist.get_rank(), dist.get_world_size()
    state, local, nbytes = {}, {}, 0
    for i, (name, rows, frozen) in enumerate(make_specs(total_bytes)):
        mine = rows // world
        t = torch.rand((mine, COLS), generator=torch.Generator().manual_seed(1000 * i + rank))
        local[name] = (t, frozen)
        state[name] = cloudckpt.GlobalPiece(t, (rows, COLS), (rank * mine, 0))
        nbytes += rows * COLS * 4
    state["meta"] = {"step": 0, "lr": 1e-4, "note": "incremental benchmark"}
    storage = StorageOptions(
        endpoint_url=info.endpoint_url,
        region=info.region,
        access_key_id=info.access_key,
        secret_access_key=info.secret_key,
    )
    _CTX.update(state=state, local=local, storage=storage, state_bytes=nbytes)
    return {"state_bytes": nbytes}


def rank_save(url: str, *, change: str, base: str | None, hashes: bool) -> dict:
    """Change the state (``"trained"``: the trained tensors; ``"all"``: every tensor), then save
    it to ``url`` (``base``: incremental; ``hashes``: record chunk hashes)."""
    import torch.distributed as dist

    import cloudckpt
    from cloudckpt import SaveOptions

    for t, frozen in _CTX["local"].values():
        if change == "all" or not frozen:
            t.add_(1.0)
    _CTX["state"]["meta"]["step"] += 1
    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    result = cloudckpt.save(
        _CTX["state"],
        url,
        storage=_CTX["storage"],
        base=base,
        options=SaveOptions(content_hashes=hashes),
    )
    seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "cpu": time.process_time() - cpu,
        "written": result.bytes_written,
        "reused": result.bytes_reused,
        "base": result.base,
    }


def rank_check(url: str) -> bool:
    """The checkpoint at ``url`` loads into exactly this rank's current tensors."""
    import torch

    import cloudckpt

    blank = {
        k: cloudckpt.GlobalPiece(torch.zeros_like(v.local), v.global_shape, v.offsets)
        for k, v in _CTX["state"].items()
        if k != "meta"
    }
    blank["meta"] = {"step": -1, "lr": 0.0, "note": ""}
    cloudckpt.load(blank, url, storage=_CTX["storage"])
    return (
        all(torch.equal(blank[k].local, v.local) for k, v in _CTX["state"].items() if k != "meta")
        and blank["meta"] == _CTX["state"]["meta"]
    )


class Bench:
    def __init__(self, args, server):
        self.args, self.server, self.info = args, server, server.info
        self.lines: list[tuple[str, bool | None]] = []
        self.table = C.Table(
            ("case", "save", "seconds", "rank cpu", "server cpu", "written", "reused", "base")
        )

    def url(self, *parts: str) -> str:
        return "s3://" + self.info.bucket + "/" + "/".join(("incremental",) + parts)

    def save(self, world, case: str, label: str, url: str, **kw) -> dict:
        server_cpu = C.proc_cpu_seconds(self.server.pid)
        res = world.run(rank_save, url, **kw, timeout=self.args.timeout)
        # CPU seconds (every rank's process, and the server's) depend far less on other load on
        # the machine than wall times do
        out = {
            "seconds": max(r["seconds"] for r in res),
            "written": res[0]["written"],
            "reused": res[0]["reused"],
            "base": res[0]["base"],
            "rank_cpu": sum(r["cpu"] for r in res),
            "server_cpu": C.proc_cpu_seconds(self.server.pid) - server_cpu,
        }
        self.table.add(
            case,
            label,
            C.fmt_s(out["seconds"]),
            C.fmt_s(out["rank_cpu"]),
            C.fmt_s(out["server_cpu"]),
            C.fmt_mib(out["written"]),
            C.fmt_mib(out["reused"]),
            out["base"] or "-",
        )
        print(
            f"  {case} {label:14s} {out['seconds']:7.2f} s  cpu ranks {out['rank_cpu']:.2f} s"
            f" server {out['server_cpu']:.2f} s  written {C.fmt_mib(out['written'])}"
            f"  reused {C.fmt_mib(out['reused'])}  base {out['base'] or '-'}",
            flush=True,
        )
        return out

    def check(self, world, url: str) -> None:
        assert all(world.run(rank_check, url, timeout=self.args.timeout)), f"{url} does not load"

    def case_a_and_c(self, world, state_bytes: int) -> None:
        a = self.args
        fulls = [
            self.save(
                world,
                "a",
                f"full {i}",
                self.url("a-full", str(i)),
                change="trained",
                base=None,
                hashes=False,
            )
            for i in range(a.repeat)
        ]
        full_s = statistics.median(f["seconds"] for f in fulls)
        full_stored, _ = C.s3_prefix_usage(self.info, "incremental/a-full/0/")
        previous = None
        incr = []
        for i in range(a.saves):
            url = self.url("a-run", f"step-{i:012d}")
            incr.append(
                self.save(
                    world, "a", f"incr {i}", url, change="trained", base=previous, hashes=True
                )
            )
            previous = url
        self.check(world, previous)
        later = incr[1:]
        worst_written = max(s["written"] for s in later)
        median_s = statistics.median(s["seconds"] for s in later)
        self.lines.append(
            C.ratio_line(
                "(a) bytes written by a save after the first / state bytes",
                worst_written,
                state_bytes,
                0.12,
                measured_name="largest",
                baseline_name="state",
            )
        )
        self.lines.append(
            C.ratio_line(
                "(a) save time after the first / full save time",
                median_s,
                full_s,
                0.25,
                measured_name="median incremental",
                baseline_name="median full",
            )
        )
        run_stored, run_objects = C.s3_prefix_usage(self.info, "incremental/a-run/")
        ratio = run_stored / (full_stored * a.saves)
        self.storage_line = (
            f"(c) stored by {a.saves} incremental saves: {C.fmt_mib(run_stored)} "
            f"({run_objects} objects) / {a.saves} full saves: "
            f"{C.fmt_mib(full_stored * a.saves)} = {ratio:.3f}"
        )
        print("  " + self.storage_line, flush=True)
        C.s3_delete_prefix(self.info, "incremental/a-")

    def case_b(self, world) -> None:
        a = self.args
        full, incr = [], []
        previous = self.url("b", "incr-first")
        self.save(world, "b", "incr first", previous, change="all", base=None, hashes=True)
        for i in range(a.repeat):
            order = ("full", "incr") if i % 2 == 0 else ("incr", "full")
            for kind in order:
                if kind == "full":
                    full.append(
                        self.save(
                            world,
                            "b",
                            f"full {i}",
                            self.url("b", f"full-{i}"),
                            change="all",
                            base=None,
                            hashes=False,
                        )
                    )
                else:
                    url = self.url("b", f"incr-{i}")
                    incr.append(
                        self.save(
                            world, "b", f"incr {i}", url, change="all", base=previous, hashes=True
                        )
                    )
                    previous = url
                    if i == a.repeat - 1:
                        self.check(world, url)  # before the next save changes the state
        assert all(s["reused"] == 0 for s in incr), "every tensor changed: nothing to reuse"
        self.lines.append(
            C.ratio_line(
                "(b) every tensor changed: incremental save time / full save time",
                statistics.median(s["seconds"] for s in incr),
                statistics.median(s["seconds"] for s in full),
                1.05,
                measured_name="median incremental",
                baseline_name="median full",
            )
        )
        fastest = min(s["seconds"] for s in incr) / min(s["seconds"] for s in full)

        def cpu(saves, key):
            return statistics.median(s[key] for s in saves)

        self.note = (
            f"(b) fastest incremental / fastest full: {fastest:.3f} (less sensitive to "
            "other load on the machine; not a target); median CPU seconds, incremental "
            f"/ full: ranks {cpu(incr, 'rank_cpu'):.2f} / {cpu(full, 'rank_cpu'):.2f}, "
            f"server {cpu(incr, 'server_cpu'):.2f} / {cpu(full, 'server_cpu'):.2f}"
        )
        print("  " + self.note, flush=True)
        C.s3_delete_prefix(self.info, "incremental/b/")

    def run(self) -> None:
        from cloudckpt.testing import ProcessWorld

        a = self.args
        with ProcessWorld(2, timeout=a.timeout) as world:
            state_bytes = world.run(rank_build, a.total_bytes, self.info)[0]["state_bytes"]
            print(
                f"state: {C.fmt_mib(state_bytes)} in {N_FROZEN + N_TRAINED} tensors, "
                f"{N_FROZEN} frozen (90%)",
                flush=True,
            )
            self.save(
                world, "-", "warm-up", self.url("warmup"), change="trained", base=None, hashes=True
            )
            C.s3_delete_prefix(self.info, "incremental/warmup")
            if "a" in a.cases:
                self.case_a_and_c(world, state_bytes)
            if "b" in a.cases:
                self.case_b(world)

    def report(self) -> None:
        print()
        print(self.table.render())
        print()
        for line in (getattr(self, "storage_line", None), getattr(self, "note", None)):
            if line:
                print("  " + line)
        C.print_targets(self.lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    p.add_argument("--quick", action="store_true", help="~64 MiB (development)")
    p.add_argument("--saves", type=int, default=10, help="saves of the incremental run (a, c)")
    p.add_argument("--repeat", type=int, default=3, help="full saves (a); pairs (b)")
    p.add_argument("--cases", default="a,b", help="a (with c), b")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per step")
    a = p.parse_args(argv)
    if a.quick:
        a.gib = 1 / 16
    if a.saves < 2 or a.repeat < 1:
        p.error("--saves must be >= 2 and --repeat >= 1")
    a.total_bytes = int(a.gib * C.GiB)
    a.cases = [c for c in a.cases.split(",") if c]
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    C.repo_on_path()
    server = C.start_server()
    bench = Bench(args, server)
    t0 = time.perf_counter()
    failed = False
    try:
        C.warm_up_server(server.info, max(64 * C.MiB, args.total_bytes // 8))
        bench.run()
    except BaseException:
        traceback.print_exc()
        failed = True
    finally:
        try:
            bench.report()
        finally:
            server.stop()
    print(f"\ntotal wall {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    import incremental  # re-import under its module name so ProcessWorld can pickle rank functions

    sys.exit(incremental.main())
