"""Local files: LocalStore never leaves its root, even while the tree changes under it, and
``cloudckpt export`` writes OUT through a fresh, exclusively created temporary file.

- Symlinks below the root are followed only while they stay inside it (relative, absolute, chains,
  directory links); any that leads outside is refused, loops fail cleanly, FIFOs are not objects.
- A race: another process swaps a directory of the store with a symlink to an outside directory
  (atomically, ``renameat2(RENAME_EXCHANGE)``) in a loop while reads, range reads, heads, writes,
  deletes and listings run: nothing outside the root is read, listed, written or deleted.
- Export: a failed export (corrupt block, an interrupt while writing) leaves no new file in the
  folder and an existing OUT as it was; symlinks planted at OUT.partial or at the temporary name
  cannot redirect the write.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import cloudckpt
from cloudckpt.errors import AccessDenied, ObjectNotFound, StorageError
from cloudckpt.storage import LocalStore, ReadRange
from tests.reliability.stores import RawCheckpoint, cli

SECRET = b"SECRET-OUTSIDE-THE-ROOT"
INSIDE = b"inside"


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture
def tree(tmp_path):
    """root/ with data/real.bin; outside/ with a secret file, an empty dir and a victim."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "data").mkdir(parents=True)
    (root / "data" / "real.bin").write_bytes(INSIDE)
    outside.mkdir()
    (outside / "secret.bin").write_bytes(SECRET)
    (outside / "real.bin").write_bytes(SECRET)
    (outside / "empty").mkdir()
    return root, outside


def _refused(store, key):
    async def main():
        for call in (
            lambda: store.get(key),
            lambda: store.head(key),
            lambda: store.read_ranges(key, [ReadRange(0, 3)]),
        ):
            with pytest.raises(AccessDenied, match="symlink"):
                await call()

    _run(main())


def test_links_inside_the_root_are_followed(tree):
    root, _ = tree
    (root / "data" / "rel.bin").symlink_to("real.bin")
    (root / "data" / "abs.bin").symlink_to(root / "data" / "real.bin")
    (root / "up").mkdir()
    (root / "up" / "back.bin").symlink_to("../data/./real.bin")
    (root / "chain.bin").symlink_to("up/back.bin")
    (root / "alias").symlink_to("data", target_is_directory=True)
    (root / "absdir").symlink_to(root / "data", target_is_directory=True)
    store = LocalStore(root)

    async def main():
        for key in (
            "data/rel.bin",
            "data/abs.bin",
            "up/back.bin",
            "chain.bin",
            "alias/real.bin",
            "absdir/rel.bin",
        ):
            assert await store.get(key) == INSIDE, key
            assert (await store.head(key)).size == len(INSIDE), key
            assert bytes((await store.read_ranges(key, [ReadRange(1, 3)]))[0]) == INSIDE[1:4]
        keys = [x.key async for x in store.list()]
        assert keys == [
            "chain.bin",
            "data/abs.bin",
            "data/real.bin",
            "data/rel.bin",
            "up/back.bin",
        ]  # linked directories are not descended
        assert [x.key async for x in store.list("alias/")] == [
            "alias/abs.bin",
            "alias/real.bin",
            "alias/rel.bin",
        ]
        await store.put("alias/new.bin", b"n")  # through a directory link inside the root
        await store.close()

    _run(main())
    assert (root / "data" / "new.bin").read_bytes() == b"n"


def test_a_root_reached_through_a_symlink_works(tree, tmp_path):
    root, _ = tree
    (tmp_path / "via").symlink_to(root, target_is_directory=True)
    (root / "data" / "abs.bin").symlink_to(tmp_path / "via" / "data" / "real.bin")
    store = LocalStore(tmp_path / "via")
    assert _run(store.get("data/abs.bin")) == INSIDE
    _run(store.put("x/y", b"1"))
    assert (root / "x" / "y").read_bytes() == b"1"


