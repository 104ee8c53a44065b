"""Exact-type msgpack encoding of non-tensor values (and opt-in pickle).

Round-trips exactly: ``None``, ``bool``, ``int`` (any size), ``float``, ``str``, ``bytes``,
``list``, ``tuple`` and ``dict`` (any hashable keys of these types), nested. Exact means the
type itself, not a subclass: a tuple comes back a tuple, a ``numpy.float64`` or an ``IntEnum`` is
refused (its type would not survive). msgpack extension types used:

- 1: tuple (payload: the msgpack array of its items);
- 2: an integer outside the 64-bit range (payload: signed big-endian bytes);
- 3: a pickled value (payload: pickle bytes). Written only when the saver passed
  ``allow_pickle=True``; decoding it requires ``allow_pickle=True`` too, else
  :class:`~cloudckpt.errors.PickleNotAllowed`.
"""

from __future__ import annotations

import itertools
import json
import pickle

import msgpack

from cloudckpt.errors import ManifestError, PickleNotAllowed, UnsupportedValueError

EXT_TUPLE = 1
EXT_BIGINT = 2
EXT_PICKLE = 3
MAX_DEPTH = 200
_MAX_BIGINT_BYTES = 1 << 16
_CONTAINERS = (list, tuple, dict)
_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1


class _Unsupported(Exception):
    def __init__(self, what: str, where: str):
        super().__init__(f"{what} at {where}")
        self.what = what
        self.where = where


def value_path(key: str) -> str:
    """The manifest path of value ``key``, like ``values["lr"]``."""
    return f"values[{json.dumps(key)}]"


