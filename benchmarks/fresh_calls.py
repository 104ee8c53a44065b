"""The first and the tenth call in fresh processes (issue 27): 64 MiB, ~600 tensors.

    python benchmarks/fresh_calls.py                 # world 2 save + load, world-1 load
    python benchmarks/fresh_calls.py --profile       # + cProfile of rank 0's 1st and 10th call
    python benchmarks/fresh_calls.py --calls 5 --methods native,raw
    python benchmarks/fresh_calls.py --methods native,raw --phases   # + each phase's wall ms

Every measurement runs in new processes (`python benchmarks/fresh_calls.py --worker`, one per
rank, gloo over 127.0.0.1), as a user's job starts: each process imports torch and the method's
top-level module (`cloudckpt`; `torch.distributed.checkpoint` and `cloudckpt.dcp`; aiobotocore),
builds its state, then makes `--calls` saves (each to a fresh prefix) and then loads each of
them. Whatever a method imports or starts lazily (the API's modules, the S3 client, its event
loop, gloo groups) is paid by its first call. Methods:

- `native`: `cloudckpt.save` / `cloudckpt.load`; sharded tensors as `cloudckpt.GlobalPiece`.
- `dcp`: `dcp.save` / `dcp.load` with `cloudckpt.dcp.StorageWriter` / `StorageReader`;
  sharded tensors as DTensors on a 1-D mesh.
- `raw`: parallel PUT / GET of each rank's bytes (16 MiB objects, 16 in flight) with one
  aiobotocore client created at the first call: the limit.

The state: 8 large float32 tensors (~85% of the bytes) and 92 medium ones (~14%) sharded in
rows over the ranks, 500 tiny replicated ones, a few values. The world-1 load reads the world-2
checkpoints in one process (resharding; raw: every object). Seconds are rank 0's, between
barriers (the slowest rank's call). Printed: call 1, call `--calls`, the median of calls 2..N,
and the PASS/MISS lines of issue 27's 64 MiB targets, ratios of figures of this one run.

cloudckpt's modules are compiled to bytecode before the workers start (`--no-compile`: not),
as a pip-installed cloudckpt has them: where `PYTHONDONTWRITEBYTECODE` is set, as on this
machine, a source checkout would otherwise be compiled again in every process (about 0.2 s of
each first call), while torch, botocore and aiohttp come with their bytecode.

The first-call lines come twice: call 1 alone, and the worker's import of its method's
top-level module plus call 1 ("import + first call"). The second is the like-for-like one:
`import cloudckpt` is lazy (its call 1 imports the API, the S3 client's packages and creates
the client), while the raw worker's `import aiobotocore.session` already loads aiobotocore,
botocore and aiohttp (about 0.35 s of CPU), leaving only the client's creation to its call 1,
and the DCP worker's `import cloudckpt.dcp` loads cloudckpt's API and storage layer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)

MiB = 1 << 20
METHODS = ("native", "dcp", "raw")


# -- worker side ----------------------------------------------------------------------------


def _specs(total: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, global shape, sharded): 8 large, 92 medium (sharded), 500 tiny (replicated)."""
    large = (int(0.85 * total / 8 / 4 / 1024) // 8 * 8, 1024)
    out = [(f"model.layers.{i}.weight", large, True) for i in range(8)]
    rows = int(0.14 * total / 92 / 4 / 256) // 8 * 8
    out += [(f"model.layers.{i % 8}.mlp{i}.weight", (rows, 256), True) for i in range(92)]
    shapes = [(64,), (3, 5), (257,), ()]
    out += [(f"optim.state.p{i // 4}.t{i % 4}", shapes[i % 4], False) for i in range(500)]
    return out


def _state(rank: int, world: int, method: str, blank: bool):
    import torch

    flat, local = {}, {}
    mesh = None
    if method == "dcp" and world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    for i, (name, shape, sharded) in enumerate(_specs(_ARGS.mib * MiB)):
        g = torch.Generator().manual_seed(i)
        full = torch.rand(shape, generator=g)
        if blank:
            full = torch.zeros(shape)
        if sharded and world > 1:
            rows = shape[0] // world
            mine = full.narrow(0, rank * rows, rows).clone()
            local[name] = mine
            if method == "dcp":
                from torch.distributed.tensor import DTensor, Shard

                flat[name] = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False)
            elif method == "native":
                import cloudckpt

                flat[name] = cloudckpt.GlobalPiece(mine, shape, (rank * rows,) + (0,) * 1)
            else:
                flat[name] = mine
        else:
            flat[name] = local[name] = full
    flat["meta"] = {"step": 0 if blank else 7, "lr": 0.0 if blank else 1e-3}
    return flat, local


