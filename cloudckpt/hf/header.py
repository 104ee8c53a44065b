"""The safetensors format: building a header and parsing an untrusted one. Pure (no I/O, no torch).

The one parser of safetensors headers in cloudckpt: :func:`cloudckpt.export_safetensors` builds
its files with :func:`build_header`, :func:`cloudckpt.load_safetensors` reads every file's header
with :func:`header_length` and :func:`parse_header`.

A safetensors file is ``N`` (8 bytes, little-endian u64), then ``N`` bytes of UTF-8 JSON (an
object), then the data section. The JSON maps each tensor name to ``{"dtype": "F32", "shape":
[...], "data_offsets": [begin, end]}`` (offsets relative to the first data byte) and may hold
``"__metadata__"``, a str -> str map.

Contract:
- :func:`build_header` lays tensors out one after the other in the order given and pads the
  JSON with spaces so the data starts at a multiple of 8 bytes (as the safetensors library
  does); :func:`parse_header` of its bytes gives the same :class:`Header` back.
- :func:`parse_header` takes bytes anyone may have written and either returns a validated
  :class:`Header` or raises :class:`~cloudckpt.errors.SafetensorsError` (a ``ValueError``;
  ``path`` names the file, given as ``key``, and the tensor), never another exception, before
  the caller allocates or reads anything from it. Refused: a length under 2, over
  :data:`MAX_HEADER_BYTES` or past the file's end; JSON that is not UTF-8, not an object,
  nested too deeply, whose parse could allocate more than :data:`MAX_PARSE_BYTES` (estimated
  from the bytes before parsing, :mod:`cloudckpt.hf.json_cost`), with duplicate keys,
  ``NaN``/``Infinity``, a number of more than 40 digits or
  a lone surrogate escape (``"\\ud800"``) in a name or metadata;
  a tensor entry that is not an object or lacks one of the three fields; a dtype outside
  :data:`DTYPES`; a shape that is not a list of at most :data:`MAX_NDIM` non-negative ints
  spanning at most 2**60 bytes (empty dimensions counted as 1, as in a cloudckpt manifest);
  offsets that are not ``0 <= begin <= end`` or whose span is not the shape's bytes; and a data
  layout other than the tensors back to back from byte 0 (two tensors sharing a byte, a hole
  before or between them) ending exactly at the file's end (checked when ``file_size`` is
  given). Spaces after the JSON and unknown keys of a tensor entry are accepted.
- This is what the safetensors library (0.8) does, checked on crafted files
  (``tests/interop/test_hf_header.py``, every hostile case and generated headers): it refuses
  holes ("invalid offset") and data that stops short of, or runs past, the file's end
  ("incomplete metadata, file not fully covered"), and ignores unknown keys. Stricter than the
  library, by design: an empty tensor name, more than 64 dimensions, ``"__metadata__": null``,
  the dtypes the library knows and cloudckpt does not (``F8_E4M3FNUZ``, ``F8_E5M2FNUZ``).
- Dtypes: :data:`DTYPES` maps safetensors names (``"BF16"``) to the torch dtype names cloudckpt
  uses (``"bfloat16"``); :data:`ITEMSIZE` gives bytes per element (from
  :data:`cloudckpt.manifest.dtypes.DTYPE_ITEMSIZE`); :func:`safetensors_dtype` /
  :func:`torch_dtype_name` convert either way and accept a ``torch.dtype`` (by its name,
  without importing torch).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from cloudckpt.errors import SafetensorsError
from cloudckpt.hf.json_cost import MAX_NUMBER_DIGITS, check_json_cost, has_long_number
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_ELEMENTS, MAX_NDIM

#: bytes of the length prefix.
PREFIX_BYTES = 8
#: The safetensors library refuses larger headers too.
MAX_HEADER_BYTES = 100_000_000
#: The data starts at a multiple of this (the JSON is padded with spaces).
ALIGNMENT = 8
METADATA_KEY = "__metadata__"
#: the most a header's (or an index's) JSON may allocate when parsed, estimated before parsing
#: (:mod:`cloudckpt.hf.json_cost`); a real header of 100,000 tensors (12 MB) fits.
MAX_PARSE_BYTES = 256 << 20

#: safetensors dtype name -> torch dtype name (without ``torch.``); others are refused.
DTYPES: Mapping[str, str] = MappingProxyType(
    {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "C64": "complex64",
    }
)
_FROM_TORCH = {v: k for k, v in DTYPES.items()}
#: bytes per element, by safetensors dtype name.
ITEMSIZE: Mapping[str, int] = MappingProxyType({k: DTYPE_ITEMSIZE[v] for k, v in DTYPES.items()})
#: Floating dtypes (torch names): the ones an export's dtype cast applies to.
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


def _name_of(dtype) -> str:
    """A dtype given as a name or a ``torch.dtype`` -> its text (``torch.`` dropped)."""
    text = dtype if isinstance(dtype, str) else str(dtype)
    return text.removeprefix("torch.")


def safetensors_dtype(dtype) -> str:
    """The safetensors name (``"BF16"``) of a torch dtype, its name (``"bfloat16"``) or a
    safetensors name. ``SafetensorsError`` (a ``ValueError``) for a dtype safetensors cannot
    hold (``complex128``) or an unknown name."""
    text = _name_of(dtype)
    if text in DTYPES:
        return text
    if text in _FROM_TORCH:
        return _FROM_TORCH[text]
    raise SafetensorsError(
        f"dtype {text!r} has no safetensors equivalent (safetensors holds "
        f"{', '.join(DTYPES.values())})"
    )


def torch_dtype_name(dtype) -> str:
    """The torch dtype name (``"bfloat16"``) of a safetensors name, a torch dtype or its name;
    ``SafetensorsError`` as :func:`safetensors_dtype`."""
    return DTYPES[safetensors_dtype(dtype)]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file: ``dtype`` is the safetensors name; ``start`` / ``end``
    are its bytes relative to the first data byte."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> str:
        """The torch dtype name (``"bfloat16"``)."""
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Header:
    """A safetensors header. ``tensors`` in data order (for equal offsets, the JSON's order);
    ``data_start`` is where the data begins in the file (8 + the JSON's length); ``data_size``
    the data's length (the file's size is ``data_start + data_size``)."""

    tensors: tuple[TensorEntry, ...]
    metadata: Mapping[str, str]
    data_start: int
    data_size: int

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


def _where(key: str | None, entry: str | None = None) -> str | None:
    """The error ``path``: the file's key and the entry (JSON-quoted, shortened)."""
    parts = [key] if key else []
    if entry is not None:
        parts.append(json.dumps(entry[:80]) + ("..." if len(entry) > 80 else ""))
    return ": ".join(parts) or None


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def build_header(
    tensors: Sequence[tuple[str, object, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, Header]:
    """The header bytes (length prefix, JSON, padding) of a file holding ``tensors``, given as
    ``(name, dtype, shape)`` in data order (dtype: torch or safetensors name, or a
    ``torch.dtype``), and the :class:`Header` they describe. ``SafetensorsError`` for a
    duplicate, empty or reserved name, a dtype safetensors cannot hold, a bad shape or metadata
    that is not str -> str: whatever :func:`parse_header` would refuse."""
    doc: dict[str, object] = {}
    meta = dict(metadata or {})
    if any(type(k) is not str or type(v) is not str for k, v in meta.items()):
        raise SafetensorsError("safetensors metadata must map str to str")
    if meta:
        doc[METADATA_KEY] = meta
    entries: list[TensorEntry] = []
    pos = 0
    for name, dtype, shape in tensors:
        if type(name) is not str or not name or name == METADATA_KEY or name in doc:
            raise SafetensorsError(f"tensor name {name!r} is empty, reserved or repeated")
        st = safetensors_dtype(dtype)
        dims = tuple(shape)
        _check_shape(st, dims, _where(None, name))
        end = pos + _nbytes(st, dims)
        doc[name] = {"dtype": st, "shape": list(dims), "data_offsets": [pos, end]}
        entries.append(TensorEntry(name, st, dims, pos, end))
        pos = end
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(PREFIX_BYTES + len(text)) % ALIGNMENT)
    if len(text) > MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"the header would be {len(text)} bytes, more than the "
            f"{MAX_HEADER_BYTES} safetensors reads"
        )
    header = Header(tuple(entries), MappingProxyType(meta), PREFIX_BYTES + len(text), pos)
    return len(text).to_bytes(PREFIX_BYTES, "little") + text, header


def header_length(prefix: bytes, *, file_size: int | None = None, key: str | None = None) -> int:
    """The JSON length ``N`` from a file's first 8 bytes (more are ignored), checked against
    :data:`MAX_HEADER_BYTES` and ``file_size`` (so a reader knows how much to read next, and
    reads nothing for a false length). ``key`` names the file in errors."""
    if len(prefix) < PREFIX_BYTES:
        raise SafetensorsError(
            f"a safetensors file starts with {PREFIX_BYTES} bytes of header "
            f"length; got {len(prefix)} bytes",
            path=_where(key),
        )
    n = int.from_bytes(prefix[:PREFIX_BYTES], "little")
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"header length {n} is more than the {MAX_HEADER_BYTES} bytes safetensors allows",
            path=_where(key),
        )
    if n < 2:
        raise SafetensorsError(
            f"header length {n} is too short for a JSON object", path=_where(key)
        )
    if file_size is not None and PREFIX_BYTES + n > file_size:
        raise SafetensorsError(
            f"header length {n} reaches past the end of the {file_size}-byte file", path=_where(key)
        )
    return n


