"""The safetensors header: building one and parsing an untrusted one. Pure (no I/O, no torch).

A safetensors file is ``N`` (8 bytes, little-endian), then ``N`` bytes of UTF-8 JSON, then the
data. The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the first data byte) and may hold ``"__metadata__"``, a str -> str map.

Contract:
- :func:`build_header` lays tensors out one after the other in the order given and pads the
  JSON with spaces so the data starts at a multiple of 8 bytes (as the safetensors library
  does); :func:`parse_header` of its bytes gives the same records back.
- :func:`parse_header` accepts exactly what the safetensors format allows and refuses anything
  else with :class:`~cloudckpt.errors.SafetensorsHeaderError` before the caller allocates or reads
  anything from it: a length over :data:`MAX_HEADER_BYTES` or past the file's end, JSON that is
  not UTF-8, not an object, nested too deep or with duplicate keys, an unknown dtype, a shape
  that is not a list of non-negative ints (at most :data:`MAX_NDIM` of them), offsets that do not
  match the shape or that overlap, leave a hole or do not end where the file does.
- Dtypes: :data:`DTYPES` maps safetensors names (``"BF16"``) to the torch dtype names cloudckpt
  uses (``"bfloat16"``); :func:`safetensors_dtype` / :func:`torch_dtype_name` convert either way
  and accept a ``torch.dtype`` (by its name, without importing torch).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from cloudckpt.errors import SafetensorsHeaderError

#: The safetensors library refuses larger headers too.
MAX_HEADER_BYTES = 100_000_000
#: Most dimensions a tensor may have (as in cloudckpt manifests).
MAX_NDIM = 64
#: The data starts at a multiple of this (the JSON is padded with spaces).
ALIGNMENT = 8
METADATA_KEY = "__metadata__"

#: safetensors dtype name -> torch dtype name (without ``torch.``).
DTYPES: Mapping[str, str] = MappingProxyType({
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
})
_FROM_TORCH = {v: k for k, v in DTYPES.items()}
#: bytes per element, by safetensors dtype name.
ITEMSIZE: Mapping[str, int] = MappingProxyType({
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8,
})
#: Floating dtypes (torch names): the ones an export's dtype cast applies to.
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                      "float8_e5m2"})


def _name_of(dtype) -> str:
    """A dtype given as a name or a ``torch.dtype`` -> its text (``torch.`` dropped)."""
    text = dtype if isinstance(dtype, str) else str(dtype)
    return text.removeprefix("torch.")


def safetensors_dtype(dtype) -> str:
    """The safetensors name (``"BF16"``) of a torch dtype, its name (``"bfloat16"``) or a
    safetensors name. ``SafetensorsHeaderError`` (a ``ValueError``) for a dtype safetensors
    cannot hold (``complex128``) or an unknown name."""
    text = _name_of(dtype)
    if text in DTYPES:
        return text
    if text in _FROM_TORCH:
        return _FROM_TORCH[text]
    raise SafetensorsHeaderError(f"dtype {text!r} has no safetensors equivalent (safetensors "
                                 f"holds {', '.join(DTYPES.values())})")


def torch_dtype_name(dtype) -> str:
    """The torch dtype name (``"bfloat16"``) of a safetensors name, a torch dtype or its name;
    ``SafetensorsHeaderError`` as :func:`safetensors_dtype`."""
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
    """A safetensors header. ``tensors`` in data order; ``data_start`` is where the data begins
    in the file (8 + the JSON's length); ``data_size`` the data's length (the file's size is
    ``data_start + data_size``)."""

    tensors: tuple[TensorEntry, ...]
    metadata: Mapping[str, str]
    data_start: int
    data_size: int

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def build_header(tensors: Sequence[tuple[str, object, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None) -> tuple[bytes, Header]:
    """The header bytes (length prefix, JSON, padding) of a file holding ``tensors``, given as
    ``(name, dtype, shape)`` in data order (dtype: torch or safetensors name, or a
    ``torch.dtype``), and the :class:`Header` they describe. ``SafetensorsHeaderError`` for a
    duplicate or reserved name, a dtype safetensors cannot hold, a bad shape or metadata that
    is not str -> str."""
    doc: dict[str, object] = {}
    meta = dict(metadata or {})
    if any(type(k) is not str or type(v) is not str for k, v in meta.items()):
        raise SafetensorsHeaderError("safetensors metadata must map str to str")
    if meta:
        doc[METADATA_KEY] = meta
    entries: list[TensorEntry] = []
    pos = 0
    for name, dtype, shape in tensors:
        if type(name) is not str or not name or name == METADATA_KEY or name in doc:
            raise SafetensorsHeaderError(f"tensor name {name!r} is empty, reserved or repeated")
        st = safetensors_dtype(dtype)
        dims = tuple(shape)
        if len(dims) > MAX_NDIM or any(type(d) is not int or d < 0 for d in dims):
            raise SafetensorsHeaderError(f"tensor {name!r}: bad shape {dims!r}")
        end = pos + _nbytes(st, dims)
        doc[name] = {"dtype": st, "shape": list(dims), "data_offsets": [pos, end]}
        entries.append(TensorEntry(name, st, dims, pos, end))
        pos = end
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % ALIGNMENT)
    if len(text) > MAX_HEADER_BYTES:
        raise SafetensorsHeaderError(f"the header would be {len(text)} bytes, more than the "
                                     f"{MAX_HEADER_BYTES} safetensors reads")
    header = Header(tuple(entries), MappingProxyType(meta), 8 + len(text), pos)
    return len(text).to_bytes(8, "little") + text, header


def header_length(prefix: bytes, *, file_size: int | None = None) -> int:
    """The JSON length ``N`` from a file's first 8 bytes, checked against
    :data:`MAX_HEADER_BYTES` and ``file_size`` (so a reader knows how much to read next)."""
    if len(prefix) < 8:
        raise SafetensorsHeaderError(f"a safetensors file starts with 8 bytes of header length; "
                                     f"got {len(prefix)} bytes")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise SafetensorsHeaderError(f"header length {n} is more than the {MAX_HEADER_BYTES} "
                                     "bytes safetensors allows")
    if file_size is not None and 8 + n > file_size:
        raise SafetensorsHeaderError(f"header length {n} reaches past the end of the "
                                     f"{file_size}-byte file")
    return n


def parse_header(data: bytes, *, file_size: int | None = None) -> Header:
    """Parse and validate the header at the start of ``data`` (the length prefix and the JSON;
    more bytes after it are ignored). With ``file_size``, the data must end exactly at the end
    of the file. Raises :class:`SafetensorsHeaderError` (see the module doc)."""
    n = header_length(data, file_size=file_size)
    if len(data) < 8 + n:
        raise SafetensorsHeaderError(f"header truncated: {len(data) - 8} of {n} bytes")
    doc = _json_object(bytes(data[8:8 + n]))
    meta_doc = doc.pop(METADATA_KEY, {})
    if type(meta_doc) is not dict or any(type(v) is not str for v in meta_doc.values()):
        raise SafetensorsHeaderError(f"{METADATA_KEY} must be an object of strings")
    entries = sorted((_entry(name, value) for name, value in doc.items()),
                     key=lambda e: (e.start, e.end))
    pos = 0
    for e in entries:
        if e.start != pos:
            what = "overlaps the tensor before it" if e.start < pos else "leaves a hole before it"
            raise SafetensorsHeaderError(f"tensor {e.name!r}: data_offsets [{e.start}, {e.end}] "
                                         f"{what} (expected to start at {pos})")
        pos = e.end
    if file_size is not None and file_size - (8 + n) != pos:
        raise SafetensorsHeaderError(f"the tensors' data is {pos} bytes, the file holds "
                                     f"{file_size - (8 + n)} after the header")
    return Header(tuple(entries), MappingProxyType(dict(meta_doc)), 8 + n, pos)


def _json_object(raw: bytes) -> dict:
    def pairs(items):
        out = {}
        for k, v in items:
            if k in out:
                raise SafetensorsHeaderError(f"key {k[:80]!r} appears twice in the header")
            out[k] = v
        return out

    def constant(name: str):
        raise SafetensorsHeaderError(f"{name} is not valid in a safetensors header")

    try:
        text = raw.decode("utf-8")
        doc = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except SafetensorsHeaderError:
        raise
    except UnicodeDecodeError as exc:
        raise SafetensorsHeaderError(f"the header is not UTF-8: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise SafetensorsHeaderError(f"the header is not valid JSON: {exc.msg} at byte "
                                     f"{exc.pos}") from exc
    except ValueError as exc:  # an integer of more digits than Python converts
        raise SafetensorsHeaderError(f"the header is not valid: {exc}"[:200]) from exc
    except RecursionError as exc:
        raise SafetensorsHeaderError("the header's JSON is nested too deeply") from exc
    if type(doc) is not dict:
        raise SafetensorsHeaderError(f"the header must be a JSON object, got "
                                     f"{type(doc).__name__}")
    return doc


def _entry(name: str, value) -> TensorEntry:
    where = f"tensor {name[:80]!r}"
    if not name:
        raise SafetensorsHeaderError("a tensor has an empty name")
    if type(value) is not dict or set(value) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsHeaderError(f"{where}: expected exactly dtype, shape and data_offsets")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if type(dtype) is not str or dtype not in DTYPES:
        raise SafetensorsHeaderError(f"{where}: unknown dtype {str(dtype)[:40]!r}")
    if (type(shape) is not list or len(shape) > MAX_NDIM
            or any(type(d) is not int or d < 0 for d in shape)):
        raise SafetensorsHeaderError(f"{where}: shape must be a list of at most {MAX_NDIM} "
                                     "non-negative integers")
    if (type(offsets) is not list or len(offsets) != 2
            or any(type(o) is not int or o < 0 for o in offsets) or offsets[0] > offsets[1]):
        raise SafetensorsHeaderError(f"{where}: data_offsets must be [begin, end] with "
                                     "0 <= begin <= end")
    start, end = offsets
    need = _nbytes(dtype, shape)
    if end - start != need:
        raise SafetensorsHeaderError(f"{where}: data_offsets [{start}, {end}] span {end - start} "
                                     f"bytes, a {dtype} tensor of shape {tuple(shape)} has "
                                     f"{need}")
    return TensorEntry(name, dtype, tuple(shape), start, end)
