"""DCP interop benchmark (issue 17): cloudckpt's DCP storage layer next to s3torchconnector's and
DCP on s3fs, with cloudckpt's own save/load, in one run against one SeaweedFS.

    python benchmarks/interop.py --quick        # ~64 MiB, about a minute
    python benchmarks/interop.py                # the issue's figures: ~512 MiB (--gib 0.5)

World 2 (two gloo processes on 127.0.0.1, cloudckpt.testing.ProcessWorld) holding about `--gib`
GiB: large and medium tensors as DTensors, Shard(0) on a 1-D mesh (~99% of the bytes, float32 and
bfloat16), 200 tiny tensors replicated on both ranks, and a few non-tensor values. Methods, all on
the one server started here (with credentials, path-style addressing):

| method             | save: `dcp.save(storage_writer=...)` | load: `dcp.load(storage_reader=...)` |
| ------------------ | ------------------------------------ | ------------------------------------ |
| `cloudckpt-dcp`    | `cloudckpt.dcp.StorageWriter`        | `cloudckpt.dcp.StorageReader`        |
| `s3torchconnector` | `S3StorageWriter`                    | `S3StorageReader`                    |
| `dcp-s3fs`         | `FsspecWriter`                       | `FsspecReader`                       |
| `cloudckpt`        | `cloudckpt.save` (not DCP)           | `cloudckpt.load` (not DCP)           |

s3torchconnector (`pip install s3torchconnector[dcp]`, the `bench` extra) reaches the server
through `AWS_ENDPOINT_URL` and the credentials in the workers' environment, with
`S3ClientConfig(force_path_style=True)`; its writer and FsspecWriter get `--dcp-threads` threads
(default 4), its reader its default (DCP-optimized ranged reads). s3fs gets the cheap request
settings of benchmarks/save_load.py. Every load is verified against the saved values.

The 64 MiB, ~600-tensor case in fresh processes (issue 27: the native API, `dcp.save` /
`dcp.load` through `cloudckpt.dcp`, raw PUT / GET; first call included) is
`benchmarks/fresh_calls.py`.

Columns: seconds (wall, slowest rank, between barriers), MB/s (state bytes / seconds), peak RSS
growth per rank (VmHWM during the step minus RSS before it, MiB, rank 0 / rank 1), client CPU
seconds per rank, the server's CPU seconds over the step (SeaweedFS is what bounds a save
here), what the method left in the bucket. Target lines (PASS/MISS): cloudckpt's DCP
layer at least as fast as s3torchconnector on save and on load, with less peak RSS growth; the
native API (`cloudckpt`) at least as fast as DCP through `cloudckpt.dcp` (issue 27).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)

METHODS = ("cloudckpt-dcp", "s3torchconnector", "dcp-s3fs", "cloudckpt")
LABEL = {
    "cloudckpt-dcp": "DCP + cloudckpt.dcp",
    "s3torchconnector": "DCP + s3torchconnector",
    "dcp-s3fs": "DCP + fsspec/s3fs",
    "cloudckpt": "cloudckpt save/load",
}


# -- the state (every process computes the same specs) --------------------------------------------


def make_specs(total_bytes: int) -> list[dict]:
    """[{name, dtype, shape, sharded, nbytes}]: 4 large (~85%) and 32 medium (~14%) sharded
    tensors with even rows, 200 tiny replicated ones."""
    size = {"float32": 4, "bfloat16": 2, "int64": 8}
    specs = []
    for i in range(4):
        dtype = ("float32", "bfloat16")[i % 2]
        rows = max(2, int(0.85 * total_bytes / 4 / (2048 * size[dtype])) // 2 * 2)
        specs.append(
            {
                "name": f"model.layers.{i}.weight",
                "dtype": dtype,
                "shape": (rows, 2048),
                "sharded": True,
            }
        )
    for j in range(32):
        dtype = ("float32", "bfloat16")[j % 2]
        rows = max(2, int(0.14 * total_bytes / 32 / (512 * size[dtype])) // 2 * 2)
        specs.append(
            {
                "name": f"model.layers.{j % 4}.mlp{j}.weight",
                "dtype": dtype,
                "shape": (rows, 512),
                "sharded": True,
            }
        )
    shapes = [(), (1,), (64,), (3, 5), (257,)]
    for k in range(200):
        specs.append(
            {
                "name": f"optim.state.p{k // 4}.t{k % 4}",
                "dtype": ("float32", "int64")[k % 2],
                "shape": shapes[k % len(shapes)],
                "sharded": False,
            }
        )
    for s in specs:
        n = 1
        for d in s["shape"]:
            n *= d
        s["nbytes"] = n * size[s["dtype"]]
    return specs


def values(blank: bool = False) -> dict:
    if blank:
        return {"step": 0, "lr": 0.0, "betas": (0.0, 0.0), "name": ""}
    return {"step": 1234, "lr": 3e-4, "betas": (0.9, 0.95), "name": "bench-run"}


# -- rank side -------------------------------------------------------------------------------------

_CTX: dict = {}


def _nest(flat: dict) -> dict:
    out: dict = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def rank_build(total_bytes: int, seed: int, info, args: dict) -> dict:
    """This rank's source state and zeroed destinations (the same DTensor layout)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    _CTX.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    src, dest, local_src, local_dest = {}, {}, {}, {}
    for i, s in enumerate(make_specs(total_bytes)):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        if s["dtype"] == "int64":
            full = torch.randint(-(1 << 40), 1 << 40, s["shape"], generator=g)
        else:
            full = torch.rand(s["shape"], generator=g).to(getattr(torch, s["dtype"]))
        if s["sharded"]:
            rows = s["shape"][0] // world
            mine = full.narrow(0, rank * rows, rows).clone()
            out = torch.zeros_like(mine)
            src[s["name"]] = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)
            dest[s["name"]] = DTensor.from_local(out, mesh, [Shard(0)], run_check=False)
        else:
            mine, out = full, torch.zeros_like(full)
            src[s["name"]], dest[s["name"]] = mine, out
        local_src[s["name"]], local_dest[s["name"]] = mine, out
        del full
    src["meta"], dest["meta"] = values(), values(blank=True)
    _CTX.update(
        rank=rank,
        info=info,
        args=args,
        src=_nest(src),
        dest=_nest(dest),
        local_src=local_src,
        local_dest=local_dest,
    )
    return {"rss": C.rss_bytes()}


