"""Hostile manifests, end to end: a real checkpoint in a real store whose manifest the tests
replace, the public entry points run against it, and what they may and may not do.

- :func:`make_target` saves a small state (several chunks per tensor, small checksum blocks,
  values, nesting) and puts a sentinel file next to (outside) a LocalStore checkpoint's root.
- :func:`run_entry_points` calls ``cloudckpt.read_manifest``, ``cloudckpt.load_full`` and
  ``cloudckpt.load`` (into a blank state) while an audit hook records every file the process
  opens, creates, renames or deletes.
- :func:`check_refusals` states the rules: a manifest ``read_manifest`` refuses is refused by
  every entry point with a ``ManifestError`` (subclasses included) and nothing is written into
  the destination; a manifest it accepts may still fail to load, but only with a cloudckpt
  integrity, storage or planning error; no entry point ever opens a file outside the
  checkpoint's root or writes any file.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

import cloudckpt
from cloudckpt import errors
from cloudckpt.manifest.columns import decode_int_column, encode_int_column
from cloudckpt.manifest.framing import frame, unframe
from cloudckpt.manifest.values import encode_value
from tests.reliability.stores import RawCheckpoint

SECRET = b"TOP-SECRET-SENTINEL " * 64
BLOCK = 64


def _family(*bases) -> frozenset[str]:
    return frozenset(
        name
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, bases)
    )


MANIFEST_FAMILY = _family(errors.ManifestError)
#: What a load of a manifest that decodes may fail with (data, storage, planning problems).
LOAD_FAMILY = _family(errors.IntegrityError, errors.StorageError, errors.PlanningError)


# -- the audit hook: which files did the library touch? ------------------------------------------

_WRITE_EVENTS = frozenset(
    {
        "os.remove",
        "os.rename",
        "os.link",
        "os.symlink",
        "os.mkdir",
        "os.rmdir",
        "os.truncate",
        "os.chmod",
        "os.utime",
        "shutil.rmtree",
        "shutil.move",
        "os.replace",
    }
)
_watch_lock = threading.Lock()
_watching = False
_events: list[tuple[str, object, object]] = []


def _audit(event: str, args) -> None:
    if not _watching:
        return
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        with _watch_lock:
            _events.append(("open", path, (mode, flags)))
    elif event in _WRITE_EVENTS:
        with _watch_lock:
            _events.append((event, args[0] if args else None, None))


sys.addaudithook(_audit)  # records only while a test watches (audit hooks cannot be removed)


def _is_write_open(mode, flags) -> bool:
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    if isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
        return True
    return False


def _abs(path) -> str | None:
    if isinstance(path, int):
        return None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return os.path.realpath(os.fspath(path))


@dataclass
class Touched:
    """Files an entry point touched outside the checkpoint root (under the watched area), and
    every write of any kind anywhere."""

    outside: list
    writes: list


def watched(fn, root: Path | None, area: Path | None):
    """Run ``fn()``; return (its exception or None, Touched)."""
    global _watching
    with _watch_lock:
        _events.clear()
    _watching = True
    try:
        try:
            fn()
            exc = None
        except errors.CloudCkptError as caught:
            exc = caught
    finally:
        _watching = False
    with _watch_lock:
        events = list(_events)
    outside, writes = [], []
    root_s = os.path.realpath(root) if root is not None else None
    area_s = os.path.realpath(area) if area is not None else None
    for kind, path, extra in events:
        where = _abs(path)
        if kind != "open" or _is_write_open(*extra):
            writes.append((kind, where))
        if (
            where
            and area_s
            and where.startswith(area_s + os.sep)
            and not (root_s and (where == root_s or where.startswith(root_s + os.sep)))
        ):
            outside.append((kind, where))
    return exc, Touched(outside, writes)


# -- the checkpoint under attack ------------------------------------------------------------------


def base_state(blank: bool = False) -> dict:
    """Several chunks per tensor (a ragged holding), dtypes of several sizes, values, nesting."""
    g = torch.Generator().manual_seed(7)
    r = torch.randn(4, 6, generator=g)
    w = torch.randn(40, generator=g)
    b = torch.arange(12, dtype=torch.int64).reshape(3, 4) * 7
    bf = torch.randn(5, generator=g).to(torch.bfloat16)
    if blank:
        r, w, b, bf = (torch.full_like(t, 3) for t in (r, w, b, bf))
    return {
        "w": w,
        "m": {"b": b, "bf": bf},
        "r": [
            cloudckpt.GlobalPiece(r[0:2].clone(), (4, 6), (0, 0)),
            cloudckpt.GlobalPiece(r[2:4].clone(), (4, 6), (2, 0)),
        ],
        "v": {
            "lr": 0.0 if blank else 0.1,
            "name": "" if blank else "run",
            "t": (0, 0) if blank else (1, 2),
        },
    }


@dataclass
class Target:
    url: str
    storage: object
    raw: RawCheckpoint
    valid: bytes  # the manifest as saved
    data_keys: tuple  # its data objects
    root: Path | None = None  # LocalStore: the checkpoint root
    area: Path | None = None  # LocalStore: the directory holding the root and the sentinel
    secret: Path | None = None  # LocalStore: the sentinel outside the root

    def write_manifest(self, data: bytes) -> None:
        self.raw.write("manifest.msgpack", data)


def make_target(url: str, *, storage=None, s3_server=None, area: Path | None = None) -> Target:
    from cloudckpt import SaveOptions

    cloudckpt.save(
        base_state(),
        url,
        storage=storage,
        options=SaveOptions(checksum_block_size=BLOCK, object_size=256),
    )
    raw = RawCheckpoint(url, s3_server)
    valid = raw.read("manifest.msgpack")
    manifest = cloudckpt.read_manifest(url, storage=storage)
    target = Target(url, storage, raw, valid, tuple(manifest.objects))
    if area is not None:
        target.root, target.area = Path(url), area
        target.secret = area / "secret"
        target.secret.write_bytes(SECRET)
    return target


def doc_of(data: bytes) -> dict:
    """The msgpack document inside stored manifest bytes (either format version)."""
    return msgpack.unpackb(unframe(data)[1], raw=False, strict_map_key=False)


def valid_doc(target: Target) -> dict:
    """The msgpack document inside the target's (checksummed) manifest."""
    return doc_of(target.valid)


