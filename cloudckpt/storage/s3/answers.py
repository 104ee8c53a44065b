"""What an answer of the S3 server must be before its bytes are used: header numbers parsed as
HTTP defines them (:func:`cloudckpt.http_numbers.http_int`, :func:`parse_content_range`: ASCII
digits only), a ranged GET's answer covering exactly the bytes asked (:func:`check_answer`), and
kept-alive connections with bytes waiting dropped rather than reused (:func:`bytes_waiting`,
:func:`drop_stale_connections`). A server, proxy or connection that labels its bytes wrongly
raises :class:`BadAnswer`, which is retried (``s3_errors.classify``: a ``ConnectionError``).
Shared by the direct reader (``s3_rangeget``) and the aiobotocore one (``s3_read``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import select

from cloudckpt.errors import InvalidRange


class BadAnswer(ConnectionError):
    """An answer that is not what was asked or not HTTP: a range other than the one requested,
    a header number that is not ASCII digits, bytes where no answer was due (retried: a later
    attempt may reach a server, proxy or connection that tells the truth)."""


_CONTENT_RANGE_RE = re.compile(r"bytes ([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19}|\*)", re.ASCII)


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes a-b/total`` -> (a, b + 1, total or None); None when absent or unparsable
    (ASCII digits only, as :func:`cloudckpt.http_numbers.http_int`)."""
    if not value or not isinstance(value, str):
        return None
    m = _CONTENT_RANGE_RE.fullmatch(value.strip(" \t"))
    if not m:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)) + 1, total


def check_answer(
    status: int,
    content_range: str | None,
    length: int | None,
    start: int,
    end: int,
    *,
    where: str,
    key: str | None = None,
) -> None:
    """Check that a GET answer covers exactly the bytes ``[start, end)`` asked of the object
    ``key`` at ``where`` (its URL, for the message): a 206 whose Content-Range says
    ``start-(end-1)``, whose Content-Length is ``end - start`` and whose total size (where
    given) reaches ``end``, or a 200 (the whole object) when that is exactly the range asked.
    Raises :class:`BadAnswer` (retried) otherwise, or ``InvalidRange`` when the answer is
    consistent and says the object ends before ``end`` (the range is past its end). ``length``
    None: the answer has no Content-Length (a chunked body: its Content-Range alone is checked,
    the caller counts the bytes)."""
    asked = f"asked bytes [{start}, {end})"
    if status == 200:
        if start == 0 and length == end:
            return
        raise BadAnswer(
            f"GET {where}: {asked}; the answer is the whole object "
            f"({'?' if length is None else length} bytes)"
        )
    crange = parse_content_range(content_range)
    if status != 206 or crange is None:
        raise BadAnswer(
            f"GET {where}: {asked}; the answer is HTTP {status} with Content-Range "
            f"{_shown(content_range)}"
        )
    a, b, total = crange
    said = (
        f"it says bytes [{a}, {b}) of {'?' if total is None else total}, "
        f"{'?' if length is None else length} long"
    )
    if (length is not None and b - a != length) or b <= a or (total is not None and b > total):
        raise BadAnswer(f"GET {where}: {asked}; {said}: not a consistent answer")
    if a == start and total is not None and b == total < end:
        raise InvalidRange(
            f"{where}: range [{start}, {end}) is past the end of the object ({total} bytes)",
            key=key,
            operation="get",
        )
    if (a, b) != (start, end):
        raise BadAnswer(f"GET {where}: {asked}; {said}")


def _shown(value: object) -> str:
    """A header value for a message: quoted, bounded."""
    return "(none)" if value is None else repr(str(value)[:80])


def bytes_waiting(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the socket under ``transport`` has bytes (or its end) waiting that the event loop
    has not delivered yet. False where there is no socket to ask."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def drop_stale_connections(client: object) -> int:
    """Close the idle pooled connections of an aiobotocore ``client`` that have bytes waiting:
    bytes a server sent after an answer, which aiohttp would read as the next request's answer.
    Returns how many were closed. Best effort over aiohttp's pool (``ClientSession.connector``'s
    idle connections): does nothing where that looks otherwise."""
    http = getattr(getattr(client, "_endpoint", None), "http_session", None)
    sessions = getattr(http, "_sessions", None)
    dropped = 0
    for session in list(sessions.values()) if isinstance(sessions, dict) else ():
        pool = getattr(getattr(session, "connector", None), "_conns", None)
        if not isinstance(pool, dict):
            continue
        for idle in list(pool.values()):
            for item in list(idle):
                proto = item[0]
                transport = getattr(proto, "transport", None)
                if getattr(proto, "should_close", False) is True or bytes_waiting(transport):
                    with contextlib.suppress(ValueError):
                        idle.remove(item)
                    proto.close()
                    dropped += 1
    return dropped