def _storage():
    from cloudckpt.storage import StorageOptions

    info = _CTX["info"]
    return StorageOptions(
        endpoint_url=info.endpoint_url,
        region=info.region,
        access_key_id=info.access_key,
        secret_access_key=info.secret_key,
    )


def _s3fs_kwargs() -> dict:
    info = _CTX["info"]
    return {
        "key": info.access_key,
        "secret": info.secret_key,
        "client_kwargs": {"endpoint_url": info.endpoint_url, "region_name": info.region},
        "config_kwargs": {
            "s3": {"addressing_style": "path", "payload_signing_enabled": False},
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        },
    }


def _do(method: str, action: str, target: str) -> None:
    import torch.distributed.checkpoint as dcp

    args, save = _CTX["args"], action == "save"
    src, dest = _CTX["src"], _CTX["dest"]
    if method == "cloudckpt-dcp":
        from cloudckpt.dcp import StorageReader, StorageWriter

        if save:
            dcp.save(src, storage_writer=StorageWriter(target, _storage()))
        else:
            dcp.load(dest, storage_reader=StorageReader(target, _storage()))
    elif method == "s3torchconnector":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        config, region = S3ClientConfig(force_path_style=True), _CTX["info"].region
        if save:
            dcp.save(
                src,
                storage_writer=S3StorageWriter(
                    region, target, s3client_config=config, thread_count=args["dcp_threads"]
                ),
            )
        else:
            dcp.load(dest, storage_reader=S3StorageReader(region, target, s3client_config=config))
    elif method == "dcp-s3fs":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        if save:
            dcp.save(
                src,
                storage_writer=FsspecWriter(
                    target, thread_count=args["dcp_threads"], sync_files=False, **_s3fs_kwargs()
                ),
            )
        else:
            dcp.load(dest, storage_reader=FsspecReader(target, **_s3fs_kwargs()))
    elif method == "cloudckpt":
        import cloudckpt

        if save:
            cloudckpt.save(src, target, storage=_storage())
        else:
            cloudckpt.load(dest, target, storage=_storage())
    else:
        raise ValueError(method)


