"""Rank side of benchmarks/cluster.py: the state, the methods and one measured step.

Runs inside the simulated cluster's rank processes (cloudckpt.testing.cluster.simulated), which
see the store through the standard AWS variables. State: save_load.py's kinds of tensors (large,
medium, tiny, non-tensor values) with row counts divisible by every world size used, in two cases:
- sharded: large and medium tensors are DTensors, Shard(0) over the world's 1-D mesh (or over the
  first `readers` ranks when a world-N checkpoint is loaded by fewer ranks); tiny ones replicated;
- replicated (DDP-like): every rank holds every tensor whole.
"""

from __future__ import annotations

import os
import time

import _common as C
import save_load as SL

ROW_MULTIPLE = 16  # rows of large/medium tensors: divisible by 1, 2, 4, 8 and 16 ranks
_CTX: dict = {}
_RAW: dict = {}  # the process's RawSession (survives rank_build)


def make_specs(total_bytes: int) -> list[dict]:
    """save_load.make_specs with row counts rounded to ROW_MULTIPLE."""
    specs = SL.make_specs(total_bytes)
    sizes = {"float32": 4, "bfloat16": 2, "int64": 8, "bool": 1}
    for s in specs:
        if s["kind"] != "tiny":
            rows = max(ROW_MULTIPLE, s["shape"][0] // ROW_MULTIPLE * ROW_MULTIPLE)
            s["shape"] = (rows, s["shape"][1])
            s["nbytes"] = rows * s["shape"][1] * sizes[s["dtype"]]
    return specs


def state_bytes(total_bytes: int) -> int:
    return sum(s["nbytes"] for s in make_specs(total_bytes))


# -- building the state ----------------------------------------------------------------------------


def rank_build(
    case: str,
    total_bytes: int,
    seed: int,
    args: dict,
    readers: int | None = None,
    with_src: bool = True,
) -> dict:
    """Build this rank's source and zeroed destination of `case`. `readers`: the number of ranks
    that hold the destination (a checkpoint of the whole world loaded by the first `readers`
    ranks; the others hold nothing); default: every rank. `with_src=False` keeps only the
    expected values of the destination (a load-only world)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    _CTX.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    readers = world if readers is None else readers
    specs = make_specs(total_bytes)
    group = None
    if readers < world:
        group = dist.new_group(list(range(readers)))  # every rank takes part in creating it
    member = rank < readers
    mesh = dest_mesh = None
    if case == "sharded":
        mesh = DeviceMesh("cpu", list(range(world)))
        if group is not None and member:
            dest_mesh = DeviceMesh.from_group(group, "cpu")
        elif group is None:
            dest_mesh = mesh
    src, dest, local_src, local_dest, expected = {}, {}, {}, {}, {}
    for i, s in enumerate(specs):
        full = SL._full_tensor(s, seed, i)
        sharded = case == "sharded" and s["kind"] != "tiny"
        if with_src:
            if sharded:
                mine = full.chunk(world)[rank].clone()
                src[s["name"]] = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)
            else:
                mine = src[s["name"]] = full
            local_src[s["name"]] = mine
        if member:
            want = full.chunk(readers)[rank].clone() if sharded else full
            out = torch.zeros_like(want)
            dest[s["name"]] = (
                DTensor.from_local(out, dest_mesh, [Shard(0)], run_check=False) if sharded else out
            )
            local_dest[s["name"]], expected[s["name"]] = out, want
        del full
    if with_src:
        src["meta"] = SL.meta_values()
    dest["meta"] = SL.meta_values(blank=True)
    _CTX.update(
        case=case,
        specs=specs,
        rank=rank,
        world=world,
        readers=readers,
        group=group,
        member=member,
        args=args,
        src=SL._nest(src),
        dest=SL._nest(dest),
        local_src=local_src,
        local_dest=local_dest,
        expected=expected,
        streams=SL.raw_layout(specs, case, world),
        scratch=bytearray(args["raw_object_mib"] * C.MiB),
    )
    return {"rss": C.rss_bytes(), "local_bytes": sum(t.nbytes for t in local_src.values())}


# -- raw transfers ---------------------------------------------------------------------------------


def _info():
    from cloudckpt.testing.servers.endpoint import S3ServerInfo

    env = os.environ
    return S3ServerInfo(
        endpoint_url=env["AWS_ENDPOINT_URL"],
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        region=env["AWS_DEFAULT_REGION"],
        bucket=env["CLUSTER_BENCH_BUCKET"],
        readonly_access_key="",
        readonly_secret_key="",
    )


def _raw() -> C.RawSession:
    """This process's raw client, kept across steps (made on first use)."""
    if _RAW.get("session") is None:
        concurrency = int(os.environ["CLUSTER_BENCH_RAW_CONCURRENCY"])
        _RAW["session"] = C.RawSession(_info(), concurrency=concurrency)
    return _RAW["session"]


def _item_view(tensors: dict, item):
    """uint8 view of the bytes of `item` in this rank's destination (or source), None when this
    rank does not need them. Shard k of a tensor cut over `world` writers lands in reader r of
    `readers` when r holds its rows (writers and readers cut rows evenly)."""
    name, shard, nbytes, offset, _holders = item
    if name not in tensors:
        return None
    view = C.tensor_bytes_view(tensors[name])
    if shard is None:
        return view
    per_reader = _CTX["world"] // _CTX["readers"]
    first = _CTX["rank"] * per_reader
    if not first <= shard < first + per_reader:
        return None
    start = (shard - first) * nbytes
    return view[start : start + nbytes]


def _raw_objects(prefix: str, for_put: bool, own_only: bool = False) -> list:
    """This rank's objects: the ones it PUTs (its own stream) or every object holding bytes it
    needs (GET; bytes it does not need land in a scratch buffer); `own_only`: GET only the
    objects this rank wrote. Streams as in save_load.py."""
    tensors = _CTX["local_src"] if for_put else _CTX["local_dest"]
    objects = []
    for writer, stream in enumerate(_CTX["streams"]):
        if (for_put or own_only) and writer != _CTX["rank"]:
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


def rank_link_check(nbytes: int, prefix: str, bcast_bytes: int) -> dict:
    """Raw PUT then GET of `nbytes` per rank, every rank at once: the frontend links' real rates;
    then a gloo broadcast of `bcast_bytes` from rank 0 and an all-gather of `bcast_bytes` / world
    per rank: what the backend gives the collectives a read-once load uses."""
    import numpy as np
    import torch
    import torch.distributed as dist

    data = np.random.default_rng(dist.get_rank()).integers(0, 255, nbytes, dtype=np.uint8)
    objects = C.cut_objects(
        f"{prefix}r{dist.get_rank()}-", [[(memoryview(data), nbytes)]], 4 * C.MiB
    )
    out = {}
    raw = _raw()
    for action, fn in (("put", raw.put), ("get", raw.get)):
        dist.barrier()
        start = time.perf_counter()
        fn(objects)
        out[action] = time.perf_counter() - start
    world = dist.get_world_size()
    buf = torch.zeros(bcast_bytes // world * world, dtype=torch.uint8)
    parts = list(buf.chunk(world))
    for name, op in (
        ("broadcast", lambda: dist.broadcast(buf, 0)),
        ("all_gather", lambda: dist.all_gather(parts, parts[dist.get_rank()].clone())),
    ):
        op()  # connections
        dist.barrier()
        start = time.perf_counter()
        op()
        dist.barrier()
        out[name] = time.perf_counter() - start
    return out


# -- the methods -----------------------------------------------------------------------------------


def _s3fs_kwargs() -> dict:
    env = os.environ
    return {
        "key": env["AWS_ACCESS_KEY_ID"],
        "secret": env["AWS_SECRET_ACCESS_KEY"],
        "client_kwargs": {
            "endpoint_url": env["AWS_ENDPOINT_URL"],
            "region_name": env["AWS_DEFAULT_REGION"],
        },
        "config_kwargs": {
            "s3": {"addressing_style": "path", "payload_signing_enabled": False},
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        },
    }


_PHASES: list = []  # (phase, "start" / "agree" / "end", perf_counter) of the current call


def _time_phases() -> None:
    """Mark every protocol phase's start, the end of its block (then its exchange) and its end
    (once per process)."""
    from cloudckpt import transport

    if getattr(transport.Phase, "_bench_timed", False):
        return
    enter, exit_ = transport.Phase.__enter__, transport.Phase.__exit__

    def phase_enter(self):
        _PHASES.append((self.what, "start", time.perf_counter()))
        return enter(self)

    def phase_exit(self, *exc):
        _PHASES.append((self.what, "agree", time.perf_counter()))
        try:
            return exit_(self, *exc)
        finally:
            _PHASES.append((self.what, "end", time.perf_counter()))

    transport.Phase.__enter__, transport.Phase.__exit__ = phase_enter, phase_exit  # type: ignore[method-assign]
    transport.Phase._bench_timed = True  # type: ignore[attr-defined]


def _phase_rows(start: float, end: float) -> list:
    """``[label, seconds]`` of each phase's own work (``name``) and exchange (``name ~``), and
    of the gaps between phases (``-``), from ``start`` to ``end``."""
    rows, t = [], start
    for what, edge, at in _PHASES:
        label = "-" if edge == "start" else what if edge == "agree" else f"{what} ~"
        rows.append([label, at - t])
        t = at
    rows.append(["-", end - t])
    merged: list = []
    for label, sec in rows:
        if merged and merged[-1][0] == label:
            merged[-1][1] += sec
        else:
            merged.append([label, sec])
    return [[label, round(sec, 4)] for label, sec in merged if sec > 0.0005 or label != "-"]


def _do(method: str, action: str, target: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import cloudckpt

    args, group = _CTX["args"], _CTX["group"]
    if method.startswith("cloudckpt"):
        _time_phases()
        _PHASES.clear()
        start = time.perf_counter()
        if action == "save":
            r = cloudckpt.save(_CTX["src"], target)
            out = {"written": r.rank_bytes_written, "total_written": r.bytes_written}
        else:
            options = (
                cloudckpt.LoadOptions(broadcast=False) if method == "cloudckpt-nobcast" else None
            )
            r = cloudckpt.load(_CTX["dest"], target, process_group=group, options=options)
            out = {"fetched": r.bytes_fetched, "received": r.bytes_received}
        return out | {"phases": _phase_rows(start, time.perf_counter())}
    if method == "dcp":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        if action == "save":
            dcp.save(
                _CTX["src"],
                storage_writer=FsspecWriter(
                    target, thread_count=args["dcp_threads"], sync_files=False, **_s3fs_kwargs()
                ),
            )
        else:
            dcp.load(
                _CTX["dest"],
                storage_reader=FsspecReader(target, **_s3fs_kwargs()),
                process_group=group,
            )
        return {}
    if method in ("raw", "raw-share"):
        objects = _raw_objects(target, action == "save", own_only=method == "raw-share")
        moved = (_raw().put if action == "save" else _raw().get)(objects)
        return {"written" if action == "save" else "fetched": moved, "requests": len(objects)}
    raise ValueError(method)


def _verify_and_reset(values: bool) -> bool:
    import torch

    ok = True
    for name, out in _CTX["local_dest"].items():
        ok &= bool(torch.equal(out, _CTX["expected"][name]))
        out.zero_()
    if values:
        ok &= _CTX["dest"]["meta"] == SL.meta_values()
    _CTX["dest"]["meta"] = SL.meta_values(blank=True)
    return bool(ok)


def rank_step(method: str, action: str, target: str) -> dict:
    """One measured save or load on this rank, bracketed by world barriers; ranks outside the
    readers of a load (when fewer ranks load) only wait."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    extra = {}
    with C.Meter() as meter:
        if _CTX["member"] or action == "save":
            extra = _do(method, action, target)
    dist.barrier()
    out = {
        "seconds": time.perf_counter() - start,
        "cpu": meter.result.cpu,
        "growth": meter.result.rss_growth,
        **extra,
    }
    if action == "load" and _CTX["member"]:
        if method == "raw-share":  # a share of the bytes only: nothing to compare
            for t in _CTX["local_dest"].values():
                t.zero_()
        else:
            out["verified"] = _verify_and_reset(values=not method.startswith("raw"))
    return out


def rank_warmup(target: str, case: str, args: dict) -> None:
    """Every method once on a ~1 MiB state (imports, clients, connections; not measured)."""
    import torch.distributed as dist

    saved = dict(_CTX)
    try:
        rank_build(case, 1 << 20, 1, args)
        for m in ("cloudckpt", "dcp", "raw"):
            where = f"{target}/{m}/" if m == "raw" else f"s3://{args['bucket']}/{target}/{m}"
            _do(m, "save", where)
            dist.barrier()
            _do(m, "load", where)
            dist.barrier()
    finally:
        _CTX.clear()
        _CTX.update(saved)


def rank_delete_prefix(prefix: str) -> None:
    """Rank 0 deletes everything under `prefix` in the benchmark's bucket."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        C.s3_delete_prefix(_info(), prefix)
    dist.barrier()


def rank_fixed_cost(target: str, args: dict, repeats: int = 3) -> dict:
    """cloudckpt save and load of a ~1 MiB sharded state, `repeats` times each: the seconds
    every save or load pays whatever its size (collectives, manifest, commit, request latency)."""
    saved = dict(_CTX)
    out = {"save": [], "load": []}
    try:
        rank_build("sharded", 1 << 20, 2, args)
        for i in range(repeats):
            for action in ("save", "load"):
                out[action].append(rank_step("cloudckpt", action, f"{target}/{i}")["seconds"])
    finally:
        _CTX.clear()
        _CTX.update(saved)
    return out