def parse_header(data: bytes, *, file_size: int | None = None, key: str | None = None) -> Header:
    """Parse and validate the header at the start of ``data`` (the length prefix and the JSON;
    bytes after them are ignored). With ``file_size``, the data must end exactly at the end of
    the file; without it, the data's size is where the last tensor ends. ``key`` names the file
    in errors. Raises :class:`SafetensorsError` (see the module doc)."""
    n = header_length(data, file_size=file_size, key=key)
    if len(data) < PREFIX_BYTES + n:
        raise SafetensorsError(
            f"header truncated: {len(data) - PREFIX_BYTES} of {n} bytes", path=_where(key)
        )
    doc = load_json(bytes(data[PREFIX_BYTES : PREFIX_BYTES + n]), path=_where(key))
    if type(doc) is not dict:
        raise SafetensorsError(
            f"the header must be a JSON object, got {type(doc).__name__}", path=_where(key)
        )
    meta = doc.pop(METADATA_KEY, {})
    if type(meta) is not dict or any(type(v) is not str for v in meta.values()):
        raise SafetensorsError(
            "must be an object of strings (str -> str)", path=_where(key, METADATA_KEY)
        )
    entries = sorted(
        (_entry(name, value, _where(key, name)) for name, value in doc.items()),
        key=lambda e: (e.start, e.end),
    )
    pos, last = 0, ""
    for e in entries:
        if e.start != pos:
            what = (
                f"overlap those of {json.dumps(last[:80])}"
                if e.start < pos
                else "leave a hole before them"
            )
            raise SafetensorsError(
                f"data_offsets [{e.start}, {e.end}] {what} (the tensors' "
                f"data must be back to back: expected to start at {pos})",
                path=_where(key, e.name),
            )
        pos, last = e.end, e.name
    data_start = PREFIX_BYTES + n
    if file_size is not None and file_size - data_start != pos:
        raise SafetensorsError(
            f"the tensors' data is {pos} bytes, the file holds "
            f"{file_size - data_start} after the header",
            path=_where(key),
        )
    return Header(tuple(entries), MappingProxyType(meta), data_start, pos)


