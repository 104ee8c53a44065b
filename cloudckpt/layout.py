"""Where the objects of a checkpoint live, relative to the checkpoint's root URL.

```
manifest.msgpack                  the commit marker and index, written last in create mode
data/<attempt>/r<rank>-<n>.bin    data objects of one save attempt
pins/<attempt>.<folder>           a pin: save <attempt> of the sibling folder <folder> uses (or
                                  will use, once committed) objects of this checkpoint
```

``<attempt>`` is 16 lowercase hex digits, ``<rank>`` at least 5 decimal digits, ``<n>`` at least 4
(zero-padded, no extra leading zero); ``<folder>`` is one path segment (a sibling checkpoint of the
same run, see :mod:`cloudckpt.manifest.lineage`). These keys, and unfinished uploads of them, are
everything a checkpoint *owns*: :func:`owned_key` says which keys those are, and every deletion in cloudckpt
removes only keys it accepts. Anything else under a checkpoint's prefix (a user's notes, another
run's folder, a key of some other layout) belongs to someone else and is left in place.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass

import msgpack

from cloudckpt.manifest.lineage import folder_problem

MANIFEST_KEY = "manifest.msgpack"
DATA_PREFIX = "data/"
PINS_PREFIX = "pins/"
PIN_FORMAT = "cloudckpt.pin"
#: The shortest lease a pin may declare (seconds); a pin declaring less counts as this.
MIN_PIN_LEASE = 60.0
#: The longest lease a pin may declare (seconds, a day); a pin declaring more counts as this, so
#: that a pin no save renews stops protecting anything within a day whatever it says.
MAX_PIN_LEASE = 86400.0
#: Largest pin read (bytes).
MAX_PIN_BYTES = 4096

_ATTEMPT_RE = re.compile(r"^[0-9a-f]{16}$")
_DATA_KEY_RE = re.compile(
    r"data/(?P<attempt>[0-9a-f]{16})/r(?P<rank>[0-9]{5,})-(?P<n>[0-9]{4,})\.bin")


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
    attempt, dot, folder = key[len(PINS_PREFIX):].partition(".")
    if not dot or not _ATTEMPT_RE.match(attempt) or folder_problem(folder):
        return None
    return attempt, folder


def owned_key(key: str) -> bool:
    """Whether ``key`` (relative to a checkpoint root) is one the checkpoint layout creates: the
    manifest, a data object of some save attempt or a pin. Pure; the predicate every deletion
    uses."""
    return key == MANIFEST_KEY or data_key_attempt(key) is not None or \
        parse_pin_key(key) is not None


@dataclass(frozen=True)
class Pin:
    """What a pin says: save ``attempt`` of the sibling checkpoint ``folder`` may reference
    objects of the checkpoint holding the pin; while it has not committed, the pin protects them
    for ``lease`` seconds after its last write (see docs/architecture.md, deleting)."""

    folder: str
    attempt: str
    lease: float


def encode_pin(pin: Pin) -> bytes:
    return msgpack.packb({"format": PIN_FORMAT, "version": 1, "folder": pin.folder,
                          "attempt": pin.attempt, "lease": float(pin.lease)})


def clamp_lease(lease: float) -> float:
    """A pin's lease as every writer and reader counts it: within [:data:`MIN_PIN_LEASE`,
    :data:`MAX_PIN_LEASE`]."""
    return min(max(float(lease), MIN_PIN_LEASE), MAX_PIN_LEASE)


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
    if named is None or (doc.get("attempt"), doc.get("folder")) != named \
            or type(lease) is not float or not math.isfinite(lease):
        raise ValueError(f"pin {key} does not match its key, or has no lease")
    return Pin(folder=named[1], attempt=named[0], lease=clamp_lease(lease))