def pack(doc, version: int = 2) -> bytes:
    """Stored bytes of a (possibly hostile) document: framed with a correct checksum (version
    2, the checksum then tests nothing, the validation behind it everything), or bare
    (version 1, no checksum at all)."""
    return frame(msgpack.packb(doc, use_bin_type=True), version)


# -- running and judging ---------------------------------------------------------------------------


@dataclass
class Outcome:
    errors: dict  # entry point -> exception or None
    touched: dict  # entry point -> Touched
    destination_changed: bool


def underlying(exc: BaseException) -> set[str]:
    """Class names of what really failed (a CheckpointError carries each rank's)."""
    if isinstance(exc, errors.CheckpointError) and exc.failures:
        return {f.error_type for f in exc.failures.values()}
    return {type(exc).__name__}


def run_entry_points(target: Target, *, allow_pickle: bool = False) -> Outcome:
    errs, touched = {}, {}
    errs["read_manifest"], touched["read_manifest"] = watched(
        lambda: cloudckpt.read_manifest(
            target.url, storage=target.storage, allow_pickle=allow_pickle
        ),
        target.root,
        target.area,
    )
    errs["load_full"], touched["load_full"] = watched(
        lambda: cloudckpt.load_full(target.url, storage=target.storage, allow_pickle=allow_pickle),
        target.root,
        target.area,
    )
    dest = base_state(blank=True)
    before = [t.clone() for t in _tensors(dest)]
    errs["load"], touched["load"] = watched(
        lambda: cloudckpt.load(dest, target.url, storage=target.storage, allow_pickle=allow_pickle),
        target.root,
        target.area,
    )
    changed = any(not torch.equal(a, b) for a, b in zip(before, _tensors(dest)))
    return Outcome(errs, touched, changed)


