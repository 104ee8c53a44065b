"""End-to-end save/load benchmark (issue 5): cloudckpt against torch DCP and raw S3 transfers.

    python benchmarks/save_load.py --quick          # ~64 MiB, well under a minute
    python benchmarks/save_load.py --gib 1.0        # the issue's figures

World 2 (two gloo processes on 127.0.0.1, cloudckpt.testing.ProcessWorld) holding about `--gib`
GiB of large, medium and tiny tensors plus non-tensor values, in two cases:
- sharded: large and medium tensors are DTensors, Shard(0) on a 1-D mesh; tiny ones replicated;
- replicated: DDP-like, both ranks hold identical full tensors.
Methods, all in one run against one SeaweedFS (started here, with credentials):
- cloudckpt on s3:// and on file://;
- torch DCP with FsspecWriter/FsspecReader on s3fs, and FileSystemWriter/Reader on local disk;
- raw aiobotocore PUT/GET of the same bytes (16 requests in flight, 16 MiB objects).
Then the sharded world-2 checkpoints are loaded by a world of 1 (full tensors).
Every load is verified against the saved values. See benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)

METHODS = ("cloudckpt-s3", "dcp-s3", "raw-s3", "cloudckpt-file", "dcp-file")
LABEL = {
    "cloudckpt-s3": "cloudckpt s3://",
    "dcp-s3": "DCP fsspec+s3fs",
    "raw-s3": "raw aiobotocore",
    "cloudckpt-file": "cloudckpt file://",
    "dcp-file": "DCP FileSystem",
}
RSS_BUDGET = 256 * C.MiB


# -- the state (pure: every process computes the same specs) -------------------------------------


def make_specs(total_bytes: int) -> list[dict]:
    """[{name, dtype, shape, kind}] with ~85% of the bytes in 4 large tensors, ~14% in 48 medium
    ones and 400 tiny ones (0-d to 1024 elements). Rows of large/medium are even (world 2)."""
    sizes = {"float32": 4, "bfloat16": 2, "int64": 8, "bool": 1}
    specs = []

    def rows_for(nbytes, cols, dtype):
        return max(2, int(nbytes / (cols * sizes[dtype])) // 2 * 2)

    for i in range(4):
        dtype = ("float32", "bfloat16")[i % 2]
        specs.append(
            {
                "name": f"model.block{i}.weight",
                "dtype": dtype,
                "kind": "large",
                "shape": (rows_for(0.85 * total_bytes / 4, 2048, dtype), 2048),
            }
        )
    for j in range(48):
        dtype = ("float32", "bfloat16")[j % 2]
        specs.append(
            {
                "name": f"model.block{j % 4}.mlp{j}.weight",
                "dtype": dtype,
                "kind": "medium",
                "shape": (rows_for(0.14 * total_bytes / 48, 512, dtype), 512),
            }
        )
    shapes = [(), (1,), (7,), (64,), (3, 5), (257,), (1024,)]
    dtypes = ("float32", "int64", "bool", "bfloat16")
    for k in range(400):
        specs.append(
            {
                "name": f"optim.state.p{k // 8}.t{k % 8}",
                "dtype": dtypes[k % 4],
                "kind": "tiny",
                "shape": shapes[k % len(shapes)],
            }
        )
    for s in specs:
        n = 1
        for d in s["shape"]:
            n *= d
        s["nbytes"] = n * sizes[s["dtype"]]
    return specs


def meta_values(blank: bool = False) -> dict:
    if blank:
        return {
            "step": 0,
            "lr": 0.0,
            "name": "",
            "betas": [0.0, 0.0],
            "flags": {"amp": False, "note": 0},
        }
    return {
        "step": 1234,
        "lr": 3e-4,
        "name": "bench-run",
        "betas": [0.9, 0.95],
        "flags": {"amp": True, "note": None},
    }


def raw_layout(specs, case: str, world: int = 2):
    """Raw baseline layout: per writer rank, its items in stream order. An item is
    (name, shard or None, nbytes, offset in the full tensor, holders). Replicated items go to the
    holder with the fewest bytes so far (heaviest first), and first in each stream."""
    items = []
    for s in specs:
        if case == "sharded" and s["kind"] != "tiny":
            part = s["nbytes"] // world
            items += [(s["name"], k, part, k * part, (k,)) for k in range(world)]
        else:
            items.append((s["name"], None, s["nbytes"], 0, tuple(range(world))))
    load = [0] * world
    streams: list[list] = [[] for _ in range(world)]
    for it in sorted(items, key=lambda it: (len(it[4]) == 1, -it[2])):
        w = it[4][0] if len(it[4]) == 1 else min(it[4], key=lambda r: (load[r], r))
        load[w] += it[2]
        streams[w].append(it)
    return streams


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


def _full_tensor(spec, seed: int, index: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    shape, dtype = spec["shape"], spec["dtype"]
    if dtype == "int64":
        return torch.randint(-(1 << 40), 1 << 40, shape, generator=g, dtype=torch.int64)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.rand(shape, generator=g, dtype=torch.float32).to(getattr(torch, dtype))


def rank_build(
    case: str,
    total_bytes: int,
    seed: int,
    info,
    args: dict,
    layout_case: str | None = None,
    with_dest: bool = True,
) -> dict:
    """Build this rank's source and (zeroed) destination state; world 1 builds full tensors.
    `layout_case`: the case whose raw layout (world 2) this process reads (default `case`);
    `with_dest=False` skips the destinations (save-only benchmarks)."""
    import torch
    import torch.distributed as dist

    _CTX.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    specs = make_specs(total_bytes)
    mesh = None
    if world > 1 and case == "sharded":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    src, dest, local_src, local_dest = {}, {}, {}, {}
    for i, s in enumerate(specs):
        full = _full_tensor(s, seed, i)
        if mesh is not None and s["kind"] != "tiny":
            from torch.distributed.tensor import DTensor, Shard

            rows = s["shape"][0] // world
            mine = full.narrow(0, rank * rows, rows).clone()
            out = torch.zeros_like(mine) if with_dest else None
            src[s["name"]] = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)
            if with_dest:
                dest[s["name"]] = DTensor.from_local(out, mesh, [Shard(0)], run_check=False)
        else:
            mine, out = full, (torch.zeros_like(full) if with_dest else None)
            src[s["name"]], dest[s["name"]] = mine, out
        local_src[s["name"]] = mine
        if with_dest:
            local_dest[s["name"]] = out
        del full
    src["meta"], dest["meta"] = meta_values(), meta_values(blank=True)
    _CTX.update(
        case=case,
        specs=specs,
        rank=rank,
        world=world,
        info=info,
        args=args,
        src=_nest(src),
        dest=_nest(dest),
        local_src=local_src,
        local_dest=local_dest,
        streams=raw_layout(specs, layout_case or case, 2),
        scratch=bytearray(args["raw_object_mib"] * C.MiB),
    )
    return {"rss": C.rss_bytes()}


def _item_view(tensors: dict, item):
    """uint8 view of an item in this process's tensors, or None if this process lacks it."""
    name, shard, nbytes, offset, holders = item
    world, rank = _CTX["world"], _CTX["rank"]
    view = C.tensor_bytes_view(tensors[name])
    if shard is None:
        return view
    if world == 1:
        return view[offset : offset + nbytes]
    return view if shard == rank else None