def _checked_object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise _BadJson(f"key {json.dumps(k[:80])} appears twice")
        for text in (k, v) if type(v) is str else (k,):
            try:  # "\\ud800" decodes to a str that is not text (and no UTF-8 encodes it)
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise _BadJson(
                    f"a string holds a lone surrogate escape at character {exc.start}"
                ) from exc
        out[k] = v
    return out


def _constant_refused(name: str):
    raise _BadJson(f"{name} is not valid JSON")


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise _BadJson(
            f"not valid JSON for safetensors: a number of {len(text)} digits (at "
            f"most {MAX_NUMBER_DIGITS})"
        )
    return int(text)


class _BadJson(Exception):
    pass


def load_json(raw: bytes, *, path: str | None = None, budget: int = MAX_PARSE_BYTES):
    """JSON from untrusted bytes: UTF-8, no duplicate keys, no ``NaN``/``Infinity``, no lone
    surrogate escape in a key or a string value of an object; any failure
    (deep nesting, a number of more than 40 digits included) is a :class:`SafetensorsError` at
    ``path``. Bytes whose parse could allocate more than ``budget`` are refused before any
    object is built (:func:`cloudckpt.hf.json_cost.check_json_cost`)."""
    check_json_cost(raw, budget=budget, path=path)
    # only where a long run of digits is (its conversion is quadratic without Python's limit)
    parse_int = _short_int if has_long_number(raw) else None  # None: json's own
    try:
        text = bytes(raw).decode("utf-8")
        return json.loads(
            text,
            object_pairs_hook=_checked_object,
            parse_constant=_constant_refused,
            parse_int=parse_int,
        )
    except _BadJson as exc:
        raise SafetensorsError(str(exc), path=path) from exc
    except UnicodeDecodeError as exc:
        raise SafetensorsError(f"not UTF-8: {exc.reason} at byte {exc.start}", path=path) from exc
    except json.JSONDecodeError as exc:
        raise SafetensorsError(f"not valid JSON: {exc.msg} at byte {exc.pos}", path=path) from exc
    except ValueError as exc:  # an integer of more digits than Python converts
        raise SafetensorsError(f"not valid JSON: {str(exc)[:200]}", path=path) from exc
    except RecursionError as exc:
        raise SafetensorsError("JSON nested too deeply", path=path) from exc
    except MemoryError as exc:
        raise SafetensorsError("JSON too large to parse", path=path) from exc