def _raw_objects(local: dict, prefix: str, rank: int):
    views = [(C.tensor_bytes_view(t), t.numel() * t.element_size()) for t in local.values()]
    return C.cut_objects(f"{prefix}/r{rank}-", [views], 16 * MiB)


class _Raw:
    def __init__(self, info):
        self.info, self.session = info, None

    def _s(self):
        if self.session is None:
            self.session = C.RawSession(self.info, concurrency=16)
        return self.session

    def put(self, objects):
        self._s().put(objects)

    def get(self, objects):
        self._s().get(objects)


def _call(method: str, action: str, url: str, flat: dict, local: dict, rank: int, raw, info):
    if method == "native":
        import cloudckpt

        (cloudckpt.save if action == "save" else cloudckpt.load)(flat, url)
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        from cloudckpt.dcp import StorageReader, StorageWriter

        if action == "save":
            dcp.save(flat, storage_writer=StorageWriter(url))
        else:
            dcp.load(flat, storage_reader=StorageReader(url))
    else:
        key = url.split("/", 3)[3]
        if action == "save":
            raw.put(_raw_objects(local, key, rank))
        else:
            worlds = range(_ARGS.saved_world) if _ARGS.world == 1 else [rank]
            for r in worlds:  # world 1 reads what every saving rank wrote
                raw.get(_raw_objects(_world_share(local, r), key, r))


def _world_share(local: dict, saved_rank: int) -> dict:
    """The tensors rank ``saved_rank`` of the saving world wrote (for the world-1 raw GET: the
    rows it held, read into this process's full tensors)."""
    if _ARGS.world == _ARGS.saved_world:
        return local
    out = {}
    for (name, shape, sharded), t in zip(_specs(_ARGS.mib * MiB), local.values()):
        if sharded:
            rows = shape[0] // _ARGS.saved_world
            out[name] = t.narrow(0, saved_rank * rows, rows)
        else:
            out[name] = t
    return out


def worker() -> None:
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), _ARGS.world
    imported = time.perf_counter()
    if _ARGS.method == "native":
        import cloudckpt  # noqa: F401
    elif _ARGS.method == "dcp":
        import torch.distributed.checkpoint  # noqa: F401

        import cloudckpt.dcp  # noqa: F401
    else:
        import aiobotocore.session  # noqa: F401
    imported = time.perf_counter() - imported
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo")
    info = _info_from_env()
    raw = _Raw(info) if _ARGS.method == "raw" else None
    flat, local = _state(rank, world, _ARGS.method, blank=_ARGS.action == "load")

    def barrier():
        if world > 1:
            dist.barrier()

    phases = C.PhaseClock() if _ARGS.phases and _ARGS.method == "native" else None
    seconds, cpu, profiles, phase_lines = [], [], [], []
    for i in range(_ARGS.calls):
        url = f"{_ARGS.url}/c{i}"
        prof = (
            cProfile.Profile()
            if _ARGS.profile and rank == 0 and i in (0, _ARGS.calls - 1)
            else None
        )
        barrier()
        start, cpu0 = time.perf_counter(), C.cpu_seconds()
        if phases is not None:
            phases.start(start)
        if prof:
            prof.enable()
        _call(_ARGS.method, _ARGS.action, url, flat, local, rank, raw, info)
        if prof:
            prof.disable()
        end = time.perf_counter()
        barrier()
        seconds.append(time.perf_counter() - start)
        cpu.append(C.cpu_seconds() - cpu0)
        if phases is not None and i in (0, _ARGS.calls - 1):
            phase_lines.append(f"call {i + 1}: " + phases.line(end))
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(22)
            profiles.append(f"call {i + 1}:\n" + s.getvalue())
    if raw is not None and raw.session is not None:
        raw.session.close()
    if rank == 0:
        out = {"seconds": seconds, "profiles": profiles, "import": imported, "cpu": cpu}
        print(json.dumps({**out, "phases": phase_lines}))


def _info_from_env():
    from types import SimpleNamespace

    return SimpleNamespace(
        endpoint_url=os.environ["AWS_ENDPOINT_URL"],
        access_key=os.environ["AWS_ACCESS_KEY_ID"],
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ.get("AWS_REGION", "us-east-1"),
        bucket=os.environ["BENCH_BUCKET"],
    )


# -- driver side ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compile_cloudckpt(args) -> str:
    """Compile the measured cloudckpt's modules to bytecode (``__pycache__``, ignored by git),
    unless ``--no-compile``. A pip-installed cloudckpt has its bytecode from the install, as
    torch, botocore and aiohttp have theirs; a source checkout run where
    ``PYTHONDONTWRITEBYTECODE`` is set (this machine) would otherwise compile about 90 modules
    in every fresh process: measured 0.59-0.73 s for the API's and S3 client's imports after
    torch, against 0.36-0.53 s with bytecode."""
    root = os.path.join(os.path.abspath(args.code) if args.code else str(C.REPO_ROOT), "cloudckpt")
    if args.no_compile:
        return f"cloudckpt bytecode: as found (PYTHONDONTWRITEBYTECODE={sys.dont_write_bytecode})"
    import compileall

    ok = compileall.compile_dir(root, quiet=1, force=False)
    return f"cloudckpt bytecode: compiled first ({root}), as an installed wheel has it: {ok}"