def _raw_objects(prefix: str, for_put: bool) -> list:
    """The raw objects this rank PUTs (its own stream) or GETs (every object holding an item it
    needs; parts it does not need land in a scratch buffer). Each stream is cut into objects of
    `raw_object_mib`; replicated items and single-holder items never share an object."""
    tensors = _CTX["local_src"] if for_put else _CTX["local_dest"]
    objects = []
    for writer, stream in enumerate(_CTX["streams"]):
        if for_put and writer != _CTX["rank"]:
            continue
        groups = [
            [(_item_view(tensors, it), it[2]) for it in stream if (len(it[4]) > 1) == shared]
            for shared in (True, False)
        ]
        objects += C.cut_objects(
            f"{prefix}r{writer}-",
            groups,
            _CTX["args"]["raw_object_mib"] * C.MiB,
            memoryview(_CTX["scratch"]),
        )
    return objects


def _storage_options():
    from cloudckpt.storage import StorageOptions

    info = _CTX["info"]
    return StorageOptions(
        endpoint_url=info.endpoint_url,
        region=info.region,
        access_key_id=info.access_key,
        secret_access_key=info.secret_key,
    )


def _s3fs_kwargs() -> dict:
    """s3fs settings for DCP: same endpoint and keys, path style, and the same cheap request
    settings cloudckpt and the raw baseline use (no checksum computed on every body)."""
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