def _verify_and_reset() -> bool:
    import torch

    ok = all(
        bool(torch.equal(out, _CTX["local_src"][name])) for name, out in _CTX["local_dest"].items()
    )
    ok &= _CTX["dest"]["meta"] == values()
    for out in _CTX["local_dest"].values():
        out.zero_()
    _CTX["dest"]["meta"] = values(blank=True)
    return bool(ok)


def rank_step(method: str, action: str, target: str) -> dict:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    with C.Meter() as meter:
        _do(method, action, target)
    dist.barrier()
    m = meter.result
    out = {
        "seconds": time.perf_counter() - start,
        "cpu": m.cpu,
        "growth": m.rss_growth,
        "peak_rss": m.peak_rss,
        "hwm_reset": m.hwm_reset,
    }
    if action == "load":
        out["verified"] = _verify_and_reset()
    return out


def rank_warmup(methods, targets: dict, info, args: dict) -> None:
    """Every method once on a ~1 MiB state (imports, clients, connections), not measured."""
    import torch.distributed as dist

    saved = dict(_CTX)
    try:
        rank_build(1 << 20, 1, info, args)
        for m in methods:
            _do(m, "save", targets[m])
            dist.barrier()
            _do(m, "load", targets[m])
            dist.barrier()
    finally:
        _CTX.clear()
        _CTX.update(saved)


# -- driver ---------------------------------------------------------------------------------------