def test_links_leading_outside_are_refused(tree):
    root, outside = tree
    d = root / "data"
    (d / "dotdot.bin").symlink_to("../../outside/secret.bin")
    (d / "abs.bin").symlink_to(outside / "secret.bin")
    (d / "slash.bin").symlink_to("/")
    (d / "hop.bin").symlink_to("dotdot.bin")  # a chain ending outside
    (d / "sneaky.bin").symlink_to(f"../data/../../{outside.name}/secret.bin")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "escape_rel").symlink_to("../outside", target_is_directory=True)
    store = LocalStore(root)
    for key in (
        "data/dotdot.bin",
        "data/abs.bin",
        "data/hop.bin",
        "data/sneaky.bin",
        "escape/secret.bin",
        "escape_rel/secret.bin",
    ):
        _refused(store, key)
    with pytest.raises(AccessDenied):
        _run(store.get("data/slash.bin"))

    async def main():
        for key in ("escape/new.bin", "escape_rel/new.bin", "escape/empty/new.bin"):
            with pytest.raises(AccessDenied):
                await store.put(key, b"x")
        with pytest.raises(AccessDenied):
            await store.delete(["escape/secret.bin"])
        assert [x async for x in store.list("escape/")] == []
        assert [x async for x in store.list("escape_rel/", delimiter="/")] == []
        assert await store.list_uploads("escape/") == []
        # a child store whose directory is a link outside: refused as well
        child = store.child("escape")
        with pytest.raises(AccessDenied):
            await child.get("secret.bin")
        with pytest.raises(AccessDenied):
            await child.put("new.bin", b"x")
        await store.close()

    _run(main())
    assert sorted(os.listdir(outside)) == ["empty", "real.bin", "secret.bin"]
    assert (outside / "secret.bin").read_bytes() == SECRET


def test_link_loops_and_special_files_fail_cleanly(tree):
    root, _ = tree
    (root / "data" / "a").symlink_to("b")
    (root / "data" / "b").symlink_to("a")
    (root / "loopdir").symlink_to("loopdir", target_is_directory=True)
    os.mkfifo(root / "data" / "fifo")  # opening it for reading would block forever
    store = LocalStore(root)
    # liveness guard: should a read block on the FIFO, a writer's open and close soon releases it
    # (the read then returns b"" and the test fails instead of hanging)
    guard = threading.Timer(10.0, _release_fifo, args=(root / "data" / "fifo",))
    guard.daemon = True
    guard.start()

    async def main():
        for key in ("data/a", "loopdir/x"):
            with pytest.raises(StorageError) as info:
                await store.get(key)
            assert not isinstance(info.value, AccessDenied)
        for call in (
            lambda: store.get("data/fifo"),
            lambda: store.head("data/fifo"),
            lambda: store.read_ranges("data/fifo", [ReadRange(0, 1)]),
            lambda: store.get("data"),
        ):
            with pytest.raises(ObjectNotFound):
                await call()
        assert [x.key async for x in store.list("data/")] == ["data/real.bin"]
        await store.close()

    try:
        _run(main())
    finally:
        guard.cancel()


def _release_fifo(path) -> None:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_writes_and_deletes_of_a_link_name_touch_the_link_not_its_target(tree):
    root, outside = tree
    (root / "data" / "alias.bin").symlink_to("real.bin")
    (root / "data" / "out.bin").symlink_to(outside / "secret.bin")
    store = LocalStore(root)

    async def main():
        await store.put("data/alias.bin", b"new")  # replaces the link itself
        await store.delete(["data/out.bin"])  # removes the link, not the secret
        with pytest.raises(Exception):  # noqa: B017 - any refusal: the point is the file is kept
            await store.put("data/real.bin", b"again", mode="create")
        await store.close()

    _run(main())
    assert not (root / "data" / "alias.bin").is_symlink()
    assert (root / "data" / "alias.bin").read_bytes() == b"new"
    assert (root / "data" / "real.bin").read_bytes() == INSIDE
    assert not os.path.lexists(root / "data" / "out.bin")
    assert (outside / "secret.bin").read_bytes() == SECRET


# -- the race ------------------------------------------------------------------------------------

