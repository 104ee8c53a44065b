"""Shared helpers of the end-to-end benchmarks (not part of the library).

- `repo_on_path()`: make `import cloudckpt` work when a script is run as `python benchmarks/x.py`.
- `start_server()`: one local SeaweedFS with credentials
  (cloudckpt.testing.servers.seaweed.server.S3Server).
- `Meter`: wall seconds, process CPU seconds (every thread of this process: user + system) and
  RSS figures of one measured step. Peak RSS is the kernel's VmHWM, reset before the step by
  writing 5 to /proc/self/clear_refs (Linux >= 4.0); when the reset is refused the peak is the
  process's lifetime peak and `Measure.hwm_reset` is False.
- `proc_cpu_seconds(pid)`: CPU seconds used so far by another process (the server).
- Raw S3 transfers with aiobotocore (`raw_put`, `raw_get`, or `RawSession` to keep one client
  across calls): `concurrency` requests in flight,
  bodies sent from and received into caller buffers without a whole-body copy; the cheapest
  request settings (no payload signing, no checksums): the reference a checkpoint library is
  measured against.
- `s3_prefix_usage` / `s3_delete_prefix` / `dir_usage`: what a method left in the store.
- `PhaseClock`: wall clock of each protocol phase of a process (`--phases` of fresh_calls.py).
- `Table`, `fmt_*`, `ratio_line`: plain-text tables and `measured / baseline` PASS/MISS lines.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
REPO_ROOT = Path(__file__).resolve().parents[1]


def repo_on_path() -> None:
    """Put the repository root on sys.path (the scripts run from a checkout, not an install)."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(1, root)


# -- server ---------------------------------------------------------------------------------------


def start_server(bucket: str = "bench"):
    """Start one SeaweedFS S3 endpoint with credentials; returns the S3Server (`.info`, `.pid`,
    `.stop()`)."""
    repo_on_path()
    from cloudckpt.testing.servers.seaweed.server import S3Server

    server = S3Server(bucket=bucket)
    server.start()
    return server


def warm_up_server(info, nbytes: int = 64 * MiB, prefix: str = "warmup/") -> None:
    """PUT, GET and delete `nbytes` once, so that no measured step pays for the server's first
    volume allocations."""
    import numpy as np

    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    objects = cut_objects(prefix, [[(memoryview(data), nbytes)]], 16 * MiB)
    raw_put(info, objects)
    raw_get(info, objects)
    s3_delete_prefix(info, prefix)


def proc_cpu_seconds(pid: int | None) -> float:
    """utime + stime of process `pid` (all its threads), in seconds; 0.0 if unknown."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # fields 14, 15 of stat(5)


# -- memory and CPU of this process ---------------------------------------------------------------


def rss_bytes() -> int:
    from cloudckpt.testing.memory import current_rss

    return current_rss()


def peak_rss_bytes() -> int:
    """VmHWM (peak RSS since start or the last reset); ru_maxrss if /proc is unavailable."""
    from cloudckpt.testing.memory import peak_rss

    return peak_rss()


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS. False when the kernel refuses (then peaks are lifetime)."""
    from cloudckpt.testing.memory import reset_high_water_mark

    return reset_high_water_mark()


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class Measure:
    """One measured step of one process."""

    seconds: float = 0.0
    cpu: float = 0.0
    rss_before: int = 0
    peak_rss: int = 0
    hwm_reset: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def rss_growth(self) -> int:
        """Peak RSS during the step minus RSS just before it."""
        return max(0, self.peak_rss - self.rss_before)


class Meter:
    """`with Meter() as m: step()` fills `m.result` (a Measure)."""

    def __enter__(self) -> Meter:
        self.result = Measure()
        self.result.hwm_reset = reset_peak_rss()
        self.result.rss_before = rss_bytes()
        self._cpu = cpu_seconds()
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.result.seconds = time.perf_counter() - self._t
        self.result.cpu = cpu_seconds() - self._cpu
        self.result.peak_rss = peak_rss_bytes()


# -- raw S3 transfers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RawObject:
    """One object of a raw transfer: its key and the buffers (uint8 memoryviews) it is made of,
    in order. On PUT the body is their concatenation; on GET the body is scattered over them."""

    key: str
    parts: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)


def _raw_client(info, concurrency: int):
    from aiobotocore.config import AioConfig
    from aiobotocore.session import AioSession

    config = AioConfig(
        max_pool_connections=concurrency,
        s3={"addressing_style": "path", "payload_signing_enabled": False},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        parameter_validation=False,  # lets a memoryview be the body (no copy)
        retries={"total_max_attempts": 3},
    )
    return AioSession().create_client(
        "s3",
        endpoint_url=info.endpoint_url,
        aws_access_key_id=info.access_key,
        aws_secret_access_key=info.secret_key,
        region_name=info.region,
        config=config,
    )


