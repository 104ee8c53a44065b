"""The load plan codec: a :class:`~cloudckpt.planning.load.plan.LocalLoadPlan` as msgpack bytes.

Every rank all-gathers the encoded plans and decodes every one (the read-once assignment is a
function of all of them), so the format is columnar (the :class:`ReadTable` columns, delta
encoded) and identical headers (names and ndims, the usual case across ranks) decode once
(:data:`HEADER_CACHE`). Decoding validates: malformed bytes raise
:class:`~cloudckpt.errors.PlanningError`, never anything else.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import numpy as np
import numpy.typing as npt

from cloudckpt.errors import PlanningError
from cloudckpt.manifest.columns import ColumnError, decode_int_column, encode_int_column
from cloudckpt.manifest.dtypes import MAX_NDIM
from cloudckpt.planning.load.plan import LocalLoadPlan, ReadTable
from cloudckpt.planning.lru import LRUCache

LOAD_PLAN_FORMAT = "cloudckpt.load_plan"

HEADER_CACHE: LRUCache[bytes, tuple[tuple[str, ...], np.ndarray]] = LRUCache(16)
"""Decoded load plan headers by their bytes (a memo of a pure decode: never stale)."""


def _pack_header(names: Sequence[str], ndims: npt.ArrayLike) -> bytes:
    return msgpack.packb(
        [list(names), np.asarray(ndims, dtype=np.int64).tolist()], use_bin_type=True
    )


def _unpack_header(data: object) -> tuple[tuple[str, ...], np.ndarray]:
    """Names and ndims of a load plan; identical headers (the usual case) decode once and are
    shared."""
    if not isinstance(data, bytes):
        raise PlanningError("bad load plan header")
    hit = HEADER_CACHE.get(data)
    if hit is not None:
        return hit
    try:
        names, ndims = msgpack.unpackb(data, raw=False)
        ndims_arr = np.array(ndims, dtype=np.int64)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise PlanningError(f"bad load plan header: {exc}") from exc
    if (
        not (isinstance(names, list) and len(names) == len(ndims_arr) and ndims_arr.ndim == 1)
        or not set(map(type, names)) <= {str}
        or (len(ndims_arr) and not 0 <= ndims_arr.min() <= ndims_arr.max() <= MAX_NDIM)
    ):
        raise PlanningError("bad load plan header")
    hit = (tuple(names), ndims_arr)
    hit[1].flags.writeable = False
    HEADER_CACHE.put(data, hit)
    return hit


def encode_local_load_plan(plan: LocalLoadPlan) -> bytes:
    """msgpack bytes of a load plan (columnar; see :class:`ReadTable`)."""
    t = plan.table
    return msgpack.packb(
        {
            "format": LOAD_PLAN_FORMAT,
            "version": 1,
            "rank": plan.rank,
            "header": _pack_header(t.names, t.ndims),
            "name_index": encode_int_column(t.name_index, delta=True),
            "request_index": encode_int_column(t.request_index, delta=True),
            "chunk_index": encode_int_column(t.chunk_index, delta=True),
            "dest_offsets": encode_int_column(t.dest_offsets, delta=True),
            "src_offsets": encode_int_column(t.src_offsets, delta=True),
            "lengths": encode_int_column(t.lengths, delta=True),
            "nbytes": encode_int_column(t.nbytes, delta=True),
            "broadcastable": np.packbits(t.broadcastable).tobytes(),
            "unexpected": list(plan.unexpected),
            "missing": list(plan.missing),
        },
        use_bin_type=True,
    )


def decode_local_load_plan(data: bytes) -> LocalLoadPlan:
    """Inverse of :func:`encode_local_load_plan`; raises PlanningError on malformed bytes."""
    try:
        doc = msgpack.unpackb(data, raw=False)
        if (
            not isinstance(doc, dict)
            or doc.get("format") != LOAD_PLAN_FORMAT
            or doc.get("version") != 1
        ):
            raise PlanningError("not a cloudckpt load plan (format/version)")
        names, ndims = _unpack_header(doc["header"])
        name_index = decode_int_column(doc["name_index"])
        n = len(name_index)
        if n and (name_index.min() < 0 or name_index.max() >= len(names)):
            raise PlanningError("load plan refers to an unknown name")
        ncoords = int(ndims[name_index].sum()) if n else 0
        bits = doc["broadcastable"]
        if not isinstance(bits, bytes) or len(bits) != (n + 7) // 8:
            raise PlanningError("bad broadcastable flags")
        table = ReadTable(
            names,
            ndims,
            name_index,
            decode_int_column(doc["request_index"], expected=n),
            decode_int_column(doc["chunk_index"], expected=n),
            decode_int_column(doc["dest_offsets"], expected=ncoords),
            decode_int_column(doc["src_offsets"], expected=ncoords),
            decode_int_column(doc["lengths"], expected=ncoords),
            decode_int_column(doc["nbytes"], expected=n),
            np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=n).astype(bool),
        )
        return LocalLoadPlan(
            int(doc["rank"]), table, tuple(doc["unexpected"]), tuple(doc["missing"])
        )
    except PlanningError:
        raise
    except (ColumnError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise PlanningError(f"malformed load plan: {exc}") from exc
