"""Where the objects of a checkpoint live, relative to the checkpoint's root URL.

```
manifest.msgpack                  the commit marker and index, written last in create mode
data/<attempt>/r<rank>-<n>.bin    data objects of one save attempt
```
"""

from __future__ import annotations

import re
import secrets

MANIFEST_KEY = "manifest.msgpack"
DATA_PREFIX = "data/"

_ATTEMPT_RE = re.compile(r"^[0-9a-f]{16}$")


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