async def _put_with(client, bucket: str, objects: Sequence[RawObject], concurrency: int) -> int:
    sem = asyncio.Semaphore(concurrency)

    async def put(obj: RawObject) -> int:
        async with sem:
            body = obj.parts[0] if len(obj.parts) == 1 else b"".join(obj.parts)
            await client.put_object(Bucket=bucket, Key=obj.key, Body=body)
            return len(body)

    return sum(await asyncio.gather(*(put(o) for o in objects)))


async def _get_with(client, bucket: str, objects: Sequence[RawObject], concurrency: int) -> int:
    sem = asyncio.Semaphore(concurrency)

    async def get(obj: RawObject) -> int:
        async with sem:
            resp = await client.get_object(Bucket=bucket, Key=obj.key)
            body = resp["Body"]
            parts = list(obj.parts)
            index, pos, total = 0, 0, 0
            while True:
                chunk = await body.read(1 << 20)
                if not chunk:
                    break
                view = memoryview(chunk)
                total += len(view)
                while view:
                    target = parts[index]
                    n = min(len(view), len(target) - pos)
                    target[pos : pos + n] = view[:n]
                    view = view[n:]
                    pos += n
                    if pos == len(target):
                        index, pos = index + 1, 0
            if total != obj.nbytes:
                raise OSError(f"raw GET {obj.key}: {total} bytes, expected {obj.nbytes}")
            return total

    return sum(await asyncio.gather(*(get(o) for o in objects)))


async def _raw_put(info, bucket: str, objects: Sequence[RawObject], concurrency: int) -> int:
    async with _raw_client(info, concurrency) as client:
        return await _put_with(client, bucket, objects, concurrency)


async def _raw_get(info, bucket: str, objects: Sequence[RawObject], concurrency: int) -> int:
    async with _raw_client(info, concurrency) as client:
        return await _get_with(client, bucket, objects, concurrency)


class RawSession:
    """Raw transfers through one client kept across calls (on its own event loop): repeated
    measured steps pay no client creation or connection setup. `put` / `get` as `raw_put` /
    `raw_get`; `close()` when done."""

    def __init__(self, info, *, concurrency: int = 16):
        self.info, self.concurrency = info, concurrency
        self.loop = asyncio.new_event_loop()
        self._cm = _raw_client(info, concurrency)
        self.client = self.loop.run_until_complete(self._cm.__aenter__())

    def put(self, objects: Sequence[RawObject], *, bucket: str | None = None) -> int:
        return self.loop.run_until_complete(
            _put_with(self.client, bucket or self.info.bucket, objects, self.concurrency)
        )

    def get(self, objects: Sequence[RawObject], *, bucket: str | None = None) -> int:
        return self.loop.run_until_complete(
            _get_with(self.client, bucket or self.info.bucket, objects, self.concurrency)
        )

    def close(self) -> None:
        self.loop.run_until_complete(self._cm.__aexit__(None, None, None))
        self.loop.close()


def raw_put(
    info, objects: Sequence[RawObject], *, bucket: str | None = None, concurrency: int = 16
) -> int:
    """PUT every object (`concurrency` in flight); returns the bytes sent."""
    return asyncio.run(_raw_put(info, bucket or info.bucket, objects, concurrency))


def raw_get(
    info, objects: Sequence[RawObject], *, bucket: str | None = None, concurrency: int = 16
) -> int:
    """GET every object into its parts (`concurrency` in flight); returns the bytes received."""
    return asyncio.run(_raw_get(info, bucket or info.bucket, objects, concurrency))


def cut_objects(
    key_prefix: str, groups, object_size: int, scratch: memoryview | None = None
) -> list[RawObject]:
    """Cut byte streams into objects of `object_size` bytes named `<key_prefix><n>`.

    `groups` is a list of streams, each a list of `(view, length)` segments; streams never share
    an object (the last object of each may be shorter) and `n` counts over all of them. Objects
    inside one segment are zero-copy views. A segment whose view is None is not needed by this
    process: its bytes land in `scratch` (GET), and objects made only of such segments are left
    out (their numbers are still used up)."""
    objects: list[RawObject] = []
    n_obj = 0
    for group in groups:
        index, pos = 0, 0
        while index < len(group):
            parts, need, filled = [], False, 0
            while filled < object_size and index < len(group):
                view, length = group[index]
                n = min(length - pos, object_size - filled)
                need |= view is not None
                parts.append(
                    view[pos : pos + n] if view is not None else scratch[filled : filled + n]
                )
                filled += n
                pos += n
                if pos == length:
                    index, pos = index + 1, 0
            if need:
                objects.append(RawObject(f"{key_prefix}{n_obj}", tuple(parts)))
            n_obj += 1
    return objects


# -- what a method left behind ---------------------------------------------------------------------


def s3_prefix_usage(info, prefix: str, *, bucket: str | None = None) -> tuple[int, int]:
    """(bytes, objects) stored under `prefix`."""
    client = info.boto3_client()
    total = count = 0
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket or info.bucket, Prefix=prefix
    ):
        for obj in page.get("Contents", ()):
            total += obj["Size"]
            count += 1
    return total, count


