"""What keeps a folder's objects (``run_refs.folder_references``) and the clean-ups built on it, on
a LocalStore run made by real saves (one process): committed references keep exactly their keys,
a pin of a running save keeps everything until its lease is over, new pins seen while judging
are judged too, damaged referrers keep everything, and stale pins are swept."""

from __future__ import annotations

import time

import torch

import cloudckpt
from cloudckpt import SaveOptions
from cloudckpt.layout import Pin, encode_pin, pin_key
from cloudckpt.runs.cleanup import plan_abandoned, sweep_pins
from cloudckpt.runs.refs import folder_references
from cloudckpt.runtime.loop import run_coroutine
from cloudckpt.storage import open_store

A = "00000000000000aa"


def _state(version: int) -> dict:
    return {"frozen": torch.arange(4096.0), "trained": torch.full((512,), float(version))}


def _run(tmp_path):
    """Folders a (full, hashed) and b (base a: references a's frozen tensor)."""
    opts = SaveOptions(object_size=8 << 10, content_hashes=True)
    cloudckpt.save(_state(1), str(tmp_path / "a"), options=opts)
    cloudckpt.save(_state(2), str(tmp_path / "b"), base=str(tmp_path / "a"), options=opts)
    return open_store(str(tmp_path))


def _refs(store, folder, **kw):
    return run_coroutine(folder_references(store, folder, **kw))


def _pin(store, home, folder, attempt=A, lease=60.0):
    key = f"{home}/{pin_key(attempt, folder)}"
    run_coroutine(store.put(key, encode_pin(Pin(folder, attempt, lease))))
    return key


def test_committed_references_keep_exactly_their_keys(tmp_path):
    store = _run(tmp_path)
    b = cloudckpt.read_manifest(str(tmp_path / "b"))
    used = {k for h, k in zip(b.object_homes, b.objects) if h == "a"}
    refs = _refs(store, "a")
    assert used and refs.keys == used and not refs.pinned and refs.referrers == ("b",)
    assert _refs(store, "b").keys == frozenset()  # nothing references b


def test_a_pin_of_a_save_not_committed_keeps_everything_until_its_lease_is_over(tmp_path):
    store = _run(tmp_path)
    key = _pin(store, "a", "c", lease=60.0)
    assert _refs(store, "a").pinned
    assert _refs(store, "a", now=time.time() + 30).pinned
    later = _refs(store, "a", now=time.time() + 61)
    assert not later.pinned and later.stale_pins == (key[2:],)
    # a pin of another attempt than the one committed in its folder: the lease decides too
    other = _pin(store, "a", "b", attempt="00000000000000bb")
    assert _refs(store, "a").pinned
    assert other[2:] in _refs(store, "a", now=time.time() + 61).stale_pins
    # a key under pins/ that is not a pin is nobody's business
    run_coroutine(store.put("a/pins/notes.txt", b"x"))
    assert "pins/notes.txt" not in _refs(store, "a", now=time.time() + 61).stale_pins


def test_a_damaged_referrer_keeps_everything(tmp_path):
    store = _run(tmp_path)
    (tmp_path / "b" / "manifest.msgpack").write_bytes(b"\xc1ckpt\r\n\x1a garbage")
    assert _refs(store, "a").pinned


class _PinsAppear:
    """A LocalStore whose first listing of ``a/pins/`` is followed by a new pin (a save pinning
    while a deleter judges)."""

    def __init__(self, store):
        self.store, self.listed = store, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    async def _list(self, prefix):
        async for item in self.store.list(prefix):
            yield item
        if prefix == "a/pins/":
            self.listed += 1
            if self.listed == 1:
                key = f"a/{pin_key(A, 'late')}"
                await self.store.put(key, encode_pin(Pin("late", A, 600.0)))

    def list(self, prefix, delimiter=None):
        return self._list(prefix)


def test_a_pin_written_while_judging_is_judged_too(tmp_path):
    store = _PinsAppear(_run(tmp_path))
    refs = run_coroutine(folder_references(store, "a"))
    assert refs.pinned and store.listed == 3  # listed until no new pin appeared


