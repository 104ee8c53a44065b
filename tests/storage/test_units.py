"""Pure parts of the storage layer: options, URLs, keys, range planning, backoff, error table,
byte budget, and LocalStore specifics."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.errors import (
    AccessDenied,
    BucketNotFound,
    ConfigError,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    RetriesExhausted,
    StorageError,
)
from cloudckpt.storage import (
    LocalStore,
    ObjectInfo,
    RetryOptions,
    S3Store,
    StorageOptions,
    StoreStats,
    open_store,
)
from cloudckpt.storage.base import ByteBudget, as_views, check_key, slice_views
from cloudckpt.storage.options import MiB, choose_part_size
from cloudckpt.storage.ranges import Scatter, plan_pieces
from cloudckpt.storage.retry import Retrier, Verdict
from cloudckpt.storage.s3.client import crc32c_b64
from cloudckpt.storage.s3.errors import TruncatedBody, classify
from cloudckpt.storage.urls import parse_s3_url


def test_storage_never_imports_torch():
    import subprocess

    code = (
        "import sys, cloudckpt.storage, cloudckpt.testing.faults.faultproxy; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_storage_modules_import_one_way_and_use_only_public_names():
    """No import cycle inside cloudckpt.storage (the package's own __init__ aside), and no
    module reaches into a private name of another object (``x._name`` with ``x`` not self)."""
    import ast
    from pathlib import Path

    import cloudckpt.storage as package

    folder = Path(package.__file__).parent
    graph, reaching = {}, []
    for path in folder.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        graph[".".join(path.relative_to(folder).with_suffix("").parts)] = {
            n.module.removeprefix("cloudckpt.storage.")
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("cloudckpt.storage.")
        }
        reaching += [
            f"{path.name}:{n.lineno} {ast.unparse(n)}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and n.attr.startswith("_")
            and not n.attr.startswith("__")
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
        ]
    assert {"s3.conn", "s3.read", "s3.write", "verified"} <= set(graph)
    assert reaching == []
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
        if module not in done:
            for dep in graph.get(module, ()):
                visit(dep, path + (module,))
            done.add(module)

    for module in graph:
        visit(module, ())


def test_options_hide_secrets_and_validate():
    opts = StorageOptions(access_key_id="AKID", secret_access_key="SECRET", session_token="TOK")
    assert "SECRET" not in repr(opts) and "TOK" not in repr(opts) and "AKID" in repr(opts)
    for bad in (
        dict(concurrency=0),
        dict(part_size=1 * MiB),
        dict(multipart_threshold=MiB),
        dict(access_key_id="only-half"),
        dict(prefix_spreading=-1),
        dict(conditional_create="maybe"),
    ):
        with pytest.raises(ConfigError):
            StorageOptions(**bad)
    with pytest.raises(ConfigError):
        RetryOptions(max_attempts=0)


def test_part_size_choice():
    assert choose_part_size(200 * MiB) == 16 * MiB
    assert choose_part_size(200 * MiB, 5 * MiB) == 5 * MiB
    huge = 1024 * 1024 * MiB  # 1 TiB needs bigger parts to stay within 10,000
    part = choose_part_size(huge)
    assert part % MiB == 0 and -(-huge // part) <= 10_000
    with pytest.raises(ConfigError):
        choose_part_size(6 * 1024 * 1024 * MiB * 10_000)


def test_urls_and_routing(tmp_path):
    assert parse_s3_url("s3://bucket") == ("bucket", "")
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b/")
    for bad in ("s3://", "s3://b", "s3://bucket/a/../b", "s3://bucket/a?x=1", "gs://bucket/x"):
        with pytest.raises(ConfigError):
            parse_s3_url(bad)
    assert isinstance(open_store("s3://bucket/run"), S3Store)
    assert open_store("s3://bucket/run/").url == "s3://bucket/run"
    local = open_store(str(tmp_path))
    assert isinstance(local, LocalStore) and local.url == tmp_path.as_uri()
    assert isinstance(open_store(tmp_path.as_uri()), LocalStore)
    assert open_store("file://localhost" + str(tmp_path)).root == tmp_path
    for bad in ("gs://bucket/x", "file://otherhost/x", "", "file:relative"):
        with pytest.raises(ConfigError):
            open_store(bad)


def test_keys_and_bodies():
    assert check_key("a/b.c") == "a/b.c"
    for bad in ("", "/a", "a/", "a//b", "a/./b", "..", "a\\b"):
        with pytest.raises(ConfigError):
            check_key(bad)
    views = as_views([b"abc", bytearray(b""), memoryview(b"defg")])
    assert [bytes(v) for v in views] == [b"abc", b"defg"]
    assert b"".join(bytes(v) for v in slice_views(views, 2, 5)) == b"cde"
    with pytest.raises(ConfigError):
        as_views([b"ok", 42])
    assert crc32c_b64(0x01020304) == "AQIDBA=="


def test_plan_pieces_coalesces_splits_and_skips_empty():
    offs, lens = [0, 100, 5000, 10_000_000, 50], [10, 10, 10, 3 * MiB, 0]
    pieces = plan_pieces(offs, lens, gap=1000, max_piece=MiB)
    assert [(p.start, p.end, p.members) for p in pieces[:2]] == [
        (0, 110, [0, 1]),
        (5000, 5010, [2]),
    ]
    big = pieces[2:]
    assert [(p.start, p.end) for p in big] == [
        (10_000_000 + i * MiB, 10_000_000 + (i + 1) * MiB) for i in range(3)
    ]
    assert plan_pieces(offs, lens, gap=10_000, max_piece=MiB)[0].members == [0, 1, 2]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3000)), max_size=12),
    st.integers(0, 600),
    st.integers(1, 1500),
)
def test_plan_pieces_covers_every_byte_of_every_range(spans, gap, max_piece):
    """Whatever the overlaps: each range's bytes are exactly covered by the pieces listing it,
    no piece is longer than ``max_piece`` (an earlier version attached a range that starts inside
    an earlier cut of a long range to a later cut, which never covered it)."""
    offs, lens = [o for o, _ in spans], [n for _, n in spans]
    pieces = plan_pieces(offs, lens, gap=gap, max_piece=max_piece)
    for i, (off, n) in enumerate(spans):
        covered = set()
        for p in pieces:
            if i in p.members:
                covered |= set(range(max(off, p.start), min(off + n, p.end)))
        assert covered == set(range(off, off + n))
    assert all(0 < p.end - p.start <= max_piece for p in pieces)


def test_scatter_feeds_overlapping_ranges_from_any_chunking():
    data = bytes(range(256)) * 4
    offs, lens = [10, 15, 100, 600], [20, 10, 300, 1]
    outs = [memoryview(bytearray(n)) for n in lens]
    (piece,) = plan_pieces(offs, lens, gap=1000, max_piece=10_000)
    scatter = Scatter(piece, offs, lens, outs)
    pos = piece.start
    for size in (1, 7, 64, 3, 1000):
        chunk = data[pos : min(pos + size, piece.end)]
        scatter.feed(chunk, pos)
        pos += len(chunk)
    assert [bytes(o) for o in outs] == [data[o : o + n] for o, n in zip(offs, lens)]


def _client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "Op",
    )


@pytest.mark.parametrize(
    "code,status,op,expected",
    [
        ("SlowDown", 503, "put", None),
        ("InternalError", 500, "get", None),
        ("", 502, "get", None),
        ("RequestTimeout", 400, "put", None),
        ("BadDigest", 400, "put", None),
        ("AccessDenied", 403, "get", AccessDenied),
        ("SignatureDoesNotMatch", 403, "put", AccessDenied),
        ("InvalidAccessKeyId", 403, "put", AccessDenied),
        ("403", 403, "head", AccessDenied),
        ("NoSuchKey", 404, "get", ObjectNotFound),
        ("404", 404, "head", ObjectNotFound),
        ("NoSuchBucket", 404, "list", BucketNotFound),
        ("PreconditionFailed", 412, "put", ObjectExists),
        ("PreconditionFailed", 412, "get", StorageError),
        ("InvalidRange", 416, "get", InvalidRange),
        ("MalformedXML", 400, "delete", StorageError),
    ],
)
def test_error_table(code, status, op, expected):
    verdict = classify(_client_error(code, status), op, "k", "s3://b/k")
    if expected is None:
        assert verdict.retry
    else:
        assert not verdict.retry and type(verdict.error) is expected
        assert verdict.error.key == "k" and verdict.error.operation == op


def test_transport_errors_are_retried():
    for exc in (
        EndpointConnectionError(endpoint_url="http://x"),
        ConnectionResetError(),
        TruncatedBody("short"),
        asyncio.TimeoutError(),
    ):
        assert classify(exc, "get", "k", "s3://b/k").retry
    assert classify(ValueError("bug"), "get", "k", "s3://b/k") == Verdict(False)


def _retrier(retry: RetryOptions, verdicts) -> tuple[Retrier, StoreStats]:
    stats = StoreStats()
    return Retrier(
        options=retry,
        stats=stats,
        slots=asyncio.Semaphore(2),
        classify=lambda exc, op, key, name: verdicts(exc),
    ), stats


def test_retrier_retries_then_succeeds_and_counts():
    async def main():
        retrier, stats = _retrier(
            RetryOptions(base_delay=0.001, max_delay=0.002), lambda exc: Verdict(True)
        )
        calls = []

        async def attempt(n):
            calls.append(n)
            if n < 3:
                raise ConnectionResetError()
            return "ok"

        assert await retrier.call("get", "k", attempt, where="s3://b") == "ok"
        assert calls == [1, 2, 3] and stats.requests == {"get": 3} and stats.retries == 2

    asyncio.run(main())


def test_retrier_never_retries_final_errors():
    async def main():
        retrier, stats = _retrier(
            RetryOptions(),
            lambda exc: Verdict(False, AccessDenied("denied", key="k", operation="get")),
        )

        async def attempt(n):
            raise RuntimeError("403")

        with pytest.raises(AccessDenied) as err:
            await retrier.call("get", "k", attempt, where="s3://b")
        assert isinstance(err.value.__cause__, RuntimeError) and stats.requests == {"get": 1}

    asyncio.run(main())


def test_retrier_caps_attempts_and_each_attempt():
    async def main():
        retrier, _ = _retrier(
            RetryOptions(max_attempts=4, base_delay=0.0, max_delay=0.0, attempt_timeout=0.01),
            lambda exc: Verdict(True),
        )

        async def hang(n):
            await asyncio.sleep(3600)

        with pytest.raises(RetriesExhausted) as err:
            await retrier.call("put", "k", hang, where="s3://b")
        assert err.value.attempts == 4 and isinstance(err.value.last_cause, TimeoutError)
        assert "put s3://b/k" in str(err.value)

    asyncio.run(main())


def test_retrier_counts_waits_against_the_operations_deadline():
    async def main():
        retrier, stats = _retrier(RetryOptions(deadline=0.2), lambda exc: Verdict(True))
        calls = []

        async def attempt(n):
            calls.append(n)

        # an operation whose earlier waits used up its deadline sends nothing more
        with pytest.raises(RetriesExhausted, match="deadline passed") as err:
            await retrier.call(
                "get", "k", attempt, where="s3://b", deadline=asyncio.get_running_loop().time() - 1
            )
        assert err.value.attempts == 0
        # both slots taken for longer than the deadline: the wait ends with it
        await retrier.slots.acquire()
        await retrier.slots.acquire()
        with pytest.raises(RetriesExhausted, match="waiting for a request slot"):
            await asyncio.wait_for(retrier.call("get", "k", attempt, where="s3://b"), 30)
        retrier.slots.release()
        budget = ByteBudget(10)
        await budget.acquire(10)
        with pytest.raises(RetriesExhausted, match="waiting for buffer memory"):
            await retrier.wait(
                budget.acquire(5),
                what="buffer memory",
                op="get",
                key="k",
                where="s3://b",
                deadline=retrier.deadline(),
            )
        assert budget.used == 10 and not budget._waiters  # the abandoned wait left no trace
        assert await retrier.call("get", "k", attempt, where="s3://b") is None
        assert calls == [1] and stats.requests == {"get": 1}

    asyncio.run(main())


def test_retrier_full_jitter_bounds(monkeypatch):
    seen = []
    monkeypatch.setattr(
        "cloudckpt.storage.retry.random.uniform", lambda a, b: seen.append((a, b)) or 0.0
    )

    async def main():
        retrier, _ = _retrier(
            RetryOptions(max_attempts=6, base_delay=0.1, max_delay=0.5), lambda exc: Verdict(True)
        )

        async def fail(n):
            raise ConnectionResetError()

        with pytest.raises(RetriesExhausted):
            await retrier.call("get", "k", fail, where="s3://b")

    asyncio.run(main())
    assert seen == [(0.0, 0.1), (0.0, 0.2), (0.0, 0.4), (0.0, 0.5), (0.0, 0.5)]


def test_byte_budget_clips_and_survives_cancellation():
    async def main():
        budget = ByteBudget(10)
        assert await budget.acquire(8) == 8
        waiter = asyncio.ensure_future(budget.acquire(5))
        cancelled = asyncio.ensure_future(budget.acquire(1))
        await asyncio.sleep(0)
        assert not waiter.done()
        cancelled.cancel()
        await asyncio.sleep(0)
        budget.release(8)
        assert await waiter == 5 and budget.used == 5
        budget.release(5)
        assert await budget.acquire(100) == 10 and budget.peak == 10  # clipped to the limit

    asyncio.run(asyncio.wait_for(main(), 5))


def test_byte_budget_try_acquire_never_waits_or_overtakes():
    async def main():
        budget = ByteBudget(10)
        assert budget.try_acquire(6) == 6 and budget.try_acquire(5) is None
        waiter = asyncio.ensure_future(budget.acquire(5))
        await asyncio.sleep(0)
        assert budget.try_acquire(1) is None  # someone is waiting: no overtaking
        budget.release(6)
        assert await waiter == 5 and budget.try_acquire(0) == 0

    asyncio.run(asyncio.wait_for(main(), 5))


def test_byte_budget_is_first_come_first_served():
    asyncio.run(asyncio.wait_for(_budget_order(), 5))


async def _budget_order():
    budget = ByteBudget(10)
    await budget.acquire(6)
    order = []

    async def take(n, name):
        await budget.acquire(n)
        order.append(name)

    big = asyncio.ensure_future(take(8, "big"))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(take(2, "small"))  # fits now, but must not overtake "big"
    await asyncio.sleep(0)
    assert order == []
    budget.release(6)
    await asyncio.gather(big, small)
    assert order == ["big", "small"]


def test_local_store_atomic_create_and_hidden_temp_files(tmp_path):
    store = LocalStore(tmp_path / "root", StorageOptions(fsync=True, concurrency=8))

    async def main():
        results = await asyncio.gather(
            *(store.put("m", bytes([i]) * 100_000, mode="create") for i in range(16)),
            return_exceptions=True,
        )
        assert sum(isinstance(r, ObjectInfo) for r in results) == 1
        assert sum(isinstance(r, ObjectExists) for r in results) == 15
        assert os.listdir(tmp_path / "root") == ["m"]  # no temp file left behind
        (tmp_path / "root" / ".x.cloudckpt-tmp-00000000deadbeef").write_bytes(b"crash")
        assert [x.key async for x in store.list()] == ["m"]
        assert [u.key for u in await store.list_uploads()] == ["x"]
        with pytest.raises(ConfigError):
            from cloudckpt.storage import UploadInfo

            await store.abort_upload(UploadInfo("x", "../../etc/passwd"))
        await store.put("d/e/f", b"1")
        await store.delete(["d/e/f"])
        assert not (tmp_path / "root" / "d").exists()  # empty directories pruned
        await store.close()

    asyncio.run(main())


def test_local_store_refuses_symlinks_leading_outside(tmp_path):
    from cloudckpt.errors import AccessDenied
    from cloudckpt.storage import ReadRange

    outside = tmp_path / "secret"
    outside.write_bytes(b"do not read")
    (tmp_path / "elsewhere").mkdir()
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    (root / "data" / "evil.bin").symlink_to(outside)
    (root / "escape").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "data" / "real.bin").write_bytes(b"fine")
    (root / "data" / "alias.bin").symlink_to(root / "data" / "real.bin")  # inside: followed

    async def main():
        store = LocalStore(root)
        for call in (
            lambda: store.get("data/evil.bin"),
            lambda: store.head("data/evil.bin"),
            lambda: store.read_ranges("data/evil.bin", [ReadRange(0, 4)]),
            lambda: store.put("escape/x", b"x"),
        ):
            with pytest.raises(AccessDenied, match="symlink"):
                await call()
        assert await store.get("data/alias.bin") == b"fine"
        assert [x.key async for x in store.list()] == ["data/alias.bin", "data/real.bin"]
        (tmp_path / "elsewhere" / "file").write_bytes(b"outside")
        assert [x async for x in store.list("escape/")] == []
        assert [x async for x in store.list("escape/", delimiter="/")] == []
        assert [x.prefix async for x in store.list(delimiter="/")] == ["data/"]
        (tmp_path / "elsewhere" / "file").unlink()
        assert not os.listdir(tmp_path / "elsewhere")
        await store.close()

    asyncio.run(main())


def test_held_range_verifies_out_of_order_parts_before_writing_sinks():
    from cloudckpt.checksum import crc32c
    from cloudckpt.storage import ReadRange
    from cloudckpt.storage.ranges import HeldRange

    data = os.urandom(1000)
    good, bad = bytearray(300), bytearray(b"\x01" * 300)
    held = HeldRange(
        ReadRange(
            0,
            1000,
            crc32c=crc32c(data),
            sinks=((100, memoryview(good)), (700, memoryview(bad)[:300])),
        )
    )
    held.add(600, data[600:])  # arrives first: a later piece
    assert held.ok is None and bytes(good) == bytes(300)  # nothing written before complete
    held[0:600] = memoryview(data)[:600]
    assert held.ok is True and held.actual == crc32c(data)
    assert bytes(good) == data[100:400] and bytes(bad) == data[700:1000]

    dest = bytearray(b"\x07" * 1000)
    wrong = HeldRange(ReadRange(0, 1000, crc32c=crc32c(data) ^ 1, sinks=((0, memoryview(dest)),)))
    wrong.add(0, data)
    assert wrong.ok is False and bytes(dest) == b"\x07" * 1000  # a failed range writes nothing


def test_local_store_cancelled_call_returns_after_its_thread(tmp_path):
    import threading
    import time

    finished = threading.Event()

    def slow():
        time.sleep(0.2)
        finished.set()

    async def main():
        store = LocalStore(str(tmp_path))
        task = asyncio.ensure_future(store._run("get", "k", slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return finished.is_set()

    assert asyncio.run(main())  # the thread was done before the cancellation was seen