def s3_delete_prefix(info, prefix: str, *, bucket: str | None = None) -> None:
    client = info.boto3_client()
    bucket = bucket or info.bucket
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [{"Key": o["Key"]} for o in page.get("Contents", ())]
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})


def dir_usage(path: str) -> tuple[int, int]:
    """(bytes, files) under a directory."""
    total = count = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
            count += 1
    return total, count


def remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- printing --------------------------------------------------------------------------------------


def fmt_mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f}"


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def fmt_rate(nbytes: float | None, seconds: float | None) -> str:
    if not nbytes or not seconds:
        return "-"
    return f"{nbytes / 1e6 / seconds:,.0f}"


class Table:
    """Rows of strings printed with aligned columns (first column left, the rest right)."""

    def __init__(self, headers: Sequence[str]):
        self.headers = list(headers)
        self.rows: list[list[str]] = []

    def add(self, *cells) -> None:
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        widths = [
            max(len(r[i]) for r in [self.headers] + self.rows) for i in range(len(self.headers))
        ]

        def line(cells):
            return "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
            )

        out = [line(self.headers), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.rows]
        return "\n".join(out)


def ratio_line(
    label: str,
    measured: float | None,
    baseline: float | None,
    limit: float,
    *,
    at_most: bool = True,
    measured_name: str = "",
    baseline_name: str = "",
) -> tuple[str, bool | None]:
    """`label: measured / baseline = r (target <= limit) PASS|MISS`. Returns (text, passed);
    passed is None when a figure is missing."""
    names = f" [{measured_name} / {baseline_name}]" if measured_name else ""
    if not measured or not baseline:
        return f"{label}: n/a (a figure is missing){names}", None
    r = measured / baseline
    ok = r <= limit if at_most else r >= limit
    sign = "<=" if at_most else ">="
    return (
        f"{label}: {measured:.3f} / {baseline:.3f} = {r:.3f}  (target {sign} {limit:g})  "
        f"{'PASS' if ok else 'MISS'}{names}"
    ), ok


def print_targets(lines: Sequence[tuple[str, bool | None]]) -> None:
    for text, _ in lines:
        print("  " + text)
    passed = sum(1 for _, ok in lines if ok)
    missed = sum(1 for _, ok in lines if ok is False)
    na = sum(1 for _, ok in lines if ok is None)
    print(f"  => {passed} PASS, {missed} MISS, {na} n/a")


def tensor_bytes_view(tensor) -> memoryview:
    """A flat uint8 memoryview over a contiguous CPU tensor's storage (no copy)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        raise ValueError("tensor must be contiguous")
    import torch

    return memoryview(flat.view(torch.uint8).numpy())


def describe_machine() -> str:
    import platform

    return (
        f"{platform.node()} | {os.cpu_count()} cpus | {platform.python_version()} | "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}"
    )


def now_stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def human_bool(flag: bool | None) -> str:
    return {True: "ok", False: "BAD", None: "-"}[flag]


class PhaseClock:
    """Wall clock of each protocol phase of this process (``cloudckpt.transport.Phase``, wrapped
    once per instance: make one per process): ``marks`` holds ``(what, entered, work done,
    exchange done)`` perf_counter seconds of each phase since :meth:`start`; :meth:`line` says
    each phase's own work and its closing exchange in ms from the call's start, with what comes
    before the first phase (the join) and after the last one (fresh_calls.py ``--phases``,
    _interop_trace.py)."""

    def __init__(self):
        from cloudckpt.transport import Phase

        self.marks: list[tuple[str, float, float, float]] = []
        clock, enter, leave = self, Phase.__enter__, Phase.__exit__

        def timed_enter(phase):
            phase._clock_in = time.perf_counter()
            return enter(phase)

        def timed_exit(phase, *exc):
            out_at = time.perf_counter()
            try:
                return leave(phase, *exc)
            finally:
                clock.marks.append((phase.what, phase._clock_in, out_at, time.perf_counter()))

        Phase.__enter__, Phase.__exit__ = timed_enter, timed_exit

    def start(self, at: float) -> None:
        self.marks, self.at = [], at

    def line(self, end: float) -> str:
        ms = lambda t: 1000 * (t - self.at)  # noqa: E731
        first = self.marks[0][1] if self.marks else end
        parts = [f"before {ms(first):.1f}"]
        for what, a, b, c in self.marks:
            parts.append(f"{what} {ms(b) - ms(a):.1f} + exchange {ms(c) - ms(b):.1f}")
        last = self.marks[-1][3] if self.marks else end
        parts.append(f"after {ms(end) - ms(last):.1f} (ms)")
        return "; ".join(parts)


def run_section(title: str, fn: Callable[[], None]) -> None:
    print(f"\n== {title} ==", flush=True)
    fn()
