"""Throughput of S3Store against the local SeaweedFS, next to the loops a user would write by hand.

For 1 GiB laid out as 16 x 64 MiB and as 256 x 4 MiB objects it measures put and get of:
- ``boto3 single``: one boto3 client, one object after another (the plain baseline);
- ``raw aiobotocore``: ``asyncio.gather`` of put_object / get_object under a semaphore, at several
  concurrencies; gets also as 16 MiB ranged GETs streamed into the destination; the best of these
  is the ``raw best`` the store is compared with;
- ``S3Store``: ``store.put`` of memoryviews of the source; gets as ``read_ranges`` into a
  preallocated destination (what the checkpoint reader does) and as ``get()``; at its default
  concurrency (16) and at the raw loops' concurrencies.

Each figure is the best of ``--reps`` runs (variants rotate between runs, because other load on a
small machine moves single runs by 2x). Also shown: client and server (weed) CPU seconds per GiB,
and peak memory: the process's high-water RSS during a phase minus the RSS before it (the 1 GiB
source and the 1 GiB destination are allocated beforehand). It starts its own SeaweedFS.

    python benchmarks/storage.py [--reps 3] [--concurrency 4,8,16] [--layouts 16x64,256x4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cloudckpt.storage import ReadRange, StorageOptions, open_store
from cloudckpt.testing.servers.seaweed.server import S3Server

MiB = 1024 * 1024


# --- memory -------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRSS:
    """High-water RSS of one phase: resets the kernel's VmHWM (clear_refs 5) where allowed, and
    also samples VmRSS every 5 ms as a fallback."""

    def __enter__(self) -> PeakRSS:
        self.start = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_ok = True
        except OSError:
            self.hwm_ok = False
        self.sampled = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.sampled = max(self.sampled, _status_kib("VmRSS"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        peak = max(self.sampled, _status_kib("VmHWM") if self.hwm_ok else 0)
        self.extra_mib = max(0, peak - self.start) / 1024
        self.peak_mib = peak / 1024


# --- loops ----------------------------------------------------------------------------------------


def boto3_single(client, info, keys, views, dest_views, op: str) -> None:
    if op == "put":
        for k, v in zip(keys, views):
            client.put_object(Bucket=info.bucket, Key=k, Body=bytes(v))
    else:
        for k, d in zip(keys, dest_views):
            body = client.get_object(Bucket=info.bucket, Key=k)["Body"]
            pos = 0
            for chunk in body.iter_chunks(1 << 20):
                d[pos : pos + len(chunk)] = chunk
                pos += len(chunk)


def _aio_client(info, concurrency):
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    config = AioConfig(
        max_pool_connections=concurrency,
        s3={"addressing_style": "path", "payload_signing_enabled": False},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"total_max_attempts": 3},
    )
    return get_session().create_client(
        "s3",
        endpoint_url=info.endpoint_url,
        region_name=info.region,
        config=config,
        aws_access_key_id=info.access_key,
        aws_secret_access_key=info.secret_key,
    )


async def raw_loop(info, keys, views, dest_views, op: str, concurrency: int, mode: str):
    """One raw aiobotocore run: (seconds, client CPU seconds), client set up before the clocks."""
    async with _aio_client(info, concurrency) as client:
        await client.list_objects_v2(Bucket=info.bucket, MaxKeys=1)
        sem = asyncio.Semaphore(concurrency)

        async def put(k, v):
            async with sem:
                # aiobotocore wants bytes (or a file): a memoryview is not accepted as a body.
                await client.put_object(Bucket=info.bucket, Key=k, Body=bytes(v))

        async def get_whole(k, d):
            async with sem:
                resp = await client.get_object(Bucket=info.bucket, Key=k)
                data = await resp["Body"].read()
                d[: len(data)] = data

        async def get_range(k, d, start, stop):
            async with sem:
                resp = await client.get_object(
                    Bucket=info.bucket, Key=k, Range=f"bytes={start}-{stop - 1}"
                )
                content = resp["Body"].raw_stream.content
                pos = start
                while True:
                    chunk = await content.readany()
                    if not chunk:
                        break
                    d[pos : pos + len(chunk)] = chunk
                    pos += len(chunk)

        t0, c0 = time.perf_counter(), time.process_time()
        if op == "put":
            await asyncio.gather(*(put(k, v) for k, v in zip(keys, views)))
        elif mode == "whole":
            await asyncio.gather(*(get_whole(k, d) for k, d in zip(keys, dest_views)))
        else:
            piece = 16 * MiB
            await asyncio.gather(
                *(
                    get_range(k, d, s, min(s + piece, len(d)))
                    for k, d in zip(keys, dest_views)
                    for s in range(0, len(d), piece)
                )
            )
        return time.perf_counter() - t0, time.process_time() - c0


async def store_loop(info, keys, views, dest_views, op: str, options: StorageOptions, mode: str):
    """One S3Store run: (seconds, client CPU seconds), store opened before the clocks."""
    store = open_store(info.url("bench"), options)
    try:
        async for _ in store.list("warmup/"):
            pass
        rel = [k[len("bench/") :] for k in keys]
        t0, c0 = time.perf_counter(), time.process_time()
        if op == "put":
            await asyncio.gather(*(store.put(k, v) for k, v in zip(rel, views)))
        elif mode == "read_ranges":
            await asyncio.gather(
                *(
                    store.read_ranges(k, [ReadRange(0, len(d), out=d)])
                    for k, d in zip(rel, dest_views)
                )
            )
        else:

            async def get(k):
                return len(await store.get(k))

            await asyncio.gather(*(get(k) for k in rel))
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        await store.close()


# --- driver ---------------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _variants(concurrencies, store_default):
    """(name, op, concurrency, kind, mode) of every measured loop."""
    out = [("boto3 single", "put", 1, "boto3", ""), ("boto3 single", "get", 1, "boto3", "")]
    for c in concurrencies:
        out.append((f"raw aiobotocore c={c}", "put", c, "raw", ""))
        out.append((f"raw aiobotocore c={c} whole", "get", c, "raw", "whole"))
        out.append((f"raw aiobotocore c={c} 16MiB ranges", "get", c, "raw", "ranges"))
    for c in sorted(set(concurrencies) | {store_default}):
        tag = f"c={c}" + (" (default)" if c == store_default else "")
        out.append((f"S3Store put {tag}", "put", c, "store", ""))
        out.append((f"S3Store read_ranges {tag}", "get", c, "store", "read_ranges"))
    out.append((f"S3Store get() c={store_default}", "get", store_default, "store", "get"))
    return out


def _run_variant(info, variant, keys, views, dviews, options) -> tuple[float, float]:
    _, op, c, kind, mode = variant
    if kind == "boto3":
        client = info.boto3_client()
        client.list_objects_v2(Bucket=info.bucket, MaxKeys=1)
        t0, c0 = time.perf_counter(), time.process_time()
        boto3_single(client, info, keys, views, dviews, op)
        return time.perf_counter() - t0, time.process_time() - c0
    if kind == "raw":
        return asyncio.run(raw_loop(info, keys, views, dviews, op, c, mode))
    import dataclasses

    return asyncio.run(
        store_loop(info, keys, views, dviews, op, dataclasses.replace(options, concurrency=c), mode)
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="runs of each variant (best kept)")
    parser.add_argument(
        "--concurrency",
        default="4,8,16",
        help="concurrencies of the raw loops (and of the store, for comparison)",
    )
    parser.add_argument("--layouts", default="16x64,256x4", help="COUNTxMIB,...")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
    total = max(n * m for n, m in layouts) * MiB
    defaults = StorageOptions()

    source = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dest = np.ones(total, dtype=np.uint8)
    table: list[tuple] = []
    server = S3Server(bucket="cloudckpt-bench")
    info = server.start()
    try:
        options = StorageOptions(
            endpoint_url=info.endpoint_url,
            region=info.region,
            access_key_id=info.access_key,
            secret_access_key=info.secret_key,
        )
        for count, size_mib in layouts:
            size = size_mib * MiB
            gib = count * size / (1 << 30)
            layout = f"{count} x {size_mib} MiB"
            keys = [f"bench/{count}x{size_mib}/obj-{i:04d}" for i in range(count)]
            views = [memoryview(source[i * size : (i + 1) * size]) for i in range(count)]
            dviews = [memoryview(dest[i * size : (i + 1) * size]) for i in range(count)]
            variants = _variants(concurrencies, defaults.concurrency)
            results: dict[str, dict] = {}
            for rep in range(args.reps):
                # puts first (gets need the objects), each group in a rotated order per rep
                for op in ("put", "get"):
                    group = [v for v in variants if v[1] == op]
                    shift = rep % len(group)
                    for variant in group[shift:] + group[:shift]:
                        name = variant[0]
                        if op == "get":
                            dest[:] = 0
                        server0 = _cpu_seconds(server.pid)
                        with PeakRSS() as mem:
                            seconds, client_cpu = _run_variant(
                                info, variant, keys, views, dviews, options
                            )
                        client_cpu /= gib
                        server_cpu = (_cpu_seconds(server.pid) - server0) / gib
                        if op == "get" and variant[4] != "get":
                            if not np.array_equal(dest[: count * size], source[: count * size]):
                                raise SystemExit(f"{name}: read back wrong bytes")
                        rate = count * size / MiB / seconds
                        r = results.setdefault(
                            (name, op),
                            {"op": op, "rate": 0.0, "extra": 0.0, "client": [], "server": []},
                        )
                        r["rate"] = max(r["rate"], rate)
                        r["client"].append(client_cpu)
                        r["server"].append(server_cpu)
                        r["extra"] = max(r["extra"], mem.extra_mib)
                        print(
                            f"  [{layout} rep {rep}] {op} {name:40s} {rate:8.1f} MiB/s  "
                            f"cpu client {client_cpu:4.2f} server {server_cpu:4.2f} s/GiB  "
                            f"+{mem.extra_mib:6.1f} MiB",
                            flush=True,
                        )
            for op in ("put", "get"):
                names = [n for (n, o) in results if o == op]
                raw_best = max(
                    (n for n in names if n.startswith("raw")),
                    key=lambda n: results[(n, op)]["rate"],
                )
                raw = results[(raw_best, op)]
                raw_cpu = _median(raw["client"]) + _median(raw["server"])
                mine = [n for n in names if n.startswith("S3")]
                store_best = max(mine, key=lambda n: results[(n, op)]["rate"])
                shown = ["boto3 single", raw_best] + [
                    n for n in mine if "(default)" in n or n == store_best or "get()" in n
                ]
                for name in dict.fromkeys(shown):
                    r = results[(name, op)]
                    client, srv = _median(r["client"]), _median(r["server"])
                    table.append(
                        (
                            layout,
                            op,
                            name,
                            r["rate"],
                            r["rate"] / raw["rate"],
                            client,
                            srv,
                            raw_cpu / (client + srv),
                            r["extra"],
                        )
                    )
    finally:
        server.stop()
    print()
    print(
        f"{'layout':13s} {'op':4s} {'variant':38s} {'MiB/s':>7s} {'x raw':>6s} "
        f"{'client':>7s} {'server':>7s} {'x raw':>6s} {'peak':>7s}"
    )
    print(
        f"{'':13s} {'':4s} {'':38s} {'best':>7s} {'wall':>6s} "
        f"{'cpu s/GiB':>15s} {'cpu':>6s} {'+MiB':>7s}"
    )
    for layout, op, name, rate, ratio, client, srv, cpu_ratio, extra in table:
        print(
            f"{layout:13s} {op:4s} {name:38s} {rate:7.1f} {ratio:6.2f} {client:7.2f} "
            f"{srv:7.2f} {cpu_ratio:6.2f} {extra:7.1f}"
        )
    print(
        f"\nMiB/s: best of {args.reps} runs. 'x raw wall' = that / the best raw aiobotocore "
        f"parallel loop of the same layout and op. cpu: median client / server (weed) CPU "
        f"seconds per GiB; 'x raw cpu' = (raw best's client+server cpu) / (this row's): the "
        f"throughput ratio when the machine's cores are the bottleneck, robust to other load. "
        f"'peak +MiB': high-water RSS during the phase minus RSS before it (worst run). "
        f"Process high-water RSS: {_status_kib('VmHWM') / 1024:.0f} MiB (the source and "
        f"destination arrays hold {2 * total / MiB:.0f} MiB)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