def test_an_abandoned_folder_is_collected_whatever_the_age_of_its_pins(tmp_path):
    store = _run(tmp_path)
    run_coroutine(store.delete(["b/manifest.msgpack"]))  # b uncommitted: a is unreferenced
    (tmp_path / "a" / "manifest.msgpack").unlink()
    stale = _pin(store, "a", "b", attempt="00000000000000bb", lease=60.0)
    uploads = run_coroutine(store.list_uploads("a/"))
    later = time.time() + 3600
    plan = run_coroutine(plan_abandoned(store, "a/", uploads, later, now=later))
    assert plan is not None and stale in plan.objects
    pins = {i.key for i in _listing(store, "a/pins/")}
    assert len(pins) == 2 and pins <= set(plan.objects)  # b's own (b is gone) and the stale one
    assert {i.key for i in _listing(store, "a/data/")} <= set(plan.objects)
    # judged now the pin is live: nothing of a goes
    assert run_coroutine(plan_abandoned(store, "a/", uploads, later)) is None


def test_sweep_removes_only_pins_that_protect_nothing(tmp_path):
    store = _run(tmp_path)
    dead = _pin(store, "a", "gone", lease=60.0)  # a save that never committed
    other = _pin(store, "a", "b", attempt="00000000000000bb")  # a killed attempt of b
    assert run_coroutine(sweep_pins(store)) == 0  # leases not over
    assert (
        run_coroutine(sweep_pins(store, now=time.time() + 61)) == 1
    )  # b is committed: not looked at
    keys = {i.key for i in _listing(store, "a/pins/")}
    assert dead not in keys and other in keys
    assert run_coroutine(sweep_pins(store, now=time.time() + 61, folder="b")) == 1
    keys = {i.key for i in _listing(store, "a/pins/")}
    assert other not in keys and len(keys) == 1  # b's committed pin stays
    assert _refs(store, "a").referrers == ("b",)


def _listing(store, prefix):
    async def go():
        return [i async for i in store.list(prefix)]

    return run_coroutine(go())


def test_pin_keys_are_owned_and_near_misses_are_not():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from cloudckpt.layout import owned_key, parse_pin_key
    from cloudckpt.manifest.lineage import folder_problem

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(
        attempt=st.text("0123456789abcdef", min_size=16, max_size=16),
        folder=st.text(min_size=1, max_size=30),
        junk=st.text(max_size=3),
    )
    def check(attempt, folder, junk):
        if folder_problem(folder) is None:
            key = pin_key(attempt, folder)
            assert owned_key(key) and parse_pin_key(key) == (attempt, folder)
        for near in (
            f"pins/{attempt}{folder}",
            f"pins/{attempt[:15]}.{folder}",
            f"pins/{attempt.upper()}X.{folder}",
            f"pin/{attempt}.{folder}",
            f"pins/{attempt}.{folder}/x",
            f"pins/{attempt}..",
            f"pins/{attempt}.",
        ):
            if parse_pin_key(near) is not None:  # only when the near miss is a pin after all
                assert near == pin_key(*parse_pin_key(near))

    check()


def test_ls_details_and_show_name_what_a_checkpoint_shares(tmp_path, capsys):
    from cloudckpt import CheckpointManager
    from cloudckpt.cli.main import main

    run = tmp_path / "run"
    mgr = CheckpointManager(
        str(run), incremental=True, save_options=SaveOptions(object_size=8 << 10)
    )
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    capsys.readouterr()
    assert main(["ls", str(run), "--details"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-3:] == ["own", "shared", "base"]
    rows = {int(line.split()[0]): line.split() for line in lines[1:]}
    assert rows[1][-1] == "-" and rows[2][-1] == "1"
    assert rows[2][-3:-1] == ["16.0", "KiB"]  # shared: the 4096 frozen floats
    assert main(["show", str(run), "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert "base        step-000000000001" in out and "objects of other checkpoints it uses" in out
    mgr.delete(1)
    assert main(["rm", str(run), "--step", "1"]) == 1  # retained: everything is used by step 2
    assert "used by other checkpoints" in capsys.readouterr().err
