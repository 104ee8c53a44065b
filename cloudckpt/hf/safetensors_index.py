"""Safetensors headers and the index naming the files: parsed from untrusted bytes. Pure.

A safetensors file (https://huggingface.co/docs/safetensors) is ``N`` (8 bytes, little-endian
u64), ``N`` bytes of UTF-8 JSON (the header, an object), then the data section. The header maps
each tensor name to ``{"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}`` (offsets
into the data section) and may hold ``"__metadata__"`` (str -> str). A sharded checkpoint comes
with an index, ``model.safetensors.index.json``: ``{"weight_map": {tensor: file}, ...}``.

Contract: every function here takes bytes from a store (anyone may have written them) and either
returns validated values or raises :class:`~cloudckpt.errors.SafetensorsError` whose ``path``
names the file and the entry; never another exception (deep nesting, huge numbers, bad UTF-8
included). Refused: a header length past the file's end or over :data:`MAX_HEADER_BYTES`, JSON
that is not an object, duplicate names, ``NaN``/``Infinity``, a dtype outside
:data:`SAFETENSORS_DTYPES`, a shape that is not a list of at most
:data:`~cloudckpt.manifest.MAX_NDIM` non-negative ints spanning at most 2**60 bytes (as
a cloudckpt manifest), offsets that are not ``0 <= begin <=
end <= data size``, a byte length other than the shape's elements times the dtype's size, two
tensors sharing a byte. Unknown keys of a tensor entry are ignored (as safetensors does); holes
in the data section are allowed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from cloudckpt.errors import SafetensorsError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_ELEMENTS, MAX_NDIM
from cloudckpt.manifest.validation import validate_object_key

#: bytes of the length prefix of a safetensors file.
PREFIX_BYTES = 8
#: the longest header accepted (the limit of the safetensors library itself).
MAX_HEADER_BYTES = 100_000_000
#: the largest index file accepted.
MAX_INDEX_BYTES = 64 << 20
METADATA_KEY = "__metadata__"

#: safetensors dtype -> cloudckpt's (torch's) dtype name; others are refused.
SAFETENSORS_DTYPES: Mapping[str, str] = MappingProxyType({
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
})


@dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor of a file: cloudckpt dtype name, shape, bytes ``[begin, end)`` of the data
    section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsFile:
    """A parsed file: its key (relative to the checkpoint folder), size, header length, tensors
    (header order) and ``__metadata__``. The data section starts at :attr:`data_start`."""

    key: str
    size: int
    header_len: int
    tensors: tuple[SafetensorsTensor, ...]
    metadata: Mapping[str, str]

    @property
    def data_start(self) -> int:
        return PREFIX_BYTES + self.header_len


def _where(key: str, entry: str | None = None) -> str:
    return f"{key}: {json.dumps(entry)}" if entry is not None else key


def header_length(prefix: bytes, *, key: str, size: int) -> int:
    """The header length ``N`` from a file's first 8 bytes, checked against the file's ``size``
    and :data:`MAX_HEADER_BYTES` (so nothing is read or allocated for a false length)."""
    if size < PREFIX_BYTES + 2 or len(prefix) != PREFIX_BYTES:
        raise SafetensorsError(f"{size} bytes is too short for a safetensors file",
                               path=_where(key))
    n = int.from_bytes(prefix, "little")
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"header length {n} is over the {MAX_HEADER_BYTES} bytes a "
                               f"safetensors header may have", path=_where(key))
    if n < 2 or PREFIX_BYTES + n > size:
        raise SafetensorsError(f"header length {n} does not fit in the file's {size} bytes",
                               path=_where(key))
    return n


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def _unique_pairs(pairs):
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {json.dumps(k)[:80]}")
        out[k] = v
    return out


def load_json(raw: bytes, *, path: str):
    """JSON from untrusted bytes: UTF-8, no duplicate keys, no NaN/Infinity; any failure (deep
    nesting, huge numbers included) is a :class:`SafetensorsError` at ``path``."""
    try:
        return json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_unique_pairs,
                          parse_constant=_refuse_constant)
    except (ValueError, RecursionError, MemoryError) as exc:  # JSONDecodeError, UnicodeError
        raise SafetensorsError(f"not valid JSON: {str(exc)[:200]}", path=path) from exc


def _int(value, what: str, path: str) -> int:
    if type(value) is not int:
        raise SafetensorsError(f"{what} must be an integer, got {json.dumps(value)[:40]}",
                               path=path)
    return value


def _tensor(name: str, entry, data_len: int, path: str) -> SafetensorsTensor:
    if type(entry) is not dict:
        raise SafetensorsError("a tensor entry must be an object", path=path)
    dtype = entry.get("dtype")
    if type(dtype) is not str or dtype not in SAFETENSORS_DTYPES:
        raise SafetensorsError(f"dtype {json.dumps(dtype)[:40]} is not supported (supported: "
                               f"{', '.join(SAFETENSORS_DTYPES)})", path=path)
    shape = entry.get("shape")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise SafetensorsError(f"shape must be a list of at most {MAX_NDIM} integers",
                               path=path)
    dims = tuple(_int(d, "a shape dimension", path) for d in shape)
    cloud_dtype = SAFETENSORS_DTYPES[dtype]
    if any(d < 0 for d in dims) or math.prod(max(d, 1) for d in dims) \
            * DTYPE_ITEMSIZE[cloud_dtype] > MAX_ELEMENTS:
        raise SafetensorsError(f"shape {list(dims)} has a negative dimension or spans more than "
                               f"2**60 bytes (empty dimensions counted as 1)", path=path)
    offsets = entry.get("data_offsets")
    if type(offsets) is not list or len(offsets) != 2:
        raise SafetensorsError("data_offsets must be a list [begin, end]", path=path)
    begin, end = (_int(o, "a data offset", path) for o in offsets)
    if not 0 <= begin <= end <= data_len:
        raise SafetensorsError(f"data_offsets [{begin}, {end}] are not inside the data section "
                               f"of {data_len} bytes", path=path)
    nbytes = math.prod(dims) * DTYPE_ITEMSIZE[cloud_dtype]
    if end - begin != nbytes:
        raise SafetensorsError(f"data_offsets span {end - begin} bytes, shape {list(dims)} of "
                               f"{dtype} needs {nbytes}", path=path)
    return SafetensorsTensor(name, cloud_dtype, dims, begin, end)


def parse_header(header: bytes, *, key: str, size: int) -> SafetensorsFile:
    """Parse and validate the header bytes (without the 8-byte prefix) of file ``key`` of
    ``size`` bytes (see the module doc for what is refused)."""
    n = len(header)
    if n < 2 or n > MAX_HEADER_BYTES or PREFIX_BYTES + n > size:
        raise SafetensorsError(f"header length {n} does not fit in the file's {size} bytes",
                               path=_where(key))
    doc = load_json(header, path=_where(key))
    if type(doc) is not dict:
        raise SafetensorsError("the header is not a JSON object", path=_where(key))
    data_len = size - PREFIX_BYTES - n
    metadata: dict[str, str] = {}
    tensors = []
    for name, entry in doc.items():
        if name == METADATA_KEY:
            if type(entry) is not dict or any(type(v) is not str for v in entry.values()):
                raise SafetensorsError("__metadata__ must map strings to strings",
                                       path=_where(key, name))
            metadata = entry
            continue
        tensors.append(_tensor(name, entry, data_len, _where(key, name)))
    by_start = sorted((t for t in tensors if t.end > t.begin), key=lambda t: t.begin)
    for a, b in zip(by_start, by_start[1:]):
        if b.begin < a.end:
            raise SafetensorsError(f"bytes [{b.begin}, {b.end}) are also those of "
                                   f"{json.dumps(a.name)} ([{a.begin}, {a.end}))",
                                   path=_where(key, b.name))
    return SafetensorsFile(key, size, n, tuple(tensors), MappingProxyType(metadata))


def parse_index(raw: bytes, *, key: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> file key) of an index file ``key``; every file key is
    a safe relative key (no ``..``, not absolute: see
    :func:`~cloudckpt.manifest.validate_object_key`)."""
    if len(raw) > MAX_INDEX_BYTES:
        raise SafetensorsError(f"{len(raw)} bytes is more than the {MAX_INDEX_BYTES} an index "
                               f"may have", path=_where(key))
    doc = load_json(raw, path=_where(key))
    weight_map = doc.get("weight_map") if type(doc) is dict else None
    if type(weight_map) is not dict:
        raise SafetensorsError("an index must be an object with a \"weight_map\" object",
                               path=_where(key))
    for name, file in weight_map.items():
        why = validate_object_key(file) if type(file) is str else "a file name must be a string"
        if why:
            raise SafetensorsError(why, path=_where(key, name))
    return weight_map


def catalog(files: Sequence[SafetensorsFile],
            weight_map: Mapping[str, str] | None = None) -> dict[str, tuple[int, SafetensorsTensor]]:
    """Every tensor of ``files``: name -> (index of its file, tensor), in file then header
    order. A name in two files is refused; with an index, every name it maps must be in the
    header of the file it names."""
    found: dict[str, tuple[int, SafetensorsTensor]] = {}
    for i, f in enumerate(files):
        for t in f.tensors:
            if t.name in found:
                other = files[found[t.name][0]].key
                raise SafetensorsError(f"tensor {json.dumps(t.name)} is in two files, {other} "
                                       f"and {f.key}", path=_where(f.key, t.name))
            found[t.name] = (i, t)
    for name, file in (weight_map or {}).items():
        place = found.get(name)
        if place is None or files[place[0]].key != file:
            raise SafetensorsError(f"the index puts {json.dumps(name)} in {file}, whose header "
                                   f"does not have it", path=_where(file, name))
    return found