def _do(method: str, action: str, target: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import cloudckpt

    args, extra = _CTX["args"], {}
    if method.startswith("cloudckpt"):
        storage = _storage_options() if method == "cloudckpt-s3" else None
        if action == "save":
            options = cloudckpt.SaveOptions(use_plan_cache=not args["no_plan_cache"])
            r = cloudckpt.save(_CTX["src"], target, storage=storage, options=options)
            extra = {"reported_bytes": r.bytes_written, "reported_objects": r.objects}
        else:
            r = cloudckpt.load(_CTX["dest"], target, storage=storage)
            extra = {"fetched": r.bytes_fetched, "received": r.bytes_received}
    elif method == "dcp-s3":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        if action == "save":
            dcp.save(
                _CTX["src"],
                storage_writer=FsspecWriter(
                    target, thread_count=args["dcp_threads"], sync_files=False, **_s3fs_kwargs()
                ),
            )
        else:
            dcp.load(_CTX["dest"], storage_reader=FsspecReader(target, **_s3fs_kwargs()))
    elif method == "dcp-file":
        if action == "save":
            dcp.save(
                _CTX["src"],
                storage_writer=dcp.FileSystemWriter(
                    target, thread_count=args["dcp_threads"], sync_files=args["fsync"]
                ),
            )
        else:
            dcp.load(_CTX["dest"], storage_reader=dcp.FileSystemReader(target))
    elif method == "raw-s3":
        info = _CTX["info"]
        if action == "save":
            objects = _raw_objects(target, True)
            C.raw_put(info, objects, concurrency=args["raw_concurrency"])
            extra = {"requests": len(objects)}
        else:
            objects = _raw_objects(target, False)
            extra = {
                "fetched": C.raw_get(info, objects, concurrency=args["raw_concurrency"]),
                "requests": len(objects),
            }
    else:
        raise ValueError(method)
    return extra


def _verify_and_reset(values: bool) -> bool:
    """Destinations equal the sources (and the non-tensor values were restored, unless the method
    moves tensor bytes only); then zero them for the next load."""
    import torch

    ok = True
    for name, out in _CTX["local_dest"].items():
        ok &= bool(torch.equal(out, _CTX["local_src"][name]))
        out.zero_()
    if values:
        ok &= _CTX["dest"]["meta"] == meta_values()
    _CTX["dest"]["meta"] = meta_values(blank=True)
    return bool(ok)


def rank_step(method: str, action: str, target: str) -> dict:
    """One measured save or load on this rank, bracketed by barriers."""
    import torch.distributed as dist

    stats = None
    if method.startswith("cloudckpt"):  # the counters of the store cloudckpt will use, if shared
        from cloudckpt.runtime.loop import shared_store

        storage = _storage_options() if method == "cloudckpt-s3" else None
        stats = shared_store(target, storage).stats
        if shared_store(target, storage).stats is not stats:
            stats = None  # a store opened per call (file://): its counters are not reachable
        else:
            requests0 = stats.total_requests
    dist.barrier()
    start = time.perf_counter()
    with C.Meter() as meter:
        extra = _do(method, action, target)
    dist.barrier()
    m = meter.result
    if stats is not None:
        extra["requests"] = stats.total_requests - requests0
    out = {
        "seconds": time.perf_counter() - start,
        "local_seconds": m.seconds,
        "cpu": m.cpu,
        "rss_before": m.rss_before,
        "peak_rss": m.peak_rss,
        "growth": m.rss_growth,
        "hwm_reset": m.hwm_reset,
        **extra,
    }
    if action == "load":
        out["verified"] = _verify_and_reset(values=method != "raw-s3")
    return out


def rank_warmup(methods, targets: dict, case: str, info, args: dict) -> None:
    """Run every method once on a ~1 MiB state of the same kind (not measured), so that no
    measured step pays for first imports, client creation or connection setup in a fresh process."""
    import torch.distributed as dist

    saved = dict(_CTX)
    try:
        rank_build(case, 1 << 20, 1, info, args)
        for m in methods:
            _do(m, "save", targets[m])
            dist.barrier()
            if not (m == "raw-s3" and _CTX["world"] == 1):  # world 1 writes half the raw layout
                _do(m, "load", targets[m])
            dist.barrier()
    finally:
        _CTX.clear()
        _CTX.update(saved)


def rank_world1_expected(total_bytes: int, seed: int, info, args: dict) -> dict:
    """World 1: full source tensors (the expected values) and zeroed full destinations, reading
    the sharded world-2 checkpoints."""
    return rank_build("replicated", total_bytes, seed, info, args, layout_case="sharded")


# -- driver ---------------------------------------------------------------------------------------


def method_order(methods, rep: int) -> list[str]:
    """S3 methods first, then file:// ones, each group reversed on odd repeats: every method of a
    group takes each position in turn, in particular the first file:// step after the S3 saves
    (the machine is slowest to write files right after the server wrote its volumes)."""
    s3 = [m for m in methods if not m.endswith("file")]
    files = [m for m in methods if m.endswith("file")]
    if rep % 2:
        s3, files = s3[::-1], files[::-1]
    return s3 + files


class Runner:
    def __init__(self, args, server):
        self.args, self.server, self.info = args, server, server.info
        self.results: dict = {}  # (phase, method, action) -> [per-repeat list of rank dicts]
        self.server_cpu: dict = {}
        self.failures: list[str] = []
        self.workdir = tempfile.mkdtemp(prefix="cloudckpt-bench-", dir=args.workdir)
        self.rank_args = {
            "dcp_threads": args.dcp_threads,
            "raw_concurrency": args.raw_concurrency,
            "raw_object_mib": args.raw_object_mib,
            "fsync": False,
            "no_plan_cache": args.no_plan_cache,
        }

    def target(self, case: str, method: str, rep: int) -> str:
        tag = f"{case}/{method}/rep{rep}"
        if method.endswith("file"):
            return (
                f"file://{self.workdir}/{tag}"
                if method.startswith("cloudckpt")
                else f"{self.workdir}/{tag}"
            )
        if method == "raw-s3":
            return f"{tag}/"
        return f"s3://{self.info.bucket}/{tag}"

    def stored(self, case: str, method: str, rep: int) -> tuple[int, int]:
        t = self.target(case, method, rep)
        if method.endswith("file"):
            return C.dir_usage(t.removeprefix("file://"))
        key = t.removeprefix(f"s3://{self.info.bucket}/")
        return C.s3_prefix_usage(self.info, key.rstrip("/") + "/")

    def cleanup(self, case: str, rep: int) -> None:
        for method in METHODS:
            t = self.target(case, method, rep)
            if method.endswith("file"):
                C.remove_dir(t.removeprefix("file://"))
            else:
                C.s3_delete_prefix(
                    self.info, t.removeprefix(f"s3://{self.info.bucket}/").rstrip("/") + "/"
                )

    def step(self, world, build, phase: str, method: str, action: str, target: str) -> bool:
        from cloudckpt.testing import RankFailedError, WorldTimeoutError

        # write back what earlier steps left dirty (the server's volumes, other files), so that a
        # step is not throttled by its predecessor's writeback (no method fsyncs by itself)
        os.sync()
        cpu0 = C.proc_cpu_seconds(self.server.pid)
        try:
            res = world.run(rank_step, method, action, target, timeout=self.args.timeout)
        except (RankFailedError, WorldTimeoutError) as exc:
            detail = getattr(exc, "failures", None) or getattr(exc, "stacks", {})
            text = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(detail.items()))
            self.failures.append(f"[{phase}] {method} {action} {target}: {exc}\n{text}")
            print(f"  {phase:10s} {method:15s} {action}: FAILED ({type(exc).__name__})", flush=True)
            world.run(*build)  # the world was restarted: rebuild the state
            return False
        self.server_cpu.setdefault((phase, method, action), []).append(
            C.proc_cpu_seconds(self.server.pid) - cpu0
        )
        self.results.setdefault((phase, method, action), []).append(res)
        print(
            f"  {phase:10s} {method:15s} {action}: {max(r['seconds'] for r in res):7.3f} s"
            + ("" if action == "save" else f"  verified={all(r['verified'] for r in res)}"),
            flush=True,
        )
        return True

    def warm_up(self, world, case: str, tag: str) -> None:
        targets = {m: self.target(f"warmup-{tag}", m, 0) for m in self.args.methods}
        world.run(
            rank_warmup,
            self.args.methods,
            targets,
            case,
            self.info,
            self.rank_args,
            timeout=self.args.timeout,
        )
        self.cleanup(f"warmup-{tag}", 0)

    def run_case(self, case: str) -> None:
        from cloudckpt.testing import ProcessWorld

        a = self.args
        build = (rank_build, case, a.total_bytes, a.seed, self.info, self.rank_args)
        with ProcessWorld(2, timeout=a.timeout) as world:
            self.warm_up(world, case, case)
            world.run(*build)
            for rep in range(a.repeat):
                order = method_order(a.methods, rep)
                saved = set()
                for action in ("save", "load"):
                    for m in order:
                        if action == "load" and m not in saved:
                            print(
                                f"  {case:10s} {m:15s} load: skipped (its save failed)", flush=True
                            )
                            continue
                        ok = self.step(world, build, case, m, action, self.target(case, m, rep))
                        if ok and action == "save":
                            saved.add(m)
                            self.results[(case, m, "save")][-1][0]["stored"] = self.stored(
                                case, m, rep
                            )
                if rep + 1 < a.repeat:
                    self.cleanup(case, rep)
        if case == "sharded" and not a.no_world1:
            build1 = (rank_world1_expected, a.total_bytes, a.seed, self.info, self.rank_args)
            with ProcessWorld(1, timeout=a.timeout) as w1:
                self.warm_up(w1, "replicated", "world1")
                w1.run(*build1)
                for rep in range(a.repeat):
                    order = method_order(a.methods, rep)
                    for m in order:
                        if m in saved:
                            self.step(
                                w1, build1, "world1", m, "load", self.target(case, m, a.repeat - 1)
                            )
        for rep in range(a.repeat):
            self.cleanup(case, rep)

    # -- reporting ----------------------------------------------------------------------------

    def pick(self, phase, method, action):
        """The repeat with the median wall time (lower median): (rank dicts, server cpu)."""
        runs = self.results.get((phase, method, action))
        if not runs:
            return None, None
        walls = [max(r["seconds"] for r in run) for run in runs]
        i = sorted(range(len(runs)), key=lambda k: walls[k])[(len(runs) - 1) // 2]
        return runs[i], self.server_cpu[(phase, method, action)][i]

    def seconds(self, phase, method, action):
        run, _ = self.pick(phase, method, action)
        return None if run is None else max(r["seconds"] for r in run)

    def table(self, phase: str, action: str, delivered: int) -> str:
        t = C.Table(
            [
                "method",
                "seconds",
                "MB/s",
                "stored MiB",
                "objects",
                "requests",
                "fetched MiB",
                "bcast MiB",
                "peak RSS MiB",
                "RSS growth MiB",
                "client CPU s",
                "server CPU s",
                "verified",
            ]
        )
        for m in self.args.methods:
            run, scpu = self.pick(phase, m, action)
            if run is None:
                t.add(LABEL[m], "FAILED", *["-"] * 11)
                continue
            secs, r0, save = max(r["seconds"] for r in run), run[0], action == "save"
            stored_txt = objects_txt = fetched = received = ver = ""
            if save and "stored" in r0:
                stored_txt, objects_txt = C.fmt_mib(r0["stored"][0]), str(r0["stored"][1])
                if "reported_bytes" in r0:
                    stored_txt += f" ({C.fmt_mib(r0['reported_bytes'])})"
                    objects_txt += f" ({r0['reported_objects']})"
            if not save:
                fetched = C.fmt_mib(sum(r["fetched"] for r in run) if "fetched" in r0 else None)
                received = C.fmt_mib(sum(r["received"] for r in run) if "received" in r0 else None)
                ver = C.human_bool(all(r["verified"] for r in run))
            requests = sum(r["requests"] for r in run) if "requests" in r0 else "-"
            t.add(
                LABEL[m],
                C.fmt_s(secs),
                C.fmt_rate(delivered, secs),
                stored_txt,
                objects_txt,
                requests,
                fetched,
                received,
                "/".join(f"{r['peak_rss'] / C.MiB:.0f}" for r in run),
                "/".join(f"{r['growth'] / C.MiB:.0f}" for r in run),
                "/".join(f"{r['cpu']:.2f}" for r in run),
                f"{scpu:.2f}",
                ver,
            )
        return t.render()

    def rss_line(self, phase: str, method: str, action: str):
        run, _ = self.pick(phase, method, action)
        growth = None if run is None else max(max(r["growth"] for r in run), 1) / C.MiB
        return C.ratio_line(
            f"[{phase}] {method} {action}: max peak RSS growth per rank / 256 MiB",
            growth,
            RSS_BUDGET / C.MiB,
            1.0,
        )

    def report(self) -> None:
        a = self.args
        state = sum(s["nbytes"] for s in make_specs(a.total_bytes))
        print(f"\n# save_load results  ({C.describe_machine()})")
        print(
            f"state: {state / C.MiB:,.1f} MiB ({len(make_specs(a.total_bytes))} tensors + values), "
            f"world 2, repeats {a.repeat} "
            f"(median shown{'; of 2: the faster' if a.repeat == 2 else ''}), "
            f"raw: {a.raw_concurrency} in flight, "
            f"{a.raw_object_mib} MiB objects, DCP thread_count {a.dcp_threads}, no fsync anywhere"
        )
        targets = []
        for case in a.cases:
            delivered_load = state * 2 if case == "replicated" else state
            print(f"\n## case {case}: save (MB/s = state bytes / s)")
            print(self.table(case, "save", state))
            print(f"\n## case {case}: load (MB/s = bytes landed in all ranks' tensors / s)")
            print(self.table(case, "load", delivered_load))
            s = lambda m, act, ph=case: self.seconds(ph, m, act)  # noqa: E731
            load_name, load_limit = (
                ("raw GET", 0.8)
                if case == "sharded"
                else (
                    "raw GET by every rank of everything (cloudckpt reads once + broadcasts)",
                    0.7,
                )
            )
            for label, m1, m2, act, limit in (
                ("save cloudckpt / raw PUT", "cloudckpt-s3", "raw-s3", "save", 0.9),
                (f"load cloudckpt / {load_name}", "cloudckpt-s3", "raw-s3", "load", load_limit),
                (
                    "load cloudckpt / DCP s3fs (>=3x faster)",
                    "cloudckpt-s3",
                    "dcp-s3",
                    "load",
                    1 / 3,
                ),
                (
                    "file:// save cloudckpt / DCP FileSystemWriter",
                    "cloudckpt-file",
                    "dcp-file",
                    "save",
                    1.0,
                ),
                (
                    "file:// load cloudckpt / DCP FileSystemReader",
                    "cloudckpt-file",
                    "dcp-file",
                    "load",
                    1.0,
                ),
            ):
                targets.append(C.ratio_line(f"[{case}] {label}", s(m1, act), s(m2, act), limit))
            for m in ("cloudckpt-s3", "cloudckpt-file"):
                for act in ("save", "load"):
                    targets.append(self.rss_line(case, m, act))
        if "sharded" in a.cases and not a.no_world1:
            print("\n## world-2 sharded checkpoint loaded by world 1 (full tensors)")
            print(self.table("world1", "load", state))
            targets.append(
                C.ratio_line(
                    "[world1] load cloudckpt / raw GET",
                    self.seconds("world1", "cloudckpt-s3", "load"),
                    self.seconds("world1", "raw-s3", "load"),
                    1.0,
                )
            )
            targets.append(self.rss_line("world1", "cloudckpt-s3", "load"))
        print("\n## targets (measured / baseline)")
        C.print_targets(targets)
        if any(not r["hwm_reset"] for runs in self.results.values() for run in runs for r in run):
            print("  note: /proc/self/clear_refs refused: peak RSS figures are lifetime peaks")
        if self.failures:
            print("\n## failures")
            for f in self.failures:
                print(f)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gib", type=float, default=1.0, help="total state size in GiB (default 1.0)")
    p.add_argument("--quick", action="store_true", help="~64 MiB, one repeat (development)")
    p.add_argument("--repeat", type=int, default=1, help="repeats; order alternates; median shown")
    p.add_argument("--cases", default="sharded,replicated")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--no-world1", action="store_true", help="skip the world-1 load")
    p.add_argument("--dcp-threads", type=int, default=4, help="DCP writer thread_count")
    p.add_argument("--raw-concurrency", type=int, default=16)
    p.add_argument("--raw-object-mib", type=int, default=16)
    p.add_argument(
        "--no-plan-cache", action="store_true", help="cloudckpt: SaveOptions(use_plan_cache=False)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per step")
    p.add_argument("--workdir", default=None, help="parent of the file:// checkpoints")
    a = p.parse_args(argv)
    if a.quick:
        a.gib = 1 / 16
    if a.repeat < 1:
        p.error("--repeat must be >= 1")
    a.total_bytes = int(a.gib * C.GiB)
    a.cases = [c for c in a.cases.split(",") if c]
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
        for case in args.cases:
            print(f"\n== case {case} ({args.total_bytes / C.GiB:.3f} GiB) ==", flush=True)
            runner.run_case(case)
    except BaseException:
        traceback.print_exc()
        runner.failures.append(traceback.format_exc())
    finally:
        try:
            runner.report()
        finally:
            C.remove_dir(runner.workdir)
            server.stop()
    print(f"\ntotal wall {time.perf_counter() - t0:.1f} s")
    return 1 if runner.failures else 0


if __name__ == "__main__":
    import save_load  # re-import under its module name so ProcessWorld can pickle rank functions

    sys.exit(save_load.main())
