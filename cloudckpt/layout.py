"""Where the objects of a checkpoint live, relative to the checkpoint's root URL.

```
manifest.msgpack                  the commit marker and index, written last in create mode
data/<attempt>/r<rank>-<n>.bin    data objects of one save attempt
```

``<attempt>`` is 16 lowercase hex digits, ``<rank>`` at least 5 decimal digits, ``<n>`` at least 4
(zero-padded, no extra leading zero). These keys, and unfinished uploads of them, are everything a
checkpoint *owns*: :func:`owned_key` says which keys those are, and every deletion in cloudckpt
removes only keys it accepts. Anything else under a checkpoint's prefix (a user's notes, another
run's folder, a key of some other layout) belongs to someone else and is left in place.
"""

from __future__ import annotations

import re
import secrets

MANIFEST_KEY = "manifest.msgpack"
DATA_PREFIX = "data/"

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


def attempt_prefix(attempt: str) -> str:
    """Key prefix of every data object of one save attempt."""
    return f"{DATA_PREFIX}{attempt}/"


def data_key_attempt(key: str) -> str | None:
    """The attempt id of ``key`` if it is exactly a data object key :func:`data_key` makes
    (relative to the checkpoint root), else ``None``."""
    m = _DATA_KEY_RE.fullmatch(key) if isinstance(key, str) else None
    if m is None:
        return None
    if data_key(m["attempt"], int(m["rank"]), int(m["n"])) != key:
        return None  # e.g. "r000001-0000.bin": a padding data_key never writes
    return m["attempt"]


def owned_key(key: str) -> bool:
    """Whether ``key`` (relative to a checkpoint root) is one the checkpoint layout creates: the
    manifest or a data object of some save attempt. Pure; the predicate every deletion uses."""
    return key == MANIFEST_KEY or data_key_attempt(key) is not None
