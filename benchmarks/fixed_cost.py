"""The fixed cost of one ``cloudckpt.save`` / ``cloudckpt.load`` call as the world grows.

    python benchmarks/fixed_cost.py                      # N = 1, 2, 4, 8; 5 repeats
    python benchmarks/fixed_cost.py --phases             # + per-phase and per-collective figures
    python benchmarks/fixed_cost.py --baseline DIR       # + the same with the cloudckpt in DIR
    python benchmarks/fixed_cost.py --profile-rank 0     # + cProfile of that rank's calls

Each world of N gloo ranks (cloudckpt.testing.ProcessWorld, 127.0.0.1) saves and loads a ~1 MiB
*sharded* state against one local SeaweedFS: save_load.py's kinds of tensors (4 large and 48
medium tensors cut in row shards, one per rank, as ``cloudckpt.GlobalPiece``; 400 tiny ones
replicated; non-tensor values), each save to a fresh prefix, each load of that save (verified
outside the timing). So small a state makes the seconds of a call its fixed cost: collectives,
manifest, planning, request latency. Printed per N and method: the median over `--repeat` of
the call's wall seconds (from a world barrier to the end of the slowest rank's call) and of the
CPU seconds one rank's process used in the call (mean over ranks, every thread, from
``resource.getrusage``), the server's CPU seconds, the garbage collector's seconds and full
passes per rank, the store requests of all ranks by kind, and each world's first (uncounted)
calls; with ``--phases`` each protocol phase's wall seconds (its own work, then its closing
exchange) and CPU seconds, the collectives each call runs (count and seconds, rank 0) and the
calls, wall and thread CPU of the functions in ``TRACED``. ``--profile-rank R`` writes cProfile
files (thread CPU) of rank R's main and loop threads at the largest N; ``--gc`` freezes or turns
off the ranks' garbage collector (to see its share); ``--load-option`` sets a ``LoadOptions``
field. Everything shares this machine's cores (N ranks and the server), so what a rank computes
and every wait for the slowest rank are multiplied as N grows.

The first and the tenth call of a fresh process (issue 27: 64 MiB, ~600 tensors, world 1 and
2, with cProfile of both) are measured by ``benchmarks/fresh_calls.py --profile``.

``--baseline DIR`` (a directory holding another version of the ``cloudckpt`` package, e.g.
``git archive <commit> cloudckpt | tar -x -C DIR``) measures that version too, in worlds of its
own, repeats alternating with this checkout's: a before/after comparison under the same load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)

BUCKET = "bench"
_CTX: dict = {}

# -- rank side ---------------------------------------------------------------------------------


def _use_code(code: str | None) -> None:
    """Import cloudckpt from ``code`` (a directory holding the package) in this fresh worker."""
    if not code:
        return
    for name in [m for m in sys.modules if m == "cloudckpt" or m.startswith("cloudckpt.")]:
        if not name.startswith("cloudckpt.testing"):
            del sys.modules[name]
    sys.path.insert(0, code)
    import cloudckpt

    if not cloudckpt.__file__.startswith(os.path.abspath(code)):
        raise RuntimeError(f"cloudckpt came from {cloudckpt.__file__}, not {code}")


class _Recorder:
    """Per call: a timeline of phase boundaries and collectives, with process CPU seconds."""

    def __init__(self):
        self.events: list[tuple] = []
        self.fns: dict[str, list] = {}  # traced function -> [calls, wall s, thread CPU s]

    def mark(self, what: str, edge: str) -> None:
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF)
        self.events.append((what, edge, time.perf_counter(), r.ru_utime + r.ru_stime))


def _instrument() -> _Recorder:
    """Wrap ``Phase`` (its block, then its exchange) and torch's collectives."""
    import torch.distributed as dist

    from cloudckpt import transport

    rec = _Recorder()
    enter, exit_ = transport.Phase.__enter__, transport.Phase.__exit__

    def phase_enter(self):
        rec.mark(self.what, "start")
        return enter(self)

    def phase_exit(self, *exc):
        rec.mark(self.what, "agree")
        try:
            return exit_(self, *exc)
        finally:
            rec.mark(self.what, "end")

    transport.Phase.__enter__, transport.Phase.__exit__ = phase_enter, phase_exit
    for op in (
        "all_gather",
        "broadcast",
        "barrier",
        "all_gather_into_tensor",
        "all_gather_single",
        "batch_isend_irecv",
        "send",
        "recv",
        "all_reduce",
        "gather",
        "scatter",
    ):
        fn = getattr(dist, op, None)
        if fn is None:
            continue

        def wrapped(*a, __fn=fn, __op=op, **kw):
            rec.mark("collective " + __op, "start")
            try:
                return __fn(*a, **kw)
            finally:
                rec.mark("collective " + __op, "end")

        setattr(dist, op, wrapped)
    for spec in TRACED:
        _trace(rec, spec)
    return rec


