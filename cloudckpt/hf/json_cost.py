"""What parsing untrusted JSON would allocate, bounded before it is parsed. Pure (no I/O, no torch).

``json.loads`` builds a Python object for every value it reads, and those objects are much
larger than their text: ``{}`` is 2 bytes of JSON and a 64-byte dict, ``"a":"",`` 7 bytes and
two strings and a dict slot (over 100 bytes). A safetensors header (up to 100 MB) made of such
tokens costs over a GiB to parse (measured: a 56 MiB header of tiny metadata entries grew a
process by 1.1 GiB, a 62 MiB one of empty tensor entries by 1.5 GiB). :func:`check_json_cost`
counts the tokens with ``bytes.count`` (C speed, no copy: a bracket, colon or comma inside a
string counts too, so the estimate only errs high) and refuses the document before any object
is built when the estimate exceeds the budget.

Contract: :func:`estimate_parse_bytes` of a document is at least what ``json.loads`` allocates
for it, the decoded text included (CPython 3.10+, 64-bit; checked against ``tracemalloc`` on
documents made of each kind of token in ``tests/reliability/test_hf_hostile_headers.py``); it
takes time linear in the document and allocates nothing in proportion to it.
:func:`check_json_cost` raises :class:`~cloudckpt.errors.SafetensorsError` (at ``path``) for a
document whose estimate exceeds ``budget``. :func:`has_long_number` tells whether a document
may hold a number of more than :data:`MAX_NUMBER_DIGITS` digits (a run of digits anywhere,
strings included), for the parser to check its numbers then.
"""

from __future__ import annotations

import re

from cloudckpt.errors import SafetensorsError

#: The longest number accepted (a u64 has 20 digits, a double's repr 17 significant ones).
MAX_NUMBER_DIGITS = 40

# Upper bounds, in bytes, of what CPython allocates per token while parsing: a dict and the
# pairs list ``object_pairs_hook`` gets; a list; a member (its pair tuple, its dict slot); a
# value (a pointer and at most a 36-byte int or float); a string's header.
_PER_OBJECT = 320
_PER_ARRAY = 96
_PER_MEMBER = 144
_PER_VALUE = 56
_PER_STRING = 96
_FIXED = 4096

_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_NUMBER_DIGITS + 1))
_FOUR_BYTE_CHAR = re.compile(rb"[\xf0-\xf4]")
_THREE_BYTE_CHAR = re.compile(rb"[\xe0-\xef]")


def _char_width(raw: bytes) -> int:
    """Bytes per character of the ``str`` that decoding ``raw`` gives (CPython keeps 1, 2 or
    4 bytes per character, by the widest one): 1 for ASCII and Latin-1, 2 below U+10000, 4."""
    if raw.isascii():
        return 1
    if _FOUR_BYTE_CHAR.search(raw):
        return 4
    return 2 if _THREE_BYTE_CHAR.search(raw) else 1


def estimate_parse_bytes(raw: bytes) -> int:
    """An upper estimate of the bytes ``json.loads`` allocates for ``raw``: the decoded text,
    the strings' characters twice more (the parser's buffer and the result), every token's
    objects (module doc)."""
    raw = bytes(raw)
    width = _char_width(raw)
    return (
        _FIXED
        + 3 * width * len(raw)
        + len(raw)
        + _PER_OBJECT * raw.count(b"{")
        + _PER_ARRAY * raw.count(b"[")
        + _PER_MEMBER * raw.count(b":")
        + _PER_VALUE * (raw.count(b",") + 1)
        + (_PER_STRING + width) * (raw.count(b'"') // 2)
    )


def check_json_cost(raw: bytes, *, budget: int, path: str | None = None) -> None:
    """Refuse ``raw`` before it is parsed: :class:`SafetensorsError` when parsing it could
    allocate more than ``budget`` bytes (:func:`estimate_parse_bytes`)."""
    cost = estimate_parse_bytes(raw)
    if cost > budget:
        raise SafetensorsError(
            f"refused before parsing: its {len(raw)} bytes of JSON could take {cost >> 20} MiB "
            f"to parse, more than the {budget >> 20} MiB allowed ({raw.count(b'{')} objects, "
            f"{raw.count(b',') + 1} values; a real header takes far less): re-save the file "
            f"with the safetensors library",
            path=path,
        )


def has_long_number(raw: bytes) -> bool:
    """Whether ``raw`` holds a run of more than :data:`MAX_NUMBER_DIGITS` digits."""
    return _LONG_DIGITS.search(raw) is not None