def _tensors(sd) -> list[torch.Tensor]:
    out = []
    for v in sd.values() if isinstance(sd, dict) else sd:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, cloudckpt.GlobalPiece):
            out.append(v.local)
        elif isinstance(v, (dict, list, tuple)):
            out += _tensors(v)
    return out


def check_refusals(outcome: Outcome, what: str = "") -> str:
    """Apply the rules (module docstring); returns "refused" or "accepted"."""
    for name, touched in outcome.touched.items():
        assert touched.outside == [], (
            f"{what}: {name} touched files outside the root: {touched.outside}"
        )
        assert touched.writes == [], f"{what}: {name} wrote: {touched.writes}"
    first = outcome.errors["read_manifest"]
    if first is not None:
        for name, exc in outcome.errors.items():
            assert exc is not None, f"{what}: read_manifest refused it, {name} did not"
            assert isinstance(exc, errors.ManifestError) and underlying(exc) <= MANIFEST_FAMILY, (
                f"{what}: {name}: {exc!r}"
            )
        assert not outcome.destination_changed, f"{what}: load wrote into the destination"
        return "refused"
    for name, exc in outcome.errors.items():
        if exc is not None:
            assert underlying(exc) <= LOAD_FAMILY, f"{what}: {name}: {underlying(exc)}: {exc}"
    return "accepted"


# -- mutations -----------------------------------------------------------------------------------

COLUMNS = (
    ("tensors", "ndims"),
    ("tensors", "shapes"),
    ("tensors", "chunk_counts"),
    ("chunks", "offsets"),
    ("chunks", "sizes"),
    ("chunks", "object_index"),
    ("chunks", "byte_offset"),
    ("chunks", "byte_length"),
)
HOSTILE_INTS = (
    0,
    1,
    -1,
    2,
    3,
    63,
    64,
    65,
    255,
    2**31 - 1,
    2**31,
    2**32,
    2**40,
    2**53,
    2**60,
    2**62,
    2**63 - 1,
    -(2**63),
    10**15,
)
HOSTILE_KEYS = (
    "../secret",
    "../../secret",
    "data/../../secret",
    "/etc/passwd",
    "..",
    ".",
    "",
    "data//x",
    "data/./x",
    "..\\secret",
    "data/x\x00",
    "data/\n",
    "%2e%2e/secret",
    "data/" + "a" * 300,
)


def paths_of(node, prefix=()) -> list[tuple]:
    """Every path (dict keys / list indices) below ``node``."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append(prefix + (k,))
            out += paths_of(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append(prefix + (i,))
            out += paths_of(v, prefix + (i,))
    return out


def get_at(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def set_at(doc, path, value) -> None:
    get_at(doc, path[:-1])[path[-1]] = value


def delete_at(doc, path) -> None:
    parent = get_at(doc, path[:-1])
    del parent[path[-1]]


def reencode_column(column, values, *, delta: bool | None = None):
    delta = column[0] == "delta" if delta is None else delta
    return encode_int_column(values, delta=delta)


def column_values(column) -> list[int]:
    return decode_int_column(column).tolist()


def hostile_value_blob(choice: int, payload) -> bytes:
    """Encoded non-tensor values a hostile manifest may carry (no code-running pickle here)."""
    if choice == 0:
        return encode_value(payload, key="x", allow_pickle=False)
    if choice == 1:  # a pickled (harmless) value: must be refused without allow_pickle
        return encode_value({1, 2}, key="x", allow_pickle=True)
    if choice == 2:  # unknown extension type
        return msgpack.packb(msgpack.ExtType(99, b"\x00"), use_bin_type=True)
    if choice == 3:  # a tuple extension whose payload is not an array
        return msgpack.packb(msgpack.ExtType(1, b"\xc0"), use_bin_type=True)
    if choice == 4:  # a huge bigint extension
        return msgpack.packb(msgpack.ExtType(2, b"\x01" * 70000), use_bin_type=True)
    return msgpack.packb([[[[[[[[[[[[]]]]]]]]]]]] * 3, use_bin_type=True)