_SWAPPER = textwrap.dedent("""
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    a, b, n = sys.argv[1].encode(), sys.argv[2].encode(), int(sys.argv[3])
    print("ready", flush=True)
    for _ in range(n):
        if libc.renameat2(-100, a, -100, b, 2) != 0:   # AT_FDCWD, RENAME_EXCHANGE
            sys.exit(ctypes.get_errno())
        if os.path.exists(sys.argv[4]):
            break
""")


def _can_exchange(tmp_path) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        a, b = tmp_path / "xa", tmp_path / "xb"
        a.mkdir()
        b.symlink_to("xa")
        ok = libc.renameat2(-100, bytes(a), -100, bytes(b), 2) == 0
        return ok and b.is_dir() and not b.is_symlink() and a.is_symlink()
    except (AttributeError, OSError):
        return False


def test_a_directory_swapped_for_an_outside_link_never_leads_outside(tmp_path, figures):
    """Another process exchanges root/run/d (a real directory) with a symlink to an outside
    directory holding the same names, as fast as it can, while the store works on keys below
    run/d. Every answer is the inside content or a clean error; outside, nothing changes."""
    if not _can_exchange(tmp_path):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    root, outside = tmp_path / "root", tmp_path / "outside"
    d = root / "run" / "d"
    (d / "sub").mkdir(parents=True)
    (outside / "sub").mkdir(parents=True)
    (outside / "empty").mkdir()
    for name in ("obj", "victim", "sub/obj", "only-outside"):
        (outside / name).write_bytes(SECRET)
    (d / "obj").write_bytes(INSIDE)
    (d / "sub" / "obj").write_bytes(INSIDE)
    link = root / "run" / "d-link"
    link.symlink_to(outside, target_is_directory=True)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    stop = tmp_path / "stop"
    swapper = subprocess.Popen(
        [sys.executable, "-c", _SWAPPER, str(d), str(link), "200000", str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert swapper.stdout.readline().strip() == "ready"
    seen = {"inside": 0, "refused": 0, "missing": 0, "written": 0}

    async def main():
        store = LocalStore(root)
        for i in range(150):
            calls = [
                store.get("run/d/obj"),
                store.get("run/d/sub/obj"),
                store.read_ranges("run/d/obj", [ReadRange(0, len(INSIDE))]),
                store.head("run/d/sub/obj"),
                store.get("run/d/only-outside"),
                store.put(f"run/d/new-{i}", b"w"),
                store.put("run/d/victim", b"v"),
                store.delete(["run/d/victim", "run/d/empty/x", "run/d/sub/gone"]),
                _collect(store.list("run/d/")),
                _collect(store.list("run/", delimiter="/")),
                store.list_uploads("run/d/"),
            ]
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, AccessDenied):
                    seen["refused"] += 1
                elif isinstance(result, ObjectNotFound):
                    seen["missing"] += 1
                elif isinstance(result, BaseException):
                    raise result
                elif isinstance(result, (bytes, memoryview)):
                    assert bytes(result) == INSIDE
                    seen["inside"] += 1
                elif isinstance(result, list) and result and isinstance(result[0], memoryview):
                    assert bytes(result[0]) == INSIDE
                    seen["inside"] += 1
                elif isinstance(result, list):
                    for item in result:
                        name = getattr(item, "key", None) or getattr(item, "prefix", "")
                        assert "only-outside" not in name and "empty" not in name, name
                elif hasattr(result, "size") and result.key == "run/d/sub/obj":
                    assert result.size == len(INSIDE)
                    seen["inside"] += 1
                else:
                    seen["written"] += 1
        await store.close()

    try:
        _run(main())
    finally:
        stop.touch()
        swapper.wait(timeout=60)
    assert swapper.returncode == 0
    after = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    assert after == before  # nothing written or deleted
    assert (outside / "empty").is_dir() and (outside / "sub").is_dir()  # nothing pruned
    assert seen["inside"] > 0 and seen["written"] > 0
    figures.add("local swap race rounds", 150)
    figures.add("local swap race refusals", seen["refused"])
    figures.add("local swap race answers read inside", seen["inside"])


async def _collect(aiter):
    return [x async for x in aiter]


# -- export ---------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    url = str(tmp_path / "ck")
    cloudckpt.save(
        {"w": torch.arange(4096, dtype=torch.float32), "step": 5},
        url,
        options=cloudckpt.SaveOptions(checksum_block_size=1024),
    )
    return url


def _folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return out


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_writes_a_fresh_file_with_the_usual_mode(checkpoint, tmp_path, suffix):
    folder = _folder(tmp_path)
    (folder / f"model{suffix}.partial").symlink_to(tmp_path / "victim")  # planted: not followed
    res = cli(None, "export", checkpoint, str(folder / f"model{suffix}"))
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(folder)) == [f"model{suffix}", f"model{suffix}.partial"]
    assert not (tmp_path / "victim").exists()
    umask = os.umask(0)
    os.umask(umask)
    assert (folder / f"model{suffix}").stat().st_mode & 0o777 == 0o666 & ~umask