class Runner:
    def __init__(self, args, server):
        self.args, self.server, self.info = args, server, server.info
        self.results: dict = {}  # (method, action) -> [per-repeat list of rank dicts]
        self.stored: dict = {}  # method -> (bytes, objects)
        self.failures: list[str] = []
        self.targets: list = []
        self.rank_args = {"dcp_threads": args.dcp_threads}
        self.state_bytes = sum(s["nbytes"] for s in make_specs(args.total_bytes))

    def prefix(self, tag: str, method: str, rep: int) -> str:
        return f"interop/{tag}/{method}/rep{rep}"

    def target(self, tag: str, method: str, rep: int) -> str:
        return self.info.url(self.prefix(tag, method, rep))

    def step(self, world, method: str, action: str, target: str) -> bool:
        server0 = C.proc_cpu_seconds(self.server.pid)
        try:
            res = world.run(rank_step, method, action, target, timeout=self.args.timeout)
            for r in res:  # the server's CPU seconds over the step (the same on every rank)
                r["server_cpu"] = C.proc_cpu_seconds(self.server.pid) - server0
        except Exception:
            self.failures.append(f"{method} {action}:\n{traceback.format_exc()}")
            print(f"  {method:17s} {action}: FAILED", flush=True)
            return False
        self.results.setdefault((method, action), []).append(res)
        print(
            f"  {method:17s} {action}: {max(r['seconds'] for r in res):7.3f} s"
            f"  server CPU {res[0]['server_cpu']:6.2f} s"
            + ("" if action == "save" else f"  verified={all(r['verified'] for r in res)}"),
            flush=True,
        )
        return True

    def run(self) -> None:
        from cloudckpt.testing import ProcessWorld

        a = self.args
        env = self.info.env()  # s3torchconnector reads the endpoint and keys from here
        with ProcessWorld(2, timeout=a.timeout, env=env) as world:
            warm = {m: self.target("warmup", m, 0) for m in a.methods}
            world.run(rank_warmup, a.methods, warm, self.info, self.rank_args, timeout=a.timeout)
            C.s3_delete_prefix(self.info, "interop/warmup/")
            world.run(
                rank_build, a.total_bytes, a.seed, self.info, self.rank_args, timeout=a.timeout
            )
            for rep in range(a.repeat):
                order = list(a.methods) if rep % 2 == 0 else list(a.methods)[::-1]
                saved = [
                    m for m in order if self.step(world, m, "save", self.target("run", m, rep))
                ]
                for m in saved:
                    self.stored[m] = C.s3_prefix_usage(self.info, self.prefix("run", m, rep) + "/")
                for m in saved:
                    self.step(world, m, "load", self.target("run", m, rep))
                C.s3_delete_prefix(self.info, "interop/run/")
            for section in EXTRA_SECTIONS:
                section(self, world)

    # -- reporting ------------------------------------------------------------------------------

    def pick(self, method: str, action: str):
        """The repeat with the median wall time (lower median), or None."""
        runs = self.results.get((method, action))
        if not runs:
            return None
        walls = [max(r["seconds"] for r in run) for run in runs]
        return runs[sorted(range(len(runs)), key=lambda k: walls[k])[(len(runs) - 1) // 2]]

    def seconds(self, method: str, action: str):
        run = self.pick(method, action)
        return None if run is None else max(r["seconds"] for r in run)

    def paired_line(self, action: str, method: str, baseline: str) -> str:
        """Per repeat, ``method``'s seconds over ``baseline``'s in the same repeat (so that the
        server's drift over the run cancels), split by which of the two ran first."""
        mine, theirs = self.results.get((method, action), []), self.results.get((baseline, action))
        if not mine or not theirs or len(mine) != len(theirs):
            return f"{action}: paired {method} / {baseline}: n/a"
        ratios = [
            max(r["seconds"] for r in a) / max(r["seconds"] for r in b)
            for a, b in zip(mine, theirs, strict=True)
        ]
        first = self.args.methods.index(method) < self.args.methods.index(baseline)
        ahead = [x for k, x in enumerate(ratios) if (k % 2 == 0) == first]
        behind = [x for k, x in enumerate(ratios) if (k % 2 == 0) != first]
        med = lambda xs: sorted(xs)[(len(xs) - 1) // 2] if xs else float("nan")  # noqa: E731
        return (
            f"{action}: paired seconds {method} / {baseline}, per repeat: "
            + " ".join(f"{x:.2f}" for x in ratios)
            + f"; median {med(ratios):.3f} ({med(ahead):.3f} when {method} ran first, "
            f"{med(behind):.3f} when second)"
        )

    def growth_mib(self, method: str, action: str):
        run = self.pick(method, action)
        return None if run is None else max(max(r["growth"] for r in run), C.MiB) / C.MiB

    def table(self, action: str) -> str:
        t = C.Table(
            [
                "method",
                "seconds",
                "MB/s",
                "RSS growth MiB/rank",
                "CPU s/rank",
                "server CPU s",
                "stored MiB",
                "objects",
                "verified",
            ]
        )
        for m in self.args.methods:
            run = self.pick(m, action)
            if run is None:
                t.add(LABEL[m], "FAILED", *["-"] * 7)
                continue
            secs = max(r["seconds"] for r in run)
            stored, objects = self.stored.get(m, (None, None))
            t.add(
                LABEL[m],
                C.fmt_s(secs),
                C.fmt_rate(self.state_bytes, secs),
                "/".join(f"{r['growth'] / C.MiB:.0f}" for r in run),
                "/".join(f"{r['cpu']:.2f}" for r in run),
                f"{run[0]['server_cpu']:.2f}",
                C.fmt_mib(stored) if action == "save" else "",
                str(objects) if action == "save" and objects is not None else "",
                "" if action == "save" else C.human_bool(all(r["verified"] for r in run)),
            )
        return t.render()

    def report(self) -> None:
        a = self.args
        print(f"\n# interop results  ({C.describe_machine()})")
        print(
            f"state: {self.state_bytes / C.MiB:,.1f} MiB ({len(make_specs(a.total_bytes))} "
            f"tensors + values), world 2, DTensor Shard(0), repeats {a.repeat} (median shown), "
            f"DCP writer thread_count {a.dcp_threads} (s3torchconnector, fsspec)"
        )
        for action in ("save", "load"):
            print(f"\n## {action} (MB/s = state bytes / s)")
            print(self.table(action))
        ours, theirs = "cloudckpt-dcp", "s3torchconnector"
        for action in ("save", "load"):
            self.targets.append(
                C.ratio_line(
                    f"{action}: seconds cloudckpt.dcp / s3torchconnector (at least as fast)",
                    self.seconds(ours, action),
                    self.seconds(theirs, action),
                    1.0,
                )
            )
            self.targets.append(
                C.ratio_line(
                    f"{action}: peak RSS growth per rank cloudckpt.dcp / s3torchconnector "
                    "(less memory)",
                    self.growth_mib(ours, action),
                    self.growth_mib(theirs, action),
                    1.0,
                )
            )
        for action in ("save", "load"):  # issue 27: the native API at least as fast as DCP on it
            if "cloudckpt" in a.methods and ours in a.methods:
                self.targets.append(
                    C.ratio_line(
                        f"{action}: seconds cloudckpt (native) / cloudckpt.dcp (at least as fast)",
                        self.seconds("cloudckpt", action),
                        self.seconds(ours, action),
                        1.0,
                    )
                )
        print("\n## targets (measured / baseline)")
        C.print_targets(self.targets)
        print("\n## for reference (not targets)")
        for action in ("save", "load"):
            for m in ("dcp-s3fs", "cloudckpt"):
                text, _ = C.ratio_line(
                    f"{action}: seconds cloudckpt.dcp / {m}",
                    self.seconds(ours, action),
                    self.seconds(m, action),
                    1e9,
                )
                print("  " + text.split("  (target")[0])
        for action in ("save", "load"):
            print("  " + self.paired_line(action, "cloudckpt", ours))
        if any(not r["hwm_reset"] for runs in self.results.values() for run in runs for r in run):
            print("  note: /proc/self/clear_refs refused: peak RSS figures are lifetime peaks")
        if self.failures:
            print("\n## failures")
            for f in self.failures:
                print(f)


# -- extra sections ------------------------------------------------------------------------------
# Sections measured after the DCP comparison, in the same run, world and server. Each is a
# function `section(runner, world) -> None` that runs its own steps (`runner.step(world, ...)`
# with a method `_do` knows, or its own rank functions), prints its table and appends
# `C.ratio_line(...)` results to `runner.targets`. A Hugging Face section (transformers /
# safetensors checkpoints through cloudckpt, next to HF's own writer) is meant to be added here.
def hf_export_section(runner, world) -> None:
    """Hugging Face export (benchmarks/interop_hf.py): the sharded folder export, local and
    s3://, next to the old one-file export, on this run's server; one process per method."""
    from interop_hf import export_table, run_export_benchmark

    rows = run_export_benchmark(
        runner.args.total_bytes / C.GiB,
        info=runner.info,
        shard_mib=max(4, runner.args.total_bytes // C.MiB // 4),
    )
    print(export_table(rows, "HF export"))


EXTRA_SECTIONS: list = [hf_export_section]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=0.5, help="total state size in GiB (default 0.5)")
    p.add_argument("--quick", action="store_true", help="~64 MiB (development)")
    p.add_argument(
        "--repeat",
        type=int,
        default=4,
        help="repeats, the order reversed on odd ones; the lower median shown "
        "(default 4: on this server a save runs slower when another save came just "
        "before it, whichever method it is, so 2 repeats compare one method's first "
        "place with the other's second; the paired ratios say how much)",
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--dcp-threads",
        type=int,
        default=4,
        help="thread_count of S3StorageWriter and FsspecWriter (default 4)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per step")
    a = p.parse_args(argv)
    if a.quick:
        a.gib = 1 / 16
    if a.repeat < 1:
        p.error("--repeat must be >= 1")
    a.total_bytes = int(a.gib * C.GiB)
    a.methods = [m for m in a.methods.split(",") if m]
    for m in a.methods:
        if m not in METHODS:
            p.error(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    C.repo_on_path()
    server = C.start_server()
    runner = Runner(args, server)
    t0 = time.perf_counter()
    C.warm_up_server(server.info, max(64 * C.MiB, args.total_bytes // 8))
    try:
        print(f"\n== interop ({args.total_bytes / C.GiB:.3f} GiB) ==", flush=True)
        runner.run()
    except BaseException:
        traceback.print_exc()
        runner.failures.append(traceback.format_exc())
    finally:
        try:
            runner.report()
        finally:
            server.stop()
    print(f"\ntotal wall {time.perf_counter() - t0:.1f} s")
    return 1 if runner.failures else 0


if __name__ == "__main__":
    import interop  # re-import under its module name so ProcessWorld can pickle rank functions

    sys.exit(interop.main())