#: functions whose calls ``--phases`` times (wall and the calling thread's CPU seconds):
#: ``module:attribute`` (a dotted attribute for a method), patched where callers look them up.
TRACED = (
    "cloudckpt.api.load:StoredManifest.read",
    "cloudckpt.api.load:StoredManifest.decode",
    "cloudckpt.api.load:StoredManifest.check",
    "cloudckpt.api.load:_Wanted.of",
    "cloudckpt.api.load:plan_local_load",
    "cloudckpt.api.load:move_data",
    "cloudckpt.api.reports:LoadPlanReport.encode",
    "cloudckpt.api.reports:LoadPlanReport.decode",
    "cloudckpt.api.load_data:assign_readers",
    "cloudckpt.api.load_data:select_broadcasts",
    "cloudckpt.api.load_data:split_reads",
    "cloudckpt.api.load_data:plan_broadcasts",
    "cloudckpt.dataplane.broadcast:BroadcastSession.__init__",
    "cloudckpt.api.load_data:run_broadcasts",
    "cloudckpt.dataplane.reader:plan_pieces",
    "cloudckpt.dataplane.broadcast:BroadcastSession.deliver_round",
    "cloudckpt.dataplane.broadcast:BroadcastSession.deliver",
    "cloudckpt.dataplane.broadcast:BroadcastSession.land",
    "cloudckpt.dataplane.broadcast:BroadcastSession.prefetch",
    "cloudckpt.transport:Broadcaster.all_gather",
    "cloudckpt.transport:Broadcaster.exchange",
    "cloudckpt.transport:Broadcaster.prepare",
    "cloudckpt.api.save:plan_locally",
    "cloudckpt.api.save:plan_globally",
    "cloudckpt.api.save:_upload",
    "cloudckpt.api.save:_commit",
)


