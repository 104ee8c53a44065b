"""Every key name of a checkpoint and of a run, relative to its root URL. Pure: no I/O, no torch.

A checkpoint:

```
manifest.msgpack                  the commit marker and index, written last in create mode
data/<attempt>/r<rank>-<n>.bin    data objects of one save attempt
pins/<attempt>.<folder>           a pin: save <attempt> of the sibling folder <folder> uses (or
                                  will use, once committed) objects of this checkpoint
```

``<attempt>`` is 16 lowercase hex digits, ``<rank>`` at least 5 decimal digits, ``<n>`` at least 4
(zero-padded, no extra leading zero); ``<folder>`` is one path segment (a sibling checkpoint of the
same run, see :mod:`cloudckpt.manifest.lineage`). These keys, and unfinished uploads of them, are
everything a checkpoint *owns*: :func:`owned_key` says which keys those are, and every deletion in
cloudckpt removes only keys it accepts. Anything else under a checkpoint's prefix (a user's notes,
another run's folder, a key of some other layout) belongs to someone else and is left in place.

A run is a folder of such checkpoints, one per step (like Orbax's step paths):

```
<run>/step-<step:012d>/manifest.msgpack          a complete checkpoint
<run>/step-<step:012d>/data/...                  its data objects (or an unfinished save's)
<run>/step-<step:012d>/pins/<attempt>.<folder>   pins of incremental saves that reference it
```

A step with pins and no manifest is *retained*: deleted, but some of its objects stay because
other checkpoints reference them (see :mod:`cloudckpt.runs.refs`). It is not a checkpoint.
A step is an ``int >= 0``; its prefix has at least 12 digits, zero-padded, and exactly the digits
:func:`step_dir` writes (``step-0000000000001/`` is not step 1).

A run may also hold checkpoints under names a trainer chose (``last``, ``epoch=0-step=10.ckpt``,
``checkpoint-500``): any folder right under the run root whose name is one safe path segment
(:func:`cloudckpt.manifest.lineage.folder_problem`) and that holds a manifest, a ``data/`` folder
or pins is a checkpoint folder (:func:`folder_of_prefix`); its step is the last number in its name
(:func:`step_of_name`) unless its manifest's metadata says otherwise. Other keys under a run root
belong to someone else: listings ignore them and nothing deletes them.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

from cloudckpt.manifest.lineage import folder_problem
from cloudckpt.storage.base import CommonPrefix, ObjectInfo, UploadInfo
from cloudckpt.storage.urls import parse_store_url

# --- the keys of a checkpoint ----------------------------------------------------------------

MANIFEST_KEY = "manifest.msgpack"
DATA_PREFIX = "data/"
PINS_PREFIX = "pins/"

_ATTEMPT_RE = re.compile(r"^[0-9a-f]{16}$")
_DATA_KEY_RE = re.compile(
    r"data/(?P<attempt>[0-9a-f]{16})/r(?P<rank>[0-9]{5,})-(?P<n>[0-9]{4,})\.bin"
)


def new_attempt_id() -> str:
    """A random id for one save attempt (16 hex digits)."""
    return secrets.token_hex(8)


def data_key(attempt: str, rank: int, index: int) -> str:
    """Key of data object ``index`` written by ``rank`` in save attempt ``attempt``."""
    if not _ATTEMPT_RE.match(attempt):
        raise ValueError(f"bad attempt id {attempt!r}")
    return f"{DATA_PREFIX}{attempt}/r{rank:05d}-{index:04d}.bin"


def data_key_attempt(key: str) -> str | None:
    """The attempt id of ``key`` if it is exactly a data object key :func:`data_key` makes
    (relative to the checkpoint root), else ``None``."""
    m = _DATA_KEY_RE.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        return None
    if data_key(m["attempt"], int(m["rank"]), int(m["n"])) != key:
        return None  # e.g. "r000001-0000.bin": a padding data_key never writes
    return m["attempt"]


def pin_key(attempt: str, folder: str) -> str:
    """Key (relative to the root of the checkpoint whose objects are used) of the pin of save
    ``attempt`` of the sibling checkpoint ``folder``."""
    if not _ATTEMPT_RE.match(attempt) or folder_problem(folder):
        raise ValueError(f"bad pin attempt {attempt!r} or folder {folder!r}")
    return f"{PINS_PREFIX}{attempt}.{folder}"


def parse_pin_key(key: str) -> tuple[str, str] | None:
    """``(attempt, folder)`` of a key exactly as :func:`pin_key` makes it, else ``None``."""
    if not isinstance(key, str) or not key.startswith(PINS_PREFIX):
        return None
    attempt, dot, folder = key[len(PINS_PREFIX) :].partition(".")
    if not dot or not _ATTEMPT_RE.match(attempt) or folder_problem(folder):
        return None
    return attempt, folder


def owned_key(key: str) -> bool:
    """Whether ``key`` (relative to a checkpoint root) is one the checkpoint layout creates: the
    manifest, a data object of some save attempt or a pin. Pure; the predicate every deletion
    uses."""
    return (
        key == MANIFEST_KEY or data_key_attempt(key) is not None or parse_pin_key(key) is not None
    )


# --- what a pin holds ------------------------------------------------------------------------

PIN_FORMAT = "cloudckpt.pin"
#: The shortest lease a pin may declare (seconds); a pin declaring less counts as this.
MIN_PIN_LEASE = 60.0
#: The longest lease a pin may declare (seconds, a day); a pin declaring more counts as this, so
#: that a pin no save renews stops protecting anything within a day whatever it says.
MAX_PIN_LEASE = 86400.0
#: Largest pin read (bytes).
MAX_PIN_BYTES = 4096


@dataclass(frozen=True)
class Pin:
    """What a pin says: save ``attempt`` of the sibling checkpoint ``folder`` may reference
    objects of the checkpoint holding the pin; while it has not committed, the pin protects them
    for ``lease`` seconds after its last write (see docs/architecture.md, deleting)."""

    folder: str
    attempt: str
    lease: float


def clamp_lease(lease: float) -> float:
    """A pin's lease as every writer and reader counts it: within [:data:`MIN_PIN_LEASE`,
    :data:`MAX_PIN_LEASE`]."""
    return min(max(float(lease), MIN_PIN_LEASE), MAX_PIN_LEASE)


def encode_pin(pin: Pin) -> bytes:
    """The stored bytes of ``pin`` (a msgpack map; :func:`decode_pin` reads it back)."""
    return msgpack.packb(
        {
            "format": PIN_FORMAT,
            "version": 1,
            "folder": pin.folder,
            "attempt": pin.attempt,
            "lease": float(pin.lease),
        }
    )


def decode_pin(raw: bytes, key: str) -> Pin:
    """The pin stored at ``key`` (relative to its checkpoint root); ``ValueError`` when it is
    malformed or does not match its key. Its lease is clamped (:func:`clamp_lease`)."""
    named = parse_pin_key(key)
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - malformed input raises many kinds
        raise ValueError(f"pin {key} is not msgpack") from exc
    if type(doc) is not dict or doc.get("format") != PIN_FORMAT or doc.get("version") != 1:
        raise ValueError(f"pin {key} is not a cloudckpt pin")
    lease = doc.get("lease")
    if (
        named is None
        or (doc.get("attempt"), doc.get("folder")) != named
        or type(lease) is not float
        or not math.isfinite(lease)
    ):
        raise ValueError(f"pin {key} does not match its key, or has no lease")
    return Pin(folder=named[1], attempt=named[0], lease=clamp_lease(lease))


# --- the keys of a run -----------------------------------------------------------------------

#: The delimiter of the one listing of a run root: it yields each step's manifest as a key and
#: each step's ``data/`` folder as one common prefix, whatever the number of data objects.
LIST_DELIMITER = "/" + DATA_PREFIX  # "/data/"
_STEP_RE = re.compile(r"^step-(\d{12,})/$")


def step_dir(step: int) -> str:
    """Key prefix of step ``step`` inside a run: ``step-<step:012d>/``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step is an int >= 0, got {step!r}")
    return f"step-{step:012d}/"


