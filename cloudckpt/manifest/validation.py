"""Validation helpers of manifests: object keys, structure mappings, tensor shapes.

Pure functions; each problem is a :class:`~cloudckpt.errors.ManifestError` (or a reason string)
naming where it is.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Collection, Iterable, Sequence

import numpy as np
from numpy.typing import NDArray

from cloudckpt.errors import ManifestError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_ELEMENTS, MAX_NDIM


def tensor_path(name: str) -> str:
    """The manifest path of tensor ``name``, like ``tensors["w"]``."""
    return f"tensors[{json.dumps(name)}]"


def validate_object_key(key: object) -> str | None:
    """Return why ``key`` is not a safe object key relative to a checkpoint root, or None.

    Refused: non-strings, empty keys, absolute paths, backslashes, empty / ``.`` / ``..`` segments,
    control characters.
    """
    if type(key) is not str:
        return "object key must be a string"
    if not key:
        return "object key is empty"
    if key.startswith("/"):
        return f"object key {key!r} is absolute"
    if "\\" in key:
        return f"object key {key!r} contains a backslash"
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        return f"object key {key!r} contains a control character"
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            return f"object key {key!r} has an empty, '.' or '..' segment"
    return None


_STRUCTURE_TAGS = {"d": "dict", "o": "OrderedDict", "l": "list", "t": "tuple"}


def validate_structure(
    structure: object, tensor_names: Collection[str], value_names: Collection[str]
) -> None:
    """Check a structure mapping (see ``cloudckpt.statedict.flatten``): nodes ``[tag, body]``
    with tags d/o (body: ``[[key, node], ...]``, keys str or int), l/t (body: ``[node, ...]``),
    x (a tensor name of this manifest) or v (a value name). Raises
    ManifestError(path="structure")."""
    stack = [(structure, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > 200:
            raise ManifestError("nested deeper than 200 levels", path="structure")
        if type(node) is not list or len(node) != 2 or type(node[0]) is not str:
            raise ManifestError(f"malformed node {node!r:.80}", path="structure")
        tag, body = node
        if tag == "x" or tag == "v":
            names = tensor_names if tag == "x" else value_names
            if type(body) is not str or body not in names:
                raise ManifestError(
                    f"refers to unknown {'tensor' if tag == 'x' else 'value'} {body!r:.80}",
                    path="structure",
                )
        elif tag in _STRUCTURE_TAGS and type(body) is list:
            for child in body:
                if tag in ("d", "o"):
                    if (
                        type(child) is not list
                        or len(child) != 2
                        or type(child[0]) not in (str, int)
                    ):
                        raise ManifestError(
                            f"malformed {_STRUCTURE_TAGS[tag]} entry {child!r:.80}",
                            path="structure",
                        )
                    child = child[1]
                stack.append((child, depth + 1))
        else:
            raise ManifestError(f"malformed node {node!r:.80}", path="structure")


def flat_dims(shapes: Iterable[Sequence[object]], total: int) -> NDArray[np.int64] | None:
    """Every dim of ``shapes`` as one int64 array, or None when one is not an int or does not
    fit int64 (the caller then checks each shape one by one)."""
    dims = itertools.chain.from_iterable(shapes)
    if not set(map(type, dims)) <= {int}:
        return None
    try:
        return np.fromiter(itertools.chain.from_iterable(shapes), dtype=np.int64, count=total)
    except OverflowError:
        return None


def check_shape(name: str, dtype: str, shape: Sequence[object]) -> None:
    """Raise :class:`~cloudckpt.errors.ManifestError` unless ``shape`` is a valid shape of
    tensor ``name`` of ``dtype`` (at most :data:`MAX_NDIM` ints >= 0, at most 2**60 bytes)."""
    where = tensor_path(name)
    if len(shape) > MAX_NDIM:
        raise ManifestError(f"{len(shape)} dims, at most {MAX_NDIM} allowed", path=f"{where}.shape")
    dims = [s for s in shape if type(s) is int]
    if len(dims) != len(shape) or any(s < 0 for s in dims):
        raise ManifestError(f"bad shape {shape!r:.200}", path=f"{where}.shape")
    # every dim counted as at least 1: an empty shape's strides must fit int64 too
    if math.prod(max(s, 1) for s in dims) * DTYPE_ITEMSIZE[dtype] > MAX_ELEMENTS:
        raise ManifestError(
            f"shape {shape!r:.200} is too large (more than 2**60 bytes, empty dims counted as 1)",
            path=f"{where}.shape",
        )
