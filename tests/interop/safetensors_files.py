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
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [pos, pos + len(body)]}
        data += body
        pos += len(body)
    return pack(header, data)


def two_tensors() -> tuple[dict, bytes]:
    """A valid header (dict) of two float32 tensors and its data section."""
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}
    return header, bytes(range(40))


def hostile_files() -> dict[str, bytes]:
    """Name -> file bytes that every reader must refuse with ``SafetensorsError``."""
    header, data = two_tensors()

    def changed(name, field, value):
        h = json.loads(json.dumps(header))
        h[name][field] = value
        return pack(h, data)

    return {
        "length past the end": pack(header, data, length=10_000),
        "huge length": pack(header, data, length=1 << 62),
        "length too small": pack(header, data, length=1),
        "truncated file": pack(header, data)[:5],
        "bad json": pack(b'{"a": {"dtype": "F32", ', data),
        "not an object": pack(b"[1, 2, 3]", data),
        "not utf-8": pack(b'{"\xff\xfe": 1}', data),
        "deep nesting": pack(b"[" * 100_000 + b"]" * 100_000, data),
        "nan": pack(b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 24]}}', data),
        "huge number": pack(b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], '
                            b'"data_offsets": [0, 24]}}', data),
        "duplicate name": pack(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
                               b' "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
                               data),
        "unknown dtype": changed("a", "dtype", "F4"),
        "dtype not a string": changed("a", "dtype", 4),
        "offset past the data": changed("b", "data_offsets", [24, 44]),
        "offsets reversed": changed("b", "data_offsets", [40, 24]),
        "negative offset": changed("a", "data_offsets", [-4, 20]),
        "float offset": changed("a", "data_offsets", [0.0, 24]),
        "three offsets": changed("a", "data_offsets", [0, 12, 24]),
        "length does not match shape": changed("a", "shape", [2, 2]),
        "negative dimension": changed("a", "shape", [-2, -3]),
        "oversized empty shape": pack({"z": {"dtype": "F32", "shape": [0, 1 << 40, 1 << 40],
                                             "data_offsets": [0, 0]}}, data),
        "bool dimension": changed("b", "shape", [True, 4]),
        "shape not a list": changed("a", "shape", "2x3"),
        "too many dimensions": changed("a", "shape", [1] * 65),
        "overlapping tensors": changed("b", "data_offsets", [20, 36]),
        "entry not an object": pack({"a": header["a"], "b": [24, 40]}, data),
        "metadata not strings": pack({**header, "__metadata__": {"format": 1}}, data),
    }