def _tree(value, where: str, depth: int):
    if depth > MAX_DEPTH:
        raise _Unsupported(f"nesting deeper than {MAX_DEPTH}", where)
    t = type(value)
    if value is None or t is bool or t is float or t is str or t is bytes:
        return value
    if t is int:
        if _INT_MIN <= value <= _UINT_MAX:
            return value
        n = (value.bit_length() + 8) // 8
        if n > _MAX_BIGINT_BYTES:
            raise _Unsupported("an integer too large", where)
        return msgpack.ExtType(EXT_BIGINT, value.to_bytes(n, "big", signed=True))
    if t is list:
        return [_tree(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if t is tuple:
        items = [_tree(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        return msgpack.ExtType(EXT_TUPLE, _pack(items, where))
    if t is dict:
        out = {}
        for k, v in value.items():
            out[_tree(k, f"{where} (key {k!r})", depth + 1)] = _tree(v, f"{where}[{k!r}]", depth + 1)
        return out
    raise _Unsupported(f"type {t.__module__}.{t.__qualname__}", where)


def _pack(tree, where: str) -> bytes:
    try:
        return msgpack.packb(tree, use_bin_type=True)
    except (UnicodeEncodeError, ValueError, OverflowError, TypeError) as exc:
        raise _Unsupported(f"a value msgpack cannot pack ({exc})", where) from exc


def encode_value(value, *, key: str, allow_pickle: bool) -> bytes:
    """Encode one non-tensor value (see module doc) as msgpack bytes.

    Raises :class:`~cloudckpt.errors.UnsupportedValueError` naming ``key`` (and where inside the
    value) when msgpack cannot hold it exactly and ``allow_pickle`` is false. With
    ``allow_pickle=True`` such a value is pickled whole and flagged as pickled.
    """
    try:
        return _pack(_tree(value, key, 0), key)
    except _Unsupported as exc:
        if not allow_pickle:
            raise UnsupportedValueError(
                f"value {key!r} cannot be stored exactly with msgpack: {exc.what} at {exc.where}; "
                "pass allow_pickle=True (on save and on load) to pickle it"
            ) from exc
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as pexc:  # noqa: BLE001 - pickle raises anything
            raise UnsupportedValueError(f"value {key!r} can be neither msgpacked nor pickled: {pexc}") from pexc
        return msgpack.packb(msgpack.ExtType(EXT_PICKLE, data), use_bin_type=True)


class _PickledMarker:
    """Stands for a pickled payload when decoding in ``inspect`` mode (nothing is unpickled)."""

    def __repr__(self) -> str:
        return "<pickled value>"


def _decode(data, *, path: str, pickle_mode: str):
    """pickle_mode: 'refuse' (raise PickleNotAllowed), 'allow' (unpickle), 'inspect' (marker)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError("encoded value must be bytes", path=path)

    def hook(code: int, payload: bytes):
        if code == EXT_TUPLE:
            inner = msgpack.unpackb(payload, ext_hook=hook, raw=False, strict_map_key=False)
            if type(inner) is not list:
                raise ValueError("tuple payload is not an array")
            return tuple(inner)
        if code == EXT_BIGINT:
            if not 0 < len(payload) <= _MAX_BIGINT_BYTES:
                raise ValueError("bad big integer payload")
            return int.from_bytes(payload, "big", signed=True)
        if code == EXT_PICKLE:
            if pickle_mode == "refuse":
                raise PickleNotAllowed(
                    "the checkpoint holds a pickled value; pass allow_pickle=True to load it "
                    "(only for checkpoints you trust: unpickling runs code)",
                    path=path,
                )
            if pickle_mode == "inspect":
                return _PickledMarker()
            return pickle.loads(payload)  # noqa: S301 - explicit opt-in by the loader
        raise ValueError(f"unknown msgpack extension type {code}")

    unpickled: set[int] = set()  # ids of unpickled objects: leaves, whatever their depth

    def hook_noting(code: int, payload: bytes):
        obj = hook(code, payload)
        if code == EXT_PICKLE:
            unpickled.add(id(obj))
        return obj

    try:
        value = msgpack.unpackb(bytes(data), ext_hook=hook_noting, raw=False, strict_map_key=False)
    except PickleNotAllowed:
        raise
    except Exception as exc:  # noqa: BLE001 - anything from malformed input or unpickling
        raise ManifestError(f"undecodable value ({type(exc).__name__}: {exc})", path=path) from exc
    if _depth_exceeds(value, unpickled):
        raise ManifestError(f"nested deeper than {MAX_DEPTH} levels (the encoder writes no deeper)",
                            path=path)
    return value


def _depth_exceeds(value, leaves: set[int]) -> bool:
    """Whether ``value`` nests deeper than :data:`MAX_DEPTH` (as :func:`encode_value` counts:
    the value itself at depth 0, a dict key or item one deeper than its container). Walks one
    level at a time, holding only the non-empty containers of the next level."""
    level, depth = [value], 0
    while level:
        deeper = []
        for node in level:
            if id(node) in leaves:
                continue
            t = type(node)
            if t is dict:
                children = itertools.chain(node.keys(), node.values())
            elif t is list or t is tuple:
                children = node
            else:
                continue
            if depth == MAX_DEPTH and len(node):
                return True
            deeper.extend(c for c in children if type(c) in _CONTAINERS and len(c))
        level, depth = deeper, depth + 1
    return False


def decode_value(data, *, key: str, allow_pickle):
    """Decode bytes made by :func:`encode_value`, restoring exact types.

    Raises :class:`~cloudckpt.errors.PickleNotAllowed` (naming ``allow_pickle=True``) for a
    pickled value unless ``allow_pickle``; :class:`~cloudckpt.errors.ManifestError` with path
    ``values["<key>"]`` for malformed bytes. ``allow_pickle="inspect"`` never unpickles: each
    pickled payload decodes to an opaque marker (for listings and verification).
    """
    mode = "allow" if allow_pickle is True else "inspect" if allow_pickle == "inspect" else "refuse"
    return _decode(data, path=value_path(key), pickle_mode=mode)


def decode_plain(data, *, path: str):
    """Decode exact-type msgpack bytes that must not hold pickle (metadata, structure)."""
    return _decode(data, path=path, pickle_mode="refuse")


def is_pickled(data, *, key: str) -> bool:
    """Whether encoded value bytes hold a pickled payload; validates them without unpickling."""
    found = []

    def walk(obj):
        if isinstance(obj, _PickledMarker):
            found.append(True)
        elif type(obj) in (list, tuple):
            for item in obj:
                walk(item)
        elif type(obj) is dict:
            for k, v in obj.items():
                walk(k)
                walk(v)

    walk(_decode(data, path=value_path(key), pickle_mode="inspect"))
    return bool(found)
