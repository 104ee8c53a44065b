"""The dtype allow-list shared by manifests and plans.

dtype names are torch's without the ``torch.`` prefix. Only these may appear in a manifest; a
decoder refuses any other name.
"""

from __future__ import annotations

DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

MAX_NDIM = 64
"""Most dimensions a tensor may have in a manifest or a plan."""

MAX_ELEMENTS = 1 << 60
"""Most bytes (and so elements) one tensor may span; keeps every product inside int64."""


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``; ``KeyError`` if it is not on the allow-list."""
    return DTYPE_ITEMSIZE[dtype]
