"""Hand-made safetensors files for the import tests: valid ones and hostile variants."""

from __future__ import annotations

import json
import struct

import numpy as np

ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8, "I32": 4}


def pack(header, data: bytes = b"", *, length: int | None = None, pad: int = 0) -> bytes:
    """A safetensors file: ``header`` (a dict, or bytes used as they are), padded with
    ``pad`` spaces, then ``data``; ``length`` overrides the 8-byte prefix."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * pad
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


def valid_file(tensors: dict[str, np.ndarray], metadata: dict | None = None) -> bytes:
    """A file holding ``tensors`` (float32 arrays) back to back, in dict order."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    data, pos = b"", 0
    for name, arr in tensors.items():
        body = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(arr.shape),
            "data_offsets": [pos, pos + len(body)],
        }
        data += body
        pos += len(body)
    return pack(header, data)


def two_tensors() -> tuple[dict, bytes]:
    """A valid header (dict) of two float32 tensors and its data section."""
    header = {
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]},
    }
    return header, bytes(range(40))


#: Hostile cases the safetensors library accepts: cloudckpt refuses them by design (see the
#: module doc of cloudckpt.hf.header). Every other hostile case the library refuses too.
STRICTER_THAN_LIBRARY = frozenset(
    {"empty name", "too many dimensions", "metadata null", "a dtype cloudckpt does not hold"}
)


def hostile_files() -> dict[str, tuple[bytes, str]]:
    """Name -> (file bytes, words of the error) that every reader must refuse with
    ``SafetensorsError``, for that reason."""
    header, data = two_tensors()

    def changed(name, field, value, new_data=data):
        h = json.loads(json.dumps(header))
        h[name][field] = value
        return pack(h, new_data)

    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    return {
        # the length prefix
        "shorter than the length prefix": (b"\x01\x02", "8 bytes"),
        "truncated file": (pack(header, data)[:5], "8 bytes"),
        "length past the end": (pack(header, data, length=10_000), "past the end"),
        "length just over 100 MB": (pack(header, data, length=100_000_001), "more than"),
        "huge length": (pack(header, data, length=1 << 62), "more than"),
        "length too small": (pack(header, data, length=1), "too short"),
        "length zero": (pack(b"", b""), "too short"),
        # the JSON
        "bad json": (pack(b'{"a": {"dtype": "F32", ', data), "not valid JSON"),
        "not an object": (pack(b"[1, 2, 3]", data), "JSON object"),
        "not utf-8": (pack(b'{"\xff\xfe": 1}', data), "not UTF-8"),
        "not utf-8 at the start": (pack(b"\xff\xfe{}", data), "not UTF-8"),
        "deep nesting": (pack(b"[" * 100_000 + b"]" * 100_000, data), "nested too deeply"),
        "nan": (
            pack(b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 24]}}', data),
            "NaN",
        ),
        "huge number": (
            pack(
                b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b"], "
                b'"data_offsets": [0, 24]}}',
                data,
            ),
            "not valid JSON",
        ),
        "duplicate name": (
            pack(
                b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
                b' "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
                bytes(8),
            ),
            "twice",
        ),
        "lone surrogate in a name": (
            pack(b'{"\\ud800": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', bytes(8)),
            "surrogate",
        ),
        "lone surrogate in metadata": (pack(b'{"__metadata__": {"k": "\\udc00"}}'), "surrogate"),
        # a tensor entry
        "empty name": (pack({"": f32}, bytes(8)), "empty name"),
        "entry not an object": (pack({"a": header["a"], "b": [24, 40]}, data), "an object"),
        "entry without data_offsets": (
            pack({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)),
            "no 'data_offsets'",
        ),
        "unknown dtype": (changed("a", "dtype", "F4"), "unknown dtype"),
        "made-up dtype": (changed("a", "dtype", "F33"), "unknown dtype"),
        "a dtype cloudckpt does not hold": (
            pack({"a": {"dtype": "F8_E4M3FNUZ", "shape": [2], "data_offsets": [0, 2]}}, bytes(2)),
            "unknown dtype",
        ),
        "dtype not a string": (changed("a", "dtype", 4), "unknown dtype"),
        "shape not a list": (changed("a", "shape", "2x3"), "shape"),
        "negative dimension": (changed("a", "shape", [-2, -3]), "non-negative"),
        "bool dimension": (changed("b", "shape", [True, 4]), "non-negative"),
        "too many dimensions": (
            pack({"a": {**f32, "shape": [1] * 65, "data_offsets": [0, 4]}}, bytes(4)),
            "at most 64",
        ),
        "oversized empty shape": (
            pack({"z": {"dtype": "F32", "shape": [0, 1 << 40, 1 << 40], "data_offsets": [0, 0]}}),
            "2\\*\\*60",
        ),
        "oversized shape": (
            pack(
                {"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 8]}}, bytes(8)
            ),
            "2\\*\\*60",
        ),
        "offsets reversed": (changed("b", "data_offsets", [40, 24]), "begin <= end"),
        "negative offset": (changed("a", "data_offsets", [-4, 20]), "begin <= end"),
        "float offset": (changed("a", "data_offsets", [0.0, 24]), "begin <= end"),
        "three offsets": (changed("a", "data_offsets", [0, 12, 24]), "begin <= end"),
        "length does not match shape": (changed("a", "shape", [2, 2]), "span 24 bytes"),
        "metadata not strings": (
            pack({**header, "__metadata__": {"format": 1}}, data),
            "__metadata__",
        ),
        "metadata null": (pack({**header, "__metadata__": None}, data), "__metadata__"),
        # the layout of the data
        "overlapping tensors": (changed("b", "data_offsets", [20, 36]), "overlap"),
        "hole before the first tensor": (
            pack({"a": {**f32, "data_offsets": [8, 16]}}, bytes(16)),
            "hole",
        ),
        "hole between tensors": (
            pack({"a": f32, "b": {**f32, "data_offsets": [12, 20]}}, bytes(20)),
            "hole",
        ),
        "offset past the data": (
            pack({**header, "b": {"dtype": "F32", "shape": [5], "data_offsets": [24, 44]}}, data),
            "data is 44 bytes, the file holds 40",
        ),
        "data past the end of the file": (pack({"a": f32}), "the file holds 0"),
        "bytes after the data": (pack(header, data + b"\0"), "the file holds 41"),
    }


def edge_files() -> dict[str, bytes]:
    """Name -> odd but valid files, which cloudckpt and the safetensors library both read."""
    header, data = two_tensors()
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    return {
        "padded header": pack(header, data, pad=7),
        "leading whitespace": pack(b"  " + json.dumps(header).encode(), data),
        "unknown key in an entry": pack({"a": {**header["a"], "x": 1}, "b": header["b"]}, data),
        "tensors listed out of data order": pack({"b": header["b"], "a": header["a"]}, data),
        "no tensors": pack({}),
        "metadata only": pack({"__metadata__": {"format": "pt"}}),
        "empty tensors sharing an offset": pack({"e": empty, "f": empty}),
        "empty tensor at the end": pack({**header, "e": {**empty, "data_offsets": [40, 40]}}, data),
        "a scalar": pack({"s": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}}, bytes(8)),
    }