def test_export_onto_a_symlinked_out_replaces_the_link(checkpoint, tmp_path):
    folder = _folder(tmp_path)
    (tmp_path / "victim").write_bytes(b"keep")
    (folder / "model.pt").symlink_to(tmp_path / "victim")
    assert cli(None, "export", checkpoint, str(folder / "model.pt")).returncode == 0
    assert (tmp_path / "victim").read_bytes() == b"keep"
    assert not (folder / "model.pt").is_symlink()
    assert torch.equal(torch.load(folder / "model.pt")["w"], torch.arange(4096.0))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_failed_export_leaves_nothing_and_keeps_an_existing_out(checkpoint, tmp_path, suffix):
    folder = _folder(tmp_path)
    out = folder / f"model{suffix}"
    out.write_bytes(b"previous export")
    raw = RawCheckpoint(checkpoint)
    manifest = cloudckpt.read_manifest(checkpoint)
    raw.flip(manifest.objects[0], 2000)
    res = cli(None, "export", checkpoint, str(out))
    assert res.returncode == 1 and "crc32c mismatch" in res.stderr, res.stderr
    assert os.listdir(folder) == [out.name]
    assert out.read_bytes() == b"previous export"


@pytest.mark.parametrize("failure", ["interrupt", "disk full"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_failing_while_writing_removes_its_temporary_file(
    checkpoint, tmp_path, monkeypatch, suffix, failure
):
    import safetensors.torch

    from cloudckpt.cli import main as cli_module

    folder = _folder(tmp_path)
    out = folder / f"model{suffix}"
    out.write_bytes(b"previous export")

    def interrupted(*args, **kwargs):
        target = args[1]
        if hasattr(target, "write"):
            target.write(b"half a file")
        else:
            with open(target, "wb") as f:
                f.write(b"half a file")
        if failure == "interrupt":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", interrupted)
    monkeypatch.setattr(
        safetensors.torch,
        "serialize_file",
        lambda tensors, filename, metadata=None: interrupted(None, filename),
    )
    status = cli_module.main(["export", checkpoint, str(out)])
    assert status == (cli_module.EXIT_INTERRUPTED if failure == "interrupt" else 1)
    assert os.listdir(folder) == [out.name]
    assert out.read_bytes() == b"previous export"


def test_export_temporary_name_taken_by_a_planted_link_is_not_followed(
    checkpoint, tmp_path, monkeypatch
):
    from cloudckpt.cli import main as cli_module
    from cloudckpt.storage.local import files as local_files

    folder = _folder(tmp_path)
    planted, fresh = "0123456789abcdef", "fedcba9876543210"
    names = iter([planted, planted, fresh])
    monkeypatch.setattr(local_files, "_temp_token", lambda: next(names))
    (folder / f".model.pt.cloudckpt-tmp-{planted}").symlink_to(tmp_path / "victim")
    assert cli_module.main(["export", checkpoint, str(folder / "model.pt")]) == 0
    assert not (tmp_path / "victim").exists()
    assert sorted(os.listdir(folder)) == [f".model.pt.cloudckpt-tmp-{planted}", "model.pt"]
    assert torch.load(folder / "model.pt")["step"] == 5
