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

import json
import pickle
import re
from collections.abc import Callable
from typing import Any, Literal

import msgpack

from cloudckpt.errors import ManifestError, PickleNotAllowed, UnsupportedValueError

EXT_TUPLE = 1
EXT_BIGINT = 2
EXT_PICKLE = 3
MAX_DEPTH = 200
_MAX_BIGINT_BYTES = 1 << 16
_OPEN = frozenset({list, dict})
_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1

#: What a decoder does with a pickled payload: raise :class:`PickleNotAllowed` (``"refuse"``),
#: unpickle it (``"allow"``) or decode it to an opaque marker, never unpickling (``"inspect"``).
PickleMode = Literal["refuse", "allow", "inspect"]
#: The ``allow_pickle`` argument of the decoders, as the public API spells it.
AllowPickle = bool | Literal["inspect"]


class _Unsupported(Exception):
    def __init__(self, what: str, where: str):
        super().__init__(f"{what} at {where}")
        self.what = what
        self.where = where


def value_path(key: str) -> str:
    """The manifest path of value ``key``, like ``values["lr"]``."""
    return f"values[{json.dumps(key)}]"


def _tree(value: Any, where: str, depth: int) -> Any:
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
        out: dict[Any, Any] = {}
        for k, v in value.items():
            out[_tree(k, f"{where} (key {k!r})", depth + 1)] = _tree(
                v, f"{where}[{k!r}]", depth + 1
            )
        return out
    raise _Unsupported(f"type {t.__module__}.{t.__qualname__}", where)


def _pack(tree: object, where: str) -> bytes:
    try:
        return msgpack.packb(tree, use_bin_type=True)
    except (UnicodeEncodeError, ValueError, OverflowError, TypeError) as exc:
        raise _Unsupported(f"a value msgpack cannot pack ({exc})", where) from exc


def encode_value(value: object, *, key: str, allow_pickle: bool) -> bytes:
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
                + _pickle_hint(value)
            ) from exc
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as pexc:  # noqa: BLE001 - pickle raises anything
            raise UnsupportedValueError(
                f"value {key!r} can be neither msgpacked nor pickled: {pexc}"
            ) from pexc
        return msgpack.packb(msgpack.ExtType(EXT_PICKLE, data), use_bin_type=True)


def _pickle_hint(value: object) -> str:
    """What to do about a value msgpack cannot hold: ``allow_pickle=True`` only when pickle can
    hold it (tried with ``pickle.dumps``; nothing is unpickled), else store plain data."""
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - pickle raises anything
        why = re.sub(r" at 0x[0-9a-fA-F]+", "", str(exc).split("\n")[0])[:120]
        return (
            f"pickle cannot hold it either ({type(exc).__name__}: {why}), so allow_pickle "
            "would not help: store plain data instead (numbers, strings, lists, dicts, "
            "tensors; for a function or a lambda, the name or parameters it is built from)"
        )
    return "pass allow_pickle=True (on save and on load) to pickle it"


class _PickledMarker:
    """Stands for a pickled payload when decoding in ``inspect`` mode (nothing is unpickled)."""

    def __repr__(self) -> str:
        return "<pickled value>"


class _Tuple:
    """A tuple's msgpack payload, decoded once its container is (see :func:`_resolve`)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes):
        self.payload = payload


_NESTED = _OPEN | {_Tuple}


class _TooDeep(Exception):
    pass


def _decode(data: object, *, path: str, pickle_mode: PickleMode) -> object:
    """Decode exact-type msgpack bytes; ``pickle_mode`` says what a pickled payload becomes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError("encoded value must be bytes", path=path)
    unpickled: set[int] = set()  # ids of unpickled objects: leaves, whatever they hold

    def hook(code: int, payload: bytes) -> object:
        if code == EXT_TUPLE:  # not decoded here: nested calls would nest C stacks (a crash)
            return _Tuple(payload)
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
            obj = pickle.loads(payload)  # noqa: S301 - explicit opt-in by the loader
            unpickled.add(id(obj))
            return obj
        raise ValueError(f"unknown msgpack extension type {code}")

    try:
        root = msgpack.unpackb(bytes(data), ext_hook=hook, raw=False, strict_map_key=False)
        return _resolve(root, hook, unpickled)
    except PickleNotAllowed:
        raise
    except _TooDeep:
        raise ManifestError(
            f"nested deeper than {MAX_DEPTH} levels (the encoder writes no deeper)", path=path
        ) from None
    except Exception as exc:  # noqa: BLE001 - anything from malformed input or unpickling
        raise ManifestError(f"undecodable value ({type(exc).__name__}: {exc})", path=path) from exc