def _trace(rec: _Recorder, spec: str) -> None:
    import functools
    import importlib

    module_name, _, attr = spec.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return
    fn = getattr(owner, name, None)
    if fn is None or getattr(fn, "_fixed_cost_traced", False):
        return
    if isinstance(owner, type) and isinstance(owner.__dict__.get(name), classmethod):
        fn = owner.__dict__[name].__func__
        wrap_as = classmethod
    else:
        wrap_as = None

    @functools.wraps(fn)
    def traced(*a, **kw):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            entry = rec.fns.setdefault(attr, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t
            entry[2] += time.thread_time() - c

    traced._fixed_cost_traced = True
    setattr(owner, name, wrap_as(traced) if wrap_as else traced)


def rank_setup(
    total_bytes: int,
    seed: int,
    code: str | None,
    phases: bool,
    load_options: dict | None = None,
    gc_mode: str = "on",
) -> str:
    """Build this rank's sharded source and zeroed destination (GlobalPiece row shards).
    ``gc_mode``: ``on`` (Python's default), ``freeze`` (``gc.freeze()`` after the set-up:
    what was allocated so far is never scanned again) or ``off`` (``gc.disable()``)."""
    import gc

    _use_code(code)
    import _cluster_ranks as R
    import save_load as SL
    import torch
    import torch.distributed as dist

    import cloudckpt

    rank, world = dist.get_rank(), dist.get_world_size()
    src, dest, expected = {}, {}, {}
    for i, s in enumerate(R.make_specs(total_bytes)):
        full = SL._full_tensor(s, seed, i)
        if s["kind"] == "tiny":
            src[s["name"]], dest[s["name"]] = full, torch.zeros_like(full)
            expected[s["name"]] = (dest[s["name"]], full)
            continue
        rows = full.shape[0] // world
        mine = full[rank * rows : (rank + 1) * rows].clone()
        out = torch.zeros_like(mine)
        offsets = (rank * rows, 0)
        src[s["name"]] = cloudckpt.GlobalPiece(mine, tuple(full.shape), offsets)
        dest[s["name"]] = cloudckpt.GlobalPiece(out, tuple(full.shape), offsets)
        expected[s["name"]] = (out, mine)
    src["meta"] = SL.meta_values()
    dest["meta"] = SL.meta_values(blank=True)
    _CTX.clear()
    if gc_mode == "freeze":
        gc.collect()
        gc.freeze()
    elif gc_mode == "off":
        gc.disable()
    _CTX.update(
        src=SL._nest(src),
        dest=SL._nest(dest),
        expected=expected,
        load_options=cloudckpt.LoadOptions(**load_options) if load_options else None,
        recorder=_instrument() if phases else None,
        profile=None,
    )
    return cloudckpt.__file__


def _on_loop(fn) -> None:
    """Run ``fn`` on cloudckpt's loop thread and wait for it."""
    import concurrent.futures

    try:
        from cloudckpt.runtime.loop import get_loop
    except ImportError:  # a --baseline from before the banded layout (runtime.py, issue 26)
        from cloudckpt.runtime import get_loop  # type: ignore[attr-defined,no-redef]

    done = concurrent.futures.Future()
    get_loop().call_soon_threadsafe(lambda: (fn(), done.set_result(None)))
    done.result(10)


def rank_profile_on(rank: int, action: str) -> None:
    """Profile this rank's next measured calls if it is ``rank``: cProfile of the calling
    thread and of cloudckpt's loop thread, in thread CPU seconds (``time.thread_time``, so
    waiting for a core or a peer does not count)."""
    import cProfile

    import torch.distributed as dist

    if dist.get_rank() == rank and _CTX.get("profile") is None:
        _CTX["profile"] = cProfile.Profile(time.thread_time)
        _CTX["loop_profile"] = cProfile.Profile(time.thread_time)
        _CTX["profile_action"] = action


def rank_profile_dump(path: str) -> None:
    """Write the calling thread's profile to ``path`` and the loop thread's to ``path.loop``."""
    if _CTX.get("profile") is not None:
        _CTX["profile"].dump_stats(path)
        _CTX["loop_profile"].dump_stats(path + ".loop")


class _GcClock:
    """Seconds spent in the cyclic garbage collector, per generation (``gc.callbacks``)."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._t = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t
            self.counts[info["generation"]] += 1

    def reset(self) -> None:
        self.seconds, self.counts = [0.0, 0.0, 0.0], [0, 0, 0]


def _gc_clock() -> _GcClock:
    import gc

    clock = _CTX.get("gc")
    if clock is None:
        clock = _CTX["gc"] = _GcClock()
        gc.callbacks.append(clock)
    return clock


def _cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rank_call(action: str, url: str) -> dict:
    """One save or load, bracketed by world barriers; a load is verified (and reset) after."""
    import torch
    import torch.distributed as dist

    import cloudckpt

    try:
        from cloudckpt.runtime.loop import shared_store
    except ImportError:  # a --baseline from before the banded layout (runtime.py, issue 26)
        from cloudckpt.runtime import shared_store  # type: ignore[attr-defined,no-redef]

    rec, prof = _CTX["recorder"], _CTX["profile"]
    if action != _CTX.get("profile_action"):
        prof = None
    stats = shared_store(url, None).stats
    requests0 = dict(stats.requests)
    gc_clock = _gc_clock()
    dist.barrier()
    gc_clock.reset()
    if rec is not None:
        rec.events.clear()
        rec.fns.clear()
    start, cpu0 = time.perf_counter(), _cpu()
    if prof is not None:
        _on_loop(_CTX["loop_profile"].enable)
        prof.enable()
    try:
        if action == "save":
            cloudckpt.save(_CTX["src"], url)
        else:
            cloudckpt.load(_CTX["dest"], url, options=_CTX["load_options"])
    finally:
        if prof is not None:
            prof.disable()
            _on_loop(_CTX["loop_profile"].disable)
    end, cpu1 = time.perf_counter(), _cpu()
    gc_seconds, gc_counts = sum(gc_clock.seconds), list(gc_clock.counts)
    events = list(rec.events) if rec is not None else []
    if events:
        events.append(("return", "start", end, cpu1))
    dist.barrier()
    requests = {
        op: n - requests0.get(op, 0)
        for op, n in stats.requests.items()
        if n != requests0.get(op, 0)
    }
    out = {
        "wall": end - start,
        "cpu": cpu1 - cpu0,
        "start": start,
        "cpu0": cpu0,
        "events": events,
        "requests": requests,
        "gc": gc_seconds,
        "gc_counts": gc_counts,
        "fns": {k: list(v) for k, v in rec.fns.items()} if rec is not None else {},
    }
    if action == "load":
        ok = all(torch.equal(got, want) for got, want in _CTX["expected"].values())
        for got, _ in _CTX["expected"].values():
            got.zero_()
        import save_load as SL

        ok &= _CTX["dest"]["meta"] == SL.meta_values()
        _CTX["dest"]["meta"] = SL.meta_values(blank=True)
        out["verified"] = bool(ok)
    return out


# -- owner side --------------------------------------------------------------------------------


def _phase_rows(events: list[tuple], start: float, cpu0: float) -> list[tuple[str, float, float]]:
    """(label, wall s, cpu s) of each phase's block and exchange, and of the gaps between."""
    rows, last_t, last_c, last_label = [], start, cpu0, "entry"
    for what, edge, t, c in events:
        if what.startswith("collective "):
            continue
        label = {"start": f"(before {what})", "agree": what, "end": f"{what}: exchange"}[edge]
        if edge == "start":
            if t - last_t > 0:
                rows.append((f"(between: after {last_label})", t - last_t, c - last_c))
        else:
            rows.append((label, t - last_t, c - last_c))
        last_t, last_c, last_label = t, c, what
    return rows


def _collectives(events: list[tuple]) -> dict[str, tuple[int, float]]:
    out: dict[str, list] = {}
    open_: dict[str, float] = {}
    for what, edge, t, _ in events:
        if not what.startswith("collective "):
            continue
        op = what.removeprefix("collective ")
        if edge == "start":
            open_[op] = t
        else:
            entry = out.setdefault(op, [0, 0.0])
            entry[0] += 1
            entry[1] += t - open_.pop(op)
    return {k: (n, s) for k, (n, s) in out.items()}


def measure(world, server_pid: int, label: str, action: str, url: str) -> dict:
    import fixed_cost as R

    server0 = C.proc_cpu_seconds(server_pid)
    ranks = world.run(R.rank_call, action, url, timeout=300)
    requests: dict[str, int] = {}
    for r in ranks:
        for op, k in r["requests"].items():
            requests[op] = requests.get(op, 0) + k
    rec = {
        "wall": max(r["wall"] for r in ranks),
        "cpu": statistics.mean(r["cpu"] for r in ranks),
        "server_cpu": C.proc_cpu_seconds(server_pid) - server0,
        "requests": requests,
        "gc": statistics.mean(r["gc"] for r in ranks),
        "gc_full": statistics.mean(r["gc_counts"][2] for r in ranks),
        "verified": all(r.get("verified", True) for r in ranks),
    }
    if ranks[0]["events"]:
        rec["phases"] = [_phase_rows(r["events"], r["start"], r["cpu0"]) for r in ranks]
        rec["collectives"] = _collectives(ranks[0]["events"])
        rec["fns"] = [r["fns"] for r in ranks]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", default="1,2,4,8", help="world sizes (default 1,2,4,8)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kib", type=int, default=1024, help="state size in KiB (default 1024)")
    ap.add_argument("--phases", action="store_true", help="per-phase and per-collective figures")
    ap.add_argument("--baseline", default=None, help="a directory holding another cloudckpt")
    ap.add_argument(
        "--load-option",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="a LoadOptions field for every load (repeatable), e.g. min_broadcast_bytes=0",
    )
    ap.add_argument(
        "--gc",
        default="on",
        choices=("on", "freeze", "off"),
        help="the ranks' garbage collector: on (default), frozen after the set-up, "
        "or off (to see its share of the cost)",
    )
    ap.add_argument(
        "--profile-rank",
        type=int,
        default=None,
        help="write cProfile stats of this rank's measured calls (largest N)",
    )
    ap.add_argument("--profile-action", default="load", choices=("save", "load"))
    ap.add_argument("--profile-dir", default="/tmp/fixed_cost_profiles")
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    codes = [("this", None)] + (
        [("baseline", os.path.abspath(args.baseline))] if args.baseline else []
    )
    C.repo_on_path()
    import fixed_cost as R

    from cloudckpt.testing import ProcessWorld

    server = C.start_server(BUCKET)
    info = server.info
    results: dict = {}
    try:
        print(
            f"# fixed cost: {os.uname().nodename} | {os.cpu_count()} cpus | load average "
            f"{', '.join(f'{v:.2f}' for v in os.getloadavg())}",
            flush=True,
        )
        for n in ns:
            worlds = {}
            for label, code in codes:
                world = ProcessWorld(n, env=info.env(), timeout=300)
                origin = world.run(
                    R.rank_setup,
                    args.kib * 1024,
                    3,
                    code,
                    args.phases,
                    _load_options(args.load_option),
                    args.gc,
                )[0]
                worlds[label] = world
                first = []
                for i in range(2):  # warm-up: imports, clients, connections, plan caches
                    url = info.url(f"fixed/{label}/n{n}/warm{i}")
                    for action in ("save", "load"):
                        ranks = world.run(R.rank_call, action, url, timeout=300)
                        if i == 0:
                            first.append(
                                f"{action} {max(r['wall'] for r in ranks):.3f} s, "
                                f"{statistics.mean(r['cpu'] for r in ranks):.3f} CPU s/rank"
                            )
                print(
                    f"N={n} {label}: cloudckpt from {os.path.dirname(origin)}; first calls "
                    f"in the world (not counted): {'; '.join(first)}",
                    flush=True,
                )
            profile = args.profile_rank is not None and n == max(ns)
            for rep in range(args.repeat):
                for label, _ in codes:
                    world = worlds[label]
                    if profile:
                        world.run(R.rank_profile_on, args.profile_rank, args.profile_action)
                    url = info.url(f"fixed/{label}/n{n}/r{rep}")
                    for action in ("save", "load"):
                        rec = measure(world, server.pid, label, action, url)
                        results.setdefault((n, label, action), []).append(rec)
                        if not rec["verified"]:
                            print(f"N={n} {label} {action}: NOT VERIFIED", flush=True)
            if profile:
                os.makedirs(args.profile_dir, exist_ok=True)
                for label, _ in codes:
                    path = os.path.join(
                        args.profile_dir, f"{label}-n{n}-rank{args.profile_rank}.prof"
                    )
                    worlds[label].run(R.rank_profile_dump, path)
                    print(
                        f"cProfile (thread CPU s) of rank {args.profile_rank}'s measured "
                        f"{args.profile_action}s ({label}): {path} (calling thread), "
                        f"{path}.loop (loop thread)",
                        flush=True,
                    )
            for world in worlds.values():
                world.close()
            _report_n(n, codes, results, args)
    finally:
        server.stop()
    _summary(ns, codes, results)
    return 0


def _load_options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        out[name] = {"true": True, "false": False}.get(value.lower(), None)
        if out[name] is None:
            out[name] = int(value)
    return out


def _report_n(n: int, codes, results, args) -> None:
    for label, _ in codes:
        line = []
        for action in ("save", "load"):
            recs = results[(n, label, action)]
            reqs = recs[-1]["requests"]
            line.append(
                f"{action} {statistics.median(r['wall'] for r in recs):.3f} s wall, "
                f"{statistics.median(r['cpu'] for r in recs):.3f} CPU s/rank, server "
                f"{statistics.median(r['server_cpu'] for r in recs):.3f} CPU s, GC "
                f"{statistics.mean(r['gc'] for r in recs):.3f} s/rank (full "
                f"{statistics.mean(r['gc_full'] for r in recs):.2f}/call), requests "
                + ",".join(f"{op} {k}" for op, k in sorted(reqs.items()))
            )
        print(f"N={n} {label:8s} " + " | ".join(line), flush=True)
        if not args.phases:
            continue
        for action in ("save", "load"):
            recs = results[(n, label, action)]
            print(
                f"  {action} phases (median over repeats; wall s rank 0 / max over ranks; "
                f"CPU s rank 0 / mean over ranks):"
            )
            rows: dict[str, list] = {}
            for rec in recs:
                for rank, phase_rows in enumerate(rec["phases"]):
                    for name, wall, cpu in phase_rows:
                        rows.setdefault(name, [[] for _ in rec["phases"]])[rank].append((wall, cpu))
            for name, per_rank in rows.items():
                w0 = statistics.median(w for w, _ in per_rank[0]) if per_rank[0] else 0.0
                c0 = statistics.median(c for _, c in per_rank[0]) if per_rank[0] else 0.0
                wmax = max(statistics.median(w for w, _ in r) for r in per_rank if r)
                cmean = statistics.mean(statistics.median(c for _, c in r) for r in per_rank if r)
                print(f"    {name:45s} {w0:7.3f} / {wmax:7.3f}   {c0:6.3f} / {cmean:6.3f}")
            ops: dict[str, list] = {}
            for rec in recs:
                for op, (count, secs) in rec["collectives"].items():
                    ops.setdefault(op, []).append((count, secs))
            text = ", ".join(
                f"{op} x{statistics.median(c for c, _ in v):g} "
                f"({statistics.median(s for _, s in v):.3f} s)"
                for op, v in ops.items()
            )
            print(f"    collectives (rank 0): {text or 'none'}")
            fns: dict[str, list] = {}
            for rec in recs:
                for rank_fns in rec["fns"]:
                    for name, (calls, wall, cpu) in rank_fns.items():
                        fns.setdefault(name, []).append((calls, wall, cpu))
            for name, v in sorted(fns.items(), key=lambda kv: -sum(c for _, _, c in kv[1])):
                k = len(v)
                print(
                    f"    fn {name:55s} calls {sum(c for c, _, _ in v) / k:5.1f}  wall "
                    f"{sum(w for _, w, _ in v) / k:7.4f}  CPU {sum(c for _, _, c in v) / k:7.4f} "
                    "(mean per rank and call)"
                )


def _summary(ns, codes, results) -> None:
    print("\n## fixed cost per call (median of repeats; wall: slowest rank; CPU: per rank, mean)")
    head = (
        "   N  version   save wall s  save CPU s/rank  load wall s  load CPU s/rank  "
        "load/save wall  server CPU s save/load"
    )
    print(head)
    print("-" * len(head))
    for n in ns:
        for label, _ in codes:
            s, l_ = results[(n, label, "save")], results[(n, label, "load")]
            sw, lw = (statistics.median(r["wall"] for r in x) for x in (s, l_))
            sc, lc = (statistics.median(r["cpu"] for r in x) for x in (s, l_))
            ss, ls = (statistics.median(r["server_cpu"] for r in x) for x in (s, l_))
            ok = all(r["verified"] for r in l_)
            print(
                f"{n:4d}  {label:8s}  {sw:11.3f}  {sc:15.3f}  {lw:11.3f}  {lc:15.3f}  "
                f"{lw / sw:14.2f}  {ss:10.3f} / {ls:.3f}" + ("" if ok else "  NOT VERIFIED")
            )


if __name__ == "__main__":
    sys.exit(main())