def run_job(info, method: str, action: str, world: int, url: str, args) -> dict:
    env = {**os.environ, **info.env(), "BENCH_BUCKET": info.bucket, "GLOO_SOCKET_IFNAME": "lo"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    env["PYTHONPATH"] = os.path.abspath(args.code) if args.code else str(C.REPO_ROOT)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--method", method]
    cmd += ["--action", action, "--world", str(world), "--url", url, "--calls", str(args.calls)]
    cmd += ["--mib", str(args.mib), "--saved-world", "2"] + (["--profile"] if args.profile else [])
    cmd += ["--phases"] if args.phases else []
    procs = [
        subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(
            f"{method} {action} world {world} failed: {[p.returncode for p in procs]}"
        )
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> int:
    global _ARGS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", default="native")
    ap.add_argument("--action", default="save")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--saved-world", type=int, default=2)
    ap.add_argument("--url", default="")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--phases",
        action="store_true",
        help="native: wall ms of each phase of calls 1 and N (imports cloudckpt.transport first)",
    )
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--code", default=None, help="a directory holding the cloudckpt to measure")
    ap.add_argument(
        "--no-compile",
        action="store_true",
        help="leave cloudckpt's bytecode as it is (by default it is compiled first, as a "
        "pip-installed wheel has it)",
    )
    _ARGS = args = ap.parse_args()
    if args.worker:
        worker()
        return 0
    tensors = len(_specs(args.mib * MiB))
    code = args.code or "this checkout"
    print(f"# fresh_calls: {args.mib} MiB, {tensors} tensors, {code}; {C.describe_machine()}")
    print("# " + _compile_cloudckpt(args))
    server = C.start_server()
    info = server.info
    results: dict = {}
    try:
        C.warm_up_server(info)
        stamp = time.time_ns()
        for method in args.methods.split(","):
            url = info.url(f"fresh-{stamp}-{method}")
            for action, world in (("save", 2), ("load", 2), ("load", 1)):
                r = run_job(info, method, action, world, url, args)
                results[(method, action, world)] = r
                s = r["seconds"]
                rest = statistics.median(s[1:]) if len(s) > 1 else s[0]
                c = r["cpu"]
                print(
                    f"{method:7s} {action} world {world}: import {r['import']:.3f} s, call 1 "
                    f"{s[0]:.3f} s, call {len(s)} {s[-1]:.3f} s, median of 2..{len(s)} "
                    f"{rest:.3f} s; rank 0 CPU: call 1 {c[0]:.3f} s, median of the others "
                    f"{statistics.median(c[1:] or c):.3f} s",
                    flush=True,
                )
                for p in r["profiles"]:
                    print("    " + p.replace("\n", "\n    ")[:5000])
                for p in r.get("phases", ()):
                    print("    phases, rank 0, " + p)
    finally:
        server.stop()
    _targets(results)
    return 0


def _targets(results: dict) -> None:
    def fig(method, action, world, which):
        r = results.get((method, action, world))
        if r is None:
            return None
        s = r["seconds"]
        if which == "import + first":
            return r["import"] + s[0]
        return s[0] if which == "first" else statistics.median(s[1:] or s)

    lines = []
    for which in ("first", "import + first", "later"):
        for action, world in (("save", 2), ("load", 2), ("load", 1)):
            n, d = fig("native", action, world, which), fig("dcp", action, world, which)
            if n is not None and d is not None:
                lines.append(
                    (
                        f"native {action} world {world} ({which} call) <= DCP adapter: "
                        f"{n:.3f} / {d:.3f} s = {n / d:.2f}x",
                        n <= d,
                    )
                )
        for action, world, limit in (("save", 2, 1.2), ("load", 2, 1.0), ("load", 1, 1.0)):
            n, r = fig("native", action, world, which), fig("raw", action, world, which)
            if n is not None and r is not None:
                lines.append(
                    (
                        f"native {action} world {world} ({which} call) <= {limit}x raw: "
                        f"{n:.3f} / {r:.3f} s = {n / r:.2f}x",
                        n <= limit * r,
                    )
                )
    for text, ok in lines:
        print(("PASS " if ok else "MISS ") + text)


_ARGS: argparse.Namespace

if __name__ == "__main__":
    sys.exit(main())
