"""The one-block fast path of decode_int_column (small columns, as in every rank's save plan)
refuses what the block-by-block path refuses, with bounded work."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from cloudckpt.manifest.columns import ColumnError, decode_int_column, encode_int_column


def test_small_columns_round_trip():
    rng = np.random.default_rng(3)
    for values in (np.arange(300), rng.integers(-(1 << 40), 1 << 40, 500), np.zeros(1000)):
        for delta in (False, True):
            col = encode_int_column(values, delta=delta)
            out = decode_int_column(col, expected=len(values))
            assert out.tolist() == np.asarray(values, dtype=np.int64).tolist()
            assert not out.flags.writeable


def test_small_hostile_columns_are_refused():
    packed = np.arange(100, dtype="<i8").tobytes()
    good = zlib.compress(packed)
    bomb = zlib.compress(b"\x00" * (8 << 20), 1)  # 8 MiB of zeros in a few KiB
    assert len(bomb) <= 1 << 16
    cases = {
        "short raw": ["raw", 8, "none", 100, packed[:-1]],
        "long raw": ["raw", 8, "none", 100, packed + b"\x00"],
        "truncated zlib": ["raw", 8, "zlib", 100, good[:-5]],
        "trailing bytes": ["raw", 8, "zlib", 100, good + b"x"],
        "inflates short": ["raw", 8, "zlib", 101, good],
        "inflates long": ["raw", 8, "zlib", 99, good],
        "not zlib": ["raw", 8, "zlib", 100, b"\x00" * 64],
        "bomb": ["raw", 8, "zlib", 100, bomb],
    }
    for col in cases.values():
        with pytest.raises(ColumnError):
            decode_int_column(col, expected=col[3])