def _resolve(root: Any, hook: Callable[[int, bytes], object], leaves: set[int]) -> Any:
    """``root`` with every :class:`_Tuple` decoded into its tuple, bottom-up, with an explicit
    stack (no recursion, whatever the nesting); raises :class:`_TooDeep` for a value nested
    deeper than :data:`MAX_DEPTH` as :func:`encode_value` counts it (the value at depth 0, a
    container's items and dict keys one deeper). A tuple's payload is dropped once decoded.
    """

    # a frame: [kind, items, indices of the items to resolve, depth, node, position in the
    # parent, changed]; only non-empty lists and dicts and tuples are ever opened
    def open_frame(node: Any, depth: int, pos: int | None) -> list[Any] | None:
        t = type(node)
        if t is _Tuple:
            items = msgpack.unpackb(node.payload, ext_hook=hook, raw=False, strict_map_key=False)
            if type(items) is not list:
                raise ValueError("tuple payload is not an array")
        elif (t is list or t is dict) and len(node) and id(node) not in leaves:
            items = node if t is list else [x for kv in node.items() for x in kv]
        else:
            return None
        if items and depth >= MAX_DEPTH:
            raise _TooDeep
        todo = (
            [
                i
                for i, c in enumerate(items)
                if type(c) is _Tuple or (type(c) in _OPEN and len(c) and not _plain(c, depth + 1))
            ]
            if not _NESTED.isdisjoint(map(type, items))
            else []
        )
        todo.reverse()
        return [tuple if t is _Tuple else t, items, todo, depth, node, pos, t is _Tuple]

    def _plain(node: Any, depth: int) -> bool:
        """Whether a non-empty list or dict at ``depth`` needs no frame: it holds no container
        (nor a tuple to decode) and is not too deep; it is then kept as it is."""
        if id(node) in leaves:
            return False
        if type(node) is dict:
            nested = not (
                _NESTED.isdisjoint(map(type, node)) and _NESTED.isdisjoint(map(type, node.values()))
            )
        else:
            nested = not _NESTED.isdisjoint(map(type, node))
        if nested:
            return False
        if depth >= MAX_DEPTH:
            raise _TooDeep
        return True

    frame = open_frame(root, 0, None)
    if frame is None:
        return root
    stack = [frame]
    while True:
        frame = stack[-1]
        if frame[2]:
            i = frame[2].pop()
            child = open_frame(frame[1][i], frame[3] + 1, i)
            if child is not None:
                stack.append(child)
            continue
        stack.pop()
        kind, items = frame[0], frame[1]
        done: Any
        if kind is tuple:
            done = tuple(items)
        elif kind is dict and frame[6]:  # a key or an item changed: rebuilt
            done = dict(zip(items[::2], items[1::2]))
        else:
            done = frame[4]  # a list changed in place, or an unchanged dict
        if not stack:
            return done
        if done is not frame[4]:
            parent = stack[-1]
            parent[1][frame[5]] = done
            parent[6] = True


def decode_value(data: bytes, *, key: str, allow_pickle: AllowPickle) -> Any:
    """Decode bytes made by :func:`encode_value`, restoring exact types.

    Raises :class:`~cloudckpt.errors.PickleNotAllowed` (naming ``allow_pickle=True``) for a
    pickled value unless ``allow_pickle``; :class:`~cloudckpt.errors.ManifestError` with path
    ``values["<key>"]`` for malformed bytes. ``allow_pickle="inspect"`` never unpickles: each
    pickled payload decodes to an opaque marker (for listings and verification).
    """
    mode: PickleMode = (
        "allow" if allow_pickle is True else "inspect" if allow_pickle == "inspect" else "refuse"
    )
    return _decode(data, path=value_path(key), pickle_mode=mode)


def decode_plain(data: bytes, *, path: str) -> Any:
    """Decode exact-type msgpack bytes that must not hold pickle (metadata, structure)."""
    return _decode(data, path=path, pickle_mode="refuse")


def is_pickled(data: bytes, *, key: str) -> bool:
    """Whether encoded value bytes hold a pickled payload; validates them without unpickling."""
    found = []

    def walk(obj: object) -> None:
        if isinstance(obj, _PickledMarker):
            found.append(True)
        elif type(obj) is list or type(obj) is tuple:
            for item in obj:
                walk(item)
        elif type(obj) is dict:
            for k, v in obj.items():
                walk(k)
                walk(v)

    try:
        walk(_decode(data, path=value_path(key), pickle_mode="inspect"))
    finally:
        walk = None  # type: ignore[assignment]  # the closure refers to itself: break the cycle
    return bool(found)