def _short(value) -> str:
    """A value of the header for a message: at most about 80 characters, cheap for any size."""
    if (
        type(value) is list
        and len(value) <= MAX_NDIM
        and all(type(v) is int and -(1 << 64) < v < 1 << 64 for v in value)
    ):
        text = str(value)
    elif type(value) is str:
        text = json.dumps(value[:80])
    else:
        text = f"a JSON {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _check_shape(dtype: str, shape, path: str | None) -> None:
    if len(shape) > MAX_NDIM or any(type(d) is not int or d < 0 for d in shape):
        raise SafetensorsError(
            f"shape must be a list of at most {MAX_NDIM} non-negative integers", path=path
        )
    if math.prod(max(d, 1) for d in shape) * ITEMSIZE[dtype] > MAX_ELEMENTS:
        raise SafetensorsError(
            f"shape {_short(list(shape))} spans more than 2**60 bytes (empty "
            "dimensions counted as 1)",
            path=path,
        )


def _entry(name: str, value, path: str | None) -> TensorEntry:
    if not name:
        raise SafetensorsError("a tensor has an empty name", path=path)
    if type(value) is not dict:
        raise SafetensorsError("a tensor entry must be an object", path=path)
    for field in ("dtype", "shape", "data_offsets"):
        if field not in value:
            raise SafetensorsError(f"the tensor entry has no {field!r}", path=path)
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if type(dtype) is not str or dtype not in DTYPES:
        raise SafetensorsError(
            f"unknown dtype {_short(dtype)} (safetensors dtypes: {', '.join(DTYPES)})", path=path
        )
    if type(shape) is not list:
        raise SafetensorsError(
            f"shape must be a list of at most {MAX_NDIM} non-negative integers", path=path
        )
    _check_shape(dtype, shape, path)
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or any(type(o) is not int or o < 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise SafetensorsError(
            "data_offsets must be [begin, end] with 0 <= begin <= end", path=path
        )
    start, end = offsets
    need = _nbytes(dtype, shape)
    if end - start != need:
        raise SafetensorsError(
            f"data_offsets [{start}, {end}] span {end - start} bytes, a "
            f"{dtype} tensor of shape {_short(shape)} has {need}",
            path=path,
        )
    return TensorEntry(name, dtype, tuple(shape), start, end)