def parse_step_dir(prefix: str) -> int | None:
    """The step of a canonical ``step-<digits>/`` prefix, or ``None`` for anything else."""
    m = _STEP_RE.match(prefix)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir(step) == prefix else None


def join_url(base: str, relative: str) -> str:
    """``base`` (a run or checkpoint URL, or a path) joined with a relative key prefix."""
    return base.rstrip("/") + "/" + relative.strip("/")


def split_folder(url: str) -> tuple[str, str] | None:
    """``(run URL, folder)`` of a checkpoint URL: the URL of the folder above it and its own
    last path segment (incremental checkpoints reference objects of *sibling* folders, under
    the run URL). ``None`` when there is no folder above it (a bucket root, a filesystem root,
    a bare relative name) or the last segment is not a folder name a manifest may use. Local
    paths are made absolute and normalised, so two spellings of one run compare equal."""
    parsed = parse_store_url(url)
    if parsed.kind == "s3":
        parts = parsed.prefix.strip("/").split("/") if parsed.prefix else []
        if not parts:
            return None
        run = parsed.bucket_url + "".join("/" + p for p in parts[:-1])
    else:
        path = os.path.normpath(os.path.abspath(parsed.path))
        run, last = os.path.split(path)
        if not last or run == path:
            return None
        parts = [last]
        run = ("file://" + run) if url.startswith("file:") else run
    return None if folder_problem(parts[-1]) else (run, parts[-1])


