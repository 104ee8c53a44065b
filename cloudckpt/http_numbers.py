"""Numbers in HTTP heads, as HTTP defines them: ASCII digits only. ``str.isdigit``, ``\\d`` and
``int()`` take other scripts' digits too (``"²".isdigit()`` is true, and ``int("²")`` then raises
a bare ``ValueError``; ``int("٣")`` is 3), which no HTTP number is. Every reader of a status
code or a Content-Length (the S3 readers, the spot poller) parses it here. Imports nothing of
cloudckpt."""

from __future__ import annotations

import re

#: 1-19 ASCII digits: below 2**63.
DIGITS_RE = re.compile(r"[0-9]{1,19}", re.ASCII)


def http_int(value: object) -> int | None:
    """A Content-Length, status or other numeric header value -> int; None when absent or not
    1-19 ASCII digits (surrounding blanks allowed). An ``int`` (botocore's parsed
    ``ContentLength``) is taken as it is when not negative."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if not isinstance(value, str):
        return None
    value = value.strip(" \t")
    return int(value) if DIGITS_RE.fullmatch(value) else None
