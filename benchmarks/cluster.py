"""Save/load benchmarks on a simulated cluster (issue 19): links, not CPUs, are the limit.

    python benchmarks/cluster.py --quick     # as root: small state, 2 and 4 nodes, ~2 minutes
    python benchmarks/cluster.py             # the issue's figures (N = 2, 4, 8), ~10 minutes

Each world of N ranks runs on N nodes of cloudckpt.testing.cluster.simulated.Cluster: network
namespaces whose frontend link to the one SeaweedFS is shaped to `--frontend-mbit` each way and
whose backend link (gloo) to the other nodes to `--backend-mbit` (10x by default). The state (about
`--mib` MiB, the kinds of tensors of save_load.py) is saved and loaded by every method, in cases:
- sharded (FSDP-like) save and load;
- replicated (DDP-like) save, and load: cloudckpt reads each region once and broadcasts it over
  the backend (`cloudckpt`), or every rank reads everything (`cloudckpt-nobcast`);
- the sharded world-N checkpoint loaded by the first N/2 ranks (nodes);
- with `--slow-node`: the same at N = 4 with node 3's frontend at a quarter of the rate.
Methods: cloudckpt, torch DCP with FsspecWriter/FsspecReader on s3fs, and raw aiobotocore
PUT/GET of the same bytes over the same links (`raw`; in the replicated load every rank GETs
everything, and `raw-share` GETs only the bytes it wrote: the frontend part of a read-once load).
Each is compared with the ideal from the link rates: the bytes each node must move over its
links divided by their rate. See benchmarks/README.md for the columns and targets.
Needs root (network namespaces); elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as C  # noqa: E402  (benchmarks/ is sys.path[0] when run as a script)

BUCKET = "bench"
BCAST_CHECK_MIB = 16
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHOD_LABEL = {
    "cloudckpt": "cloudckpt",
    "cloudckpt-nobcast": "cloudckpt, every rank reads all",
    "dcp": "DCP fsspec+s3fs",
    "raw": "raw aiobotocore",
    "raw-share": "raw, own share only",
}
# (case, action) -> methods, in order; loads of "reshard" read the sharded checkpoints.
PLAN = {
    ("sharded", "save"): ("cloudckpt", "dcp", "raw"),
    ("sharded", "load"): ("cloudckpt", "dcp", "raw"),
    ("reshard", "load"): ("cloudckpt", "dcp", "raw"),
    ("replicated", "save"): ("cloudckpt", "dcp", "raw"),
    ("replicated", "load"): ("cloudckpt", "cloudckpt-nobcast", "dcp", "raw", "raw-share"),
}
SLOW_PLAN = {
    ("sharded", "save"): ("cloudckpt", "raw"),
    ("sharded", "load"): ("cloudckpt", "raw"),
    ("replicated", "save"): ("cloudckpt", "raw"),
    ("replicated", "load"): ("cloudckpt", "raw-share"),
}


def cpu_times() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of the whole machine so far (/proc/stat)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return values[3] + values[4], sum(values)


class Bench:
    def __init__(self, args):
        self.args = args
        self.records: list[dict] = []
        self.link_checks: list[dict] = []
        self.fixed: dict[int, dict] = {}  # N -> median seconds of a ~1 MiB save / load
        self.failures: list[str] = []
        import _cluster_ranks as R

        self.state = R.state_bytes(args.total_bytes)
        self.rank_args = {
            "dcp_threads": args.dcp_threads,
            "raw_concurrency": args.raw_concurrency,
            "raw_object_mib": args.raw_object_mib,
            "bucket": BUCKET,
        }

    # -- ideal -----------------------------------------------------------------------------------

    def ideal(self, n: int, case: str, action: str, method: str, rates: list[float]) -> float:
        """Seconds the links need at least: bytes each node must move / its rate (bytes/s)."""
        s, backend = self.state, self.args.backend_mbit * 1e6 / 8
        if case == "reshard":
            readers = rates[: n // 2]
            return max((s / len(readers)) / r for r in readers)
        if case == "sharded":
            return max((s / n) / r for r in rates)
        # replicated: writes and read-once sources may be spread in proportion to the rates
        if action == "save" or method == "raw-share":
            return s / sum(rates)
        if method == "cloudckpt":  # read once, then every node receives what it did not read
            return s / sum(rates) + s * (n - 1) / n / backend
        return max(s / r for r in rates)  # every rank reads everything

    # -- one step --------------------------------------------------------------------------------

    def step(
        self,
        cluster,
        scenario: str,
        case: str,
        method: str,
        action: str,
        target: str,
        rates: list[float],
    ) -> dict | None:
        import _cluster_ranks as R

        from cloudckpt.testing import RankFailedError, WorldTimeoutError

        n = cluster.nodes
        os.sync()  # the server's volumes written by earlier steps: not this step's cost
        links0, cpu0, idle0 = (
            cluster.link_bytes(),
            C.proc_cpu_seconds(cluster.server_pid),
            cpu_times(),
        )
        try:
            ranks = cluster.run(R.rank_step, method, action, target, timeout=self.args.timeout)
        except (RankFailedError, WorldTimeoutError) as exc:
            self.failures.append(f"[N={n} {scenario}] {case} {method} {action}: {exc}")
            print(
                f"  N={n} {scenario:8s} {case:10s} {action} {method:18s} FAILED "
                f"({type(exc).__name__})",
                flush=True,
            )
            return None
        idle1, links1 = cpu_times(), cluster.link_bytes()
        rec = {
            "n": n,
            "scenario": scenario,
            "case": case,
            "method": method,
            "action": action,
            "seconds": max(r["seconds"] for r in ranks),
            "ideal": self.ideal(n, case, action, method, rates),
            "server_cpu": C.proc_cpu_seconds(cluster.server_pid) - cpu0,
            "cpu_idle": (idle1[0] - idle0[0]) / max(1, idle1[1] - idle0[1]),
            "loadavg": os.getloadavg()[0],
            "ranks": ranks,
            "links": [
                {
                    link: {d: a[link][d] - b[link][d] for d in ("tx", "rx")}
                    for link in ("frontend", "backend")
                }
                for a, b in zip(links1, links0)
            ],
        }
        self.records.append(rec)
        ok = [r["verified"] for r in ranks if "verified" in r]
        print(
            f"  N={n} {scenario:8s} {case:10s} {action} {method:18s} {rec['seconds']:7.2f} s "
            f"(ideal {rec['ideal']:6.2f}, x{rec['seconds'] / rec['ideal']:.2f}, "
            f"idle {rec['cpu_idle']:.0%})" + (f" verified={all(ok)}" if ok else ""),
            flush=True,
        )
        return rec

    def link_check(self, cluster, scenario: str) -> None:
        import _cluster_ranks as R

        nbytes = self.args.check_mib * C.MiB
        idle0 = cpu_times()
        bcast = BCAST_CHECK_MIB * C.MiB
        res = cluster.run(
            R.rank_link_check, nbytes, f"linkcheck-{scenario}/", bcast, timeout=self.args.timeout
        )
        idle1 = cpu_times()
        n = cluster.nodes
        rec = {
            "n": n,
            "scenario": scenario,
            "put_mbit": [nbytes * 8 / 1e6 / r["put"] for r in res],
            "get_mbit": [nbytes * 8 / 1e6 / r["get"] for r in res],
            # what each receiver got per second, and what one node's uplink carried
            "broadcast_mbit": bcast * 8 / 1e6 / res[0]["broadcast"],
            "all_gather_mbit": bcast * (n - 1) / n * 8 / 1e6 / res[0]["all_gather"],
            "cpu_idle": (idle1[0] - idle0[0]) / max(1, idle1[1] - idle0[1]),
        }
        self.link_checks.append(rec)
        print(
            f"  N={n} {scenario}: raw {self.args.check_mib} MiB per node at once: "
            f"PUT {min(rec['put_mbit']):.0f}-{max(rec['put_mbit']):.0f} Mbit/s, GET "
            f"{min(rec['get_mbit']):.0f}-{max(rec['get_mbit']):.0f} Mbit/s per node "
            f"(frontend {self.args.frontend_mbit:g}); backend: {BCAST_CHECK_MIB} MiB gloo "
            f"broadcast {rec['broadcast_mbit']:.0f} Mbit/s per receiver, all_gather "
            f"{rec['all_gather_mbit']:.0f} Mbit/s per node (backend {self.args.backend_mbit:g}); "
            f"CPU idle {rec['cpu_idle']:.0%}",
            flush=True,
        )

    # -- worlds ----------------------------------------------------------------------------------

    def run_world(self, n: int, scenario: str) -> None:
        import _cluster_ranks as R

        from cloudckpt.testing.cluster.simulated import Cluster

        a = self.args
        slow = {n - 1: 0.25} if scenario == "slow" else {}
        rates = [a.frontend_mbit * 1e6 / 8 * slow.get(i, 1.0) for i in range(n)]
        plan = SLOW_PLAN if scenario == "slow" else PLAN
        with Cluster(
            nodes=n,
            frontend_mbit=a.frontend_mbit,
            backend_mbit=a.backend_mbit,
            slow_nodes=slow,
            bucket=BUCKET,
            timeout=a.timeout,
            env={
                "CLUSTER_BENCH_BUCKET": BUCKET,
                "CLUSTER_BENCH_RAW_CONCURRENCY": str(a.raw_concurrency),
            },
        ) as cluster:
            self.link_check(cluster, scenario)
            cluster.run(
                R.rank_warmup, f"warmup-{scenario}", "sharded", self.rank_args, timeout=a.timeout
            )
            if scenario == "uniform":
                fixed = cluster.run(
                    R.rank_fixed_cost,
                    f"s3://{BUCKET}/fixed-cost",
                    self.rank_args,
                    timeout=a.timeout,
                )[0]
                self.fixed[n] = {k: statistics.median(v) for k, v in fixed.items()}
                print(
                    f"  N={n}: fixed cost of a 1 MiB save {self.fixed[n]['save']:.3f} s, "
                    f"load {self.fixed[n]['load']:.3f} s (median of 3)",
                    flush=True,
                )
            for case in ("sharded", "reshard", "replicated"):
                if case == "reshard" and (n < 2 or ("reshard", "load") not in plan):
                    continue
                if case == "reshard":
                    build = (
                        R.rank_build,
                        "sharded",
                        a.total_bytes,
                        a.seed,
                        self.rank_args,
                        n // 2,
                        False,
                    )
                else:
                    build = (R.rank_build, case, a.total_bytes, a.seed, self.rank_args)
                cluster.run(*build, timeout=a.timeout)
                for rep in range(a.repeat):
                    for action in ("save", "load"):
                        methods = list(plan.get((case, action), ()))
                        if rep % 2:
                            methods.reverse()
                        for m in methods:
                            written = "sharded" if case == "reshard" else case
                            saved_by = (
                                "raw"
                                if m.startswith("raw")
                                else "cloudckpt"
                                if m.startswith("cloudckpt")
                                else m
                            )
                            tag = f"{scenario}/{written}/{saved_by}/rep{rep}"
                            target = f"{tag}/" if saved_by == "raw" else f"s3://{BUCKET}/{tag}"
                            if self.step(cluster, scenario, case, m, action, target, rates) is None:
                                cluster.run(*build, timeout=a.timeout)  # a fresh world
        print(f"  N={n} {scenario}: cluster removed", flush=True)

    # -- reporting -------------------------------------------------------------------------------

    def pick(self, n, scenario, case, method, action) -> dict | None:
        runs = [
            r
            for r in self.records
            if (r["n"], r["scenario"], r["case"], r["method"], r["action"])
            == (n, scenario, case, method, action)
        ]
        if not runs:
            return None
        runs.sort(key=lambda r: r["seconds"])
        return runs[(len(runs) - 1) // 2]

    def seconds(self, n, case, method, action, scenario="uniform"):
        rec = self.pick(n, scenario, case, method, action)
        return None if rec is None else rec["seconds"]

    @staticmethod
    def own_cpu(rec: dict) -> float:
        """CPU the step's own processes (ranks and store) used, as a share of the machine's."""
        used = sum(r["cpu"] for r in rec["ranks"]) + rec["server_cpu"]
        return used / (os.cpu_count() * rec["seconds"])

    def table(self, n: int, scenario: str) -> str:
        t = C.Table(
            [
                "case",
                "action",
                "method",
                "seconds",
                "ideal s",
                "x ideal",
                "x raw",
                "MB/s/node",
                "frontend MiB/node",
                "backend in/out MiB/node",
                "client CPU s",
                "server CPU s",
                "own CPU",
                "CPU idle",
                "verified",
            ]
        )
        plan = SLOW_PLAN if scenario == "slow" else PLAN
        for case in ("sharded", "reshard", "replicated"):
            for action in ("save", "load"):
                for m in plan.get((case, action), ()):
                    rec = self.pick(n, scenario, case, m, action)
                    if rec is None:
                        t.add(case, action, METHOD_LABEL[m], "FAILED", *["-"] * 11)
                        continue
                    raw = self.pick(n, scenario, case, "raw", action)
                    fe = [lk["frontend"]["tx" if action == "save" else "rx"] for lk in rec["links"]]
                    be = [(lk["backend"]["rx"], lk["backend"]["tx"]) for lk in rec["links"]]
                    moved = (
                        self.state
                        if action == "save"
                        else (self.state * (n if case == "replicated" else 1))
                    )
                    verified = [r["verified"] for r in rec["ranks"] if "verified" in r]
                    t.add(
                        case if case != "reshard" else f"N->{n // 2}",
                        action,
                        METHOD_LABEL[m],
                        C.fmt_s(rec["seconds"]),
                        C.fmt_s(rec["ideal"]),
                        f"{rec['seconds'] / rec['ideal']:.2f}",
                        f"{rec['seconds'] / raw['seconds']:.2f}" if raw else "-",
                        C.fmt_rate(moved / n, rec["seconds"]),
                        "/".join(f"{b / C.MiB:.0f}" for b in fe),
                        " ".join(f"{i / C.MiB:.0f}/{o / C.MiB:.0f}" for i, o in be),
                        f"{sum(r['cpu'] for r in rec['ranks']):.2f}",
                        f"{rec['server_cpu']:.2f}",
                        f"{self.own_cpu(rec):.0%}",
                        f"{rec['cpu_idle']:.0%}",
                        C.human_bool(all(verified)) if verified else "",
                    )
        return t.render()

    def targets(self) -> list:
        a, out = self.args, []
        ops = (
            ("sharded", "save", "cloudckpt"),
            ("sharded", "load", "cloudckpt"),
            ("replicated", "save", "cloudckpt"),
            ("replicated", "load", "cloudckpt"),
            ("reshard", "load", "cloudckpt"),
        )
        for n in a.nodes:
            for case, action, m in ops:
                rec = self.pick(n, "uniform", case, m, action)
                label = (
                    f"[N={n}] {'N->N/2' if case == 'reshard' else case} {action} cloudckpt / ideal"
                )
                out.append(
                    C.ratio_line(label, rec and rec["seconds"], rec and rec["ideal"], a.ideal_limit)
                )
        for n, limit in ((2, 0.6), (4, 0.35), (2, 0.7)):
            if n in a.nodes:
                what = "issue 5's target" if limit == 0.7 else "read once + broadcast"
                out.append(
                    C.ratio_line(
                        f"[N={n}] replicated load cloudckpt / raw GET of everything by every rank "
                        f"({what})",
                        self.seconds(n, "replicated", "cloudckpt", "load"),
                        self.seconds(n, "replicated", "raw", "load"),
                        limit,
                    )
                )
                if limit != 0.7:
                    out.append(
                        C.ratio_line(
                            f"[N={n}] replicated load cloudckpt / cloudckpt with every rank "
                            f"reading everything (broadcast=False)",
                            self.seconds(n, "replicated", "cloudckpt", "load"),
                            self.seconds(n, "replicated", "cloudckpt-nobcast", "load"),
                            limit,
                        )
                    )
        lo, hi = min(a.nodes), max(a.nodes)
        if lo != hi:
            for case, action, m in ops:
                r_lo, r_hi = (self.pick(n, "uniform", case, m, action) for n in (lo, hi))
                eff = None
                if r_lo and r_hi:
                    eff = (r_hi["ideal"] / r_hi["seconds"]) / (r_lo["ideal"] / r_lo["seconds"])
                out.append(
                    C.ratio_line(
                        f"scaling efficiency {lo}->{hi} ranks, "
                        f"{'N->N/2' if case == 'reshard' else case} "
                        f"{action} (ideal/seconds at {hi} over the same at {lo})",
                        eff,
                        1.0,
                        0.85,
                        at_most=False,
                    )
                )
        if a.slow_node:
            n = a.slow_n
            for case in ("sharded", "replicated"):  # replicated: S / sum of the rates
                rec = self.pick(n, "slow", case, "cloudckpt", "save")
                out.append(
                    C.ratio_line(
                        f"[N={n}, node {n - 1} at 1/4 rate] {case} save cloudckpt / ideal",
                        rec and rec["seconds"],
                        rec and rec["ideal"],
                        a.ideal_limit,
                    )
                )
            for case, action, key in (
                ("replicated", "save", "written"),
                ("replicated", "load", "fetched"),
            ):
                rec = self.pick(n, "slow", case, "cloudckpt", action)
                share = None
                if rec:
                    moved = [r.get(key, 0) for r in rec["ranks"]]
                    share = moved[n - 1] / max(1, sum(moved))
                out.append(
                    C.ratio_line(
                        f"[N={n}, node {n - 1} at 1/4 rate] replicated {action}: share of the "
                        f"bytes {'written' if action == 'save' else 'read from the store'} by the "
                        f"slow node / an even share",
                        share,
                        1 / n,
                        1.0,
                    )
                )
        return out

    def report(self) -> None:
        a = self.args
        print(
            f"\n# cluster results  ({C.describe_machine()}; load average "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())})"
        )
        print(
            f"state: {self.state / C.MiB:,.1f} MiB; frontend {a.frontend_mbit:g} Mbit/s per node "
            f"each way, backend {a.backend_mbit:g} Mbit/s; MTU 9000; 1 rank per node; repeats "
            f"{a.repeat} (median shown); raw: {a.raw_concurrency} in flight, "
            f"{a.raw_object_mib} MiB objects; DCP thread_count {a.dcp_threads}"
        )
        for chk in self.link_checks:
            print(
                f"link check N={chk['n']} {chk['scenario']}: raw PUT "
                f"{statistics.median(chk['put_mbit']):.1f}, GET "
                f"{statistics.median(chk['get_mbit']):.1f} Mbit/s per node (median); "
                f"gloo broadcast {chk['broadcast_mbit']:.0f} Mbit/s per receiver, all_gather "
                f"{chk['all_gather_mbit']:.0f} Mbit/s per node; CPU idle {chk['cpu_idle']:.0%}"
            )
        for n, fixed in sorted(self.fixed.items()):
            print(
                f"fixed cost N={n}: cloudckpt save of a 1 MiB state {fixed['save']:.3f} s, "
                f"load {fixed['load']:.3f} s (median of 3)"
            )
        for n in a.nodes:
            print(f"\n## N = {n} ranks on {n} nodes")
            print(self.table(n, "uniform"))
        if a.slow_node:
            print(f"\n## N = {a.slow_n}, node {a.slow_n - 1}'s frontend at 1/4 of the rate")
            print(self.table(a.slow_n, "slow"))
            for case, action, m in (
                ("sharded", "save", "cloudckpt"),
                ("sharded", "load", "cloudckpt"),
                ("replicated", "save", "cloudckpt"),
                ("replicated", "load", "cloudckpt"),
            ):
                even, slow = (
                    self.seconds(a.slow_n, case, m, action, sc) for sc in ("uniform", "slow")
                )
                if even and slow:
                    print(
                        f"  {case} {action}: {even:.2f} s -> {slow:.2f} s with the slow node "
                        f"(x{slow / even:.2f})"
                    )
        self.print_phases()
        if self.records:
            recs = self.records
            print(
                f"\n## CPU during the steps (2 cores shared with other work): machine idle "
                f"min {min(r['cpu_idle'] for r in recs):.0%}, median "
                f"{statistics.median(r['cpu_idle'] for r in recs):.0%}; this benchmark's own "
                f"processes used median {statistics.median(self.own_cpu(r) for r in recs):.0%}, "
                f"max {max(self.own_cpu(r) for r in recs):.0%}; load average (1 min) median "
                f"{statistics.median(r['loadavg'] for r in recs):.1f}"
            )
        print("\n## targets (measured / baseline)")
        C.print_targets(self.targets())
        for chk in [
            r
            for r in self.records
            if any("verified" in x and not x["verified"] for x in r["ranks"])
        ]:
            self.failures.append(f"N={chk['n']} {chk['case']} {chk['method']}: not verified")
        if self.failures:
            print("\n## failures")
            for f in self.failures:
                print(f)

    def print_phases(self) -> None:
        """Where each cloudckpt save's seconds went, on its slowest rank: every protocol
        phase's own work, its exchange (``~``: waiting for the other ranks and the collective)
        and the time between phases (``-``)."""
        a, lines = self.args, []
        for n, scenario in [(n, "uniform") for n in a.nodes] + (
            [(a.slow_n, "slow")] if a.slow_node else []
        ):
            for case in ("sharded", "replicated"):
                rec = self.pick(n, scenario, case, "cloudckpt", "save")
                if not rec or not all("phases" in r for r in rec["ranks"]):
                    continue
                k = max(range(n), key=lambda i: rec["ranks"][i]["seconds"])
                rows = " | ".join(f"{lbl} {sec:.3f}" for lbl, sec in rec["ranks"][k]["phases"])
                lines.append(f"  N={n} {scenario} {case} save, rank {k}: {rows}")
        if lines:
            print("\n## cloudckpt save phases, slowest rank (s; '~' its exchange, '-' between)")
            print("\n".join(lines))

    def save_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(
                {
                    "args": {k: v for k, v in vars(self.args).items()},
                    "state_bytes": self.state,
                    "link_checks": self.link_checks,
                    "fixed_cost": self.fixed,
                    "records": self.records,
                    "loadavg": os.getloadavg(),
                },
                f,
                separators=(",", ":"),
            )
        print(f"results: {path}")


COLORS = {
    "cloudckpt": "tab:blue",
    "cloudckpt-nobcast": "tab:cyan",
    "dcp": "tab:orange",
    "raw": "tab:green",
    "raw-share": "tab:olive",
}


def plot(bench: Bench, path: str) -> None:
    """Seconds against N for each method, next to the ideal; the slow-node times in the last
    panel. Skipped, with one line, where matplotlib (the bench extra) is not installed: the
    tables and the JSON are the results, the figure only draws them."""
    try:
        import matplotlib
    except ImportError:
        print(f"figure {path} not drawn: matplotlib is not installed (pip install -e '.[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    panels = (
        ("sharded", "save"),
        ("sharded", "load"),
        ("reshard", "load"),
        ("replicated", "save"),
        ("replicated", "load"),
    )
    fig, axes = plt.subplots(2, 3, figsize=(14, 8.5))
    ns = bench.args.nodes
    for ax, (case, action) in zip(axes.flat, panels):
        for m in PLAN[(case, action)]:
            ax.plot(
                ns,
                [bench.seconds(n, case, m, action) for n in ns],
                marker="o",
                color=COLORS[m],
                label=METHOD_LABEL[m],
            )
        for m, style, what in (
            ("cloudckpt", "k--", "ideal"),
            ("raw", "k:", "ideal, every rank reads all"),
        ):
            if m == "raw" and (case, action) != ("replicated", "load"):
                continue
            recs = [bench.pick(n, "uniform", case, m, action) for n in ns]
            ax.plot(ns, [r and r["ideal"] for r in recs], style, label=what)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("ranks saving (N/2 load)" if case == "reshard" else "ranks (1 per node)")
        ax.set_ylabel("seconds")
        title = {"reshard": "world-N checkpoint loaded on N/2"}.get(case, f"{case} {action}")
        ax.set_title(title if case == "reshard" else f"{case} {action}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes.flat[5]
    ops = [("sharded", "save"), ("sharded", "load"), ("replicated", "save"), ("replicated", "load")]
    n = bench.args.slow_n
    even = [bench.seconds(n, c, "cloudckpt", a) or 0 for c, a in ops]
    slow = [bench.seconds(n, c, "cloudckpt", a, "slow") or 0 for c, a in ops]
    xs = range(len(ops))
    ax.bar([x - 0.2 for x in xs], even, 0.4, label=f"N={n}, every node at the rate")
    ax.bar([x + 0.2 for x in xs], slow, 0.4, label=f"node {n - 1} at 1/4 of the rate")
    ax.set_xticks(list(xs), [f"{c[:4]}. {a}" for c, a in ops])
    ax.set_ylabel("seconds (cloudckpt)")
    ax.set_title("one slow node")
    ax.legend(fontsize=7)
    fig.suptitle(
        f"{bench.state / C.MiB:.0f} MiB state, frontend {bench.args.frontend_mbit:g} "
        f"Mbit/s per node each way, backend {bench.args.backend_mbit:g} Mbit/s "
        f"(simulated cluster, 1 rank per node)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"figure: {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", default="2,4,8", help="world sizes (1 rank per node)")
    p.add_argument("--mib", type=float, default=64.0, help="state size in MiB (default 64)")
    p.add_argument("--frontend-mbit", type=float, default=50.0)
    p.add_argument("--backend-mbit", type=float, default=None, help="default: 10x frontend")
    p.add_argument(
        "--slow-node",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run N=4 with one node's frontend at a quarter of the rate",
    )
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="16 MiB, N = 2 and 4, no slow node")
    p.add_argument("--check-mib", type=int, default=24, help="MiB per node of the link check")
    p.add_argument("--ideal-limit", type=float, default=1.15)
    p.add_argument("--dcp-threads", type=int, default=4)
    p.add_argument(
        "--raw-concurrency",
        type=int,
        default=4,
        help="requests in flight per rank (8 lose ~25%% to drops at the token bucket)",
    )
    p.add_argument("--raw-object-mib", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per step")
    p.add_argument(
        "--recovery",
        action="store_true",
        help="only the fast-recovery section (issue 25: benchmarks/_cluster_recovery.py)",
    )
    p.add_argument("--json", default=os.path.join(RESULTS, "cluster.json"))
    p.add_argument("--figure", default=os.path.join(RESULTS, "cluster.png"))
    a = p.parse_args(argv)
    if a.quick:
        a.mib, a.nodes, a.slow_node = 16.0, "2,4", False
    a.nodes = sorted({int(x) for x in a.nodes.split(",") if x})
    if a.backend_mbit is None:
        a.backend_mbit = 10 * a.frontend_mbit
    a.total_bytes = int(a.mib * C.MiB)
    a.slow_n = 4
    a.results = RESULTS
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    C.repo_on_path()
    from cloudckpt.testing.cluster.simulated import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"cluster benchmark skipped: {reason}")
        return 0
    if args.recovery:
        import _cluster_recovery

        return _cluster_recovery.main(args)
    bench = Bench(args)
    t0 = time.perf_counter()
    print(f"load average at start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    try:
        for n in args.nodes:
            print(f"\n== N = {n} ==", flush=True)
            bench.run_world(n, "uniform")
        if args.slow_node:
            print(f"\n== N = {args.slow_n}, one slow node ==", flush=True)
            bench.run_world(args.slow_n, "slow")
    except BaseException:
        traceback.print_exc()
        bench.failures.append(traceback.format_exc())
    finally:
        bench.report()
        os.makedirs(RESULTS, exist_ok=True)
        bench.save_json(args.json)
        if bench.records:
            plot(bench, args.figure)
    print(f"\ntotal wall {time.perf_counter() - t0:.1f} s")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