# --- reading the listing of a run root -------------------------------------------------------


@dataclass
class StepState:
    """What the listings of a run root say about one step (filled in while they are read)."""

    manifest: ObjectInfo | None = None  # the manifest's entry when the step is complete
    has_data: bool = False  # a data/ common prefix was listed
    uploads: tuple[UploadInfo, ...] = ()  # unfinished multipart uploads (prune only)
    pins: int = 0  # pins listed (other checkpoints reference it)

    @property
    def retained(self) -> bool:
        """Deleted, kept for what other checkpoints reference: no manifest, some pins."""
        return self.manifest is None and self.pins > 0


def folder_of_prefix(prefix: str) -> str | None:
    """The folder name of a one-segment ``<name>/`` prefix that may name a checkpoint folder
    (one safe path segment: no ``..``, no control character), else ``None``."""
    name, slash, rest = prefix.partition("/")
    if not slash or rest or folder_problem(name):
        return None
    return name


def folder_name(step: int | str) -> str:
    """The folder of ``step`` in a run: ``step-<012d>`` for an int, the name itself for a str
    (one safe path segment, else ``ValueError``)."""
    if isinstance(step, str):
        if folder_of_prefix(step + "/") is None:
            raise ValueError(f"{step!r} is not a checkpoint folder name (one path segment)")
        return step
    return step_dir(step)[:-1]


_LAST_NUMBER_RE = re.compile(r"(\d+)(?!.*\d)")


def step_of_name(name: str) -> int | None:
    """The step a checkpoint folder's name gives: a canonical ``step-<012d>``'s, else the last
    run of decimal digits in it (``epoch=0-step=10.ckpt`` -> 10, ``checkpoint-500`` -> 500),
    else ``None`` (``last``)."""
    step = parse_step_dir(name + "/")
    if step is not None:
        return step
    m = _LAST_NUMBER_RE.search(name)
    return int(m.group(1)) if m is not None and len(m.group(1)) <= 30 else None


def folder_label(name: str) -> str:
    """How messages name a run's checkpoint folder: ``step N`` for ``step-<012d>``, else the name
    (``repr`` of it when it has spaces, quotes or unprintable characters)."""
    step = parse_step_dir(name + "/")
    if step is not None:
        return f"step {step}"
    return repr(name) if any(c in name for c in " '\"") or not name.isprintable() else name


def classify_listing(items: Iterable[ObjectInfo | CommonPrefix]) -> dict[str, StepState]:
    """Group the entries of a ``delimiter="/data/"`` listing of a run root by checkpoint folder
    name (:func:`folder_of_prefix`).

    Anything that is not ``<name>/manifest.msgpack``, ``<name>/data/`` or ``<name>/pins/<key>``
    (``<name>`` one path segment) is ignored.
    """
    folders: dict[str, StepState] = {}
    for item in items:
        if isinstance(item, CommonPrefix):
            head, sep, rest = item.prefix.rpartition(LIST_DELIMITER)
            name = folder_of_prefix(head + "/") if sep and not rest else None
            if name is not None:
                folders.setdefault(name, StepState()).has_data = True
            continue
        head, sep, key = item.key.rpartition("/")
        if key == MANIFEST_KEY:
            name = folder_of_prefix(head + sep)
            if name is not None:
                folders.setdefault(name, StepState()).manifest = item
        elif key and head.endswith("/" + PINS_PREFIX.rstrip("/")):
            name = folder_of_prefix(head[: -len(PINS_PREFIX) + 1])
            if name is not None:
                folders.setdefault(name, StepState()).pins += 1
    return folders


def add_uploads(
    folders: dict[str, StepState], uploads: Iterable[UploadInfo]
) -> dict[str, StepState]:
    """Attach each unfinished upload (``.key`` relative to the run root) to its checkpoint folder
    in ``folders`` (adding the folder when it has nothing else); uploads of keys the layout does
    not own are ignored. Returns ``folders``."""
    for upload in uploads:
        head, slash, rel = upload.key.partition("/")
        name = folder_of_prefix(head + "/") if slash else None
        if name is not None and owned_key(rel):
            state = folders.setdefault(name, StepState())
            state.uploads = state.uploads + (upload,)
    return folders
