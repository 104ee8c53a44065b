"""Exact-type value encoding, the pickle opt-in, and malformed value bytes."""

from __future__ import annotations

import enum
import math
from collections import OrderedDict

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.errors import ManifestError, PickleNotAllowed, UnsupportedValueError
from cloudckpt.manifest.values import decode_value, encode_value, is_pickled

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**64, max_value=2**300),
    st.floats(allow_nan=False),
    st.text(),
    st.binary(),
)
hashable = st.recursive(scalars, lambda inner: st.tuples(inner, inner), max_leaves=4)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(hashable, inner, max_size=4),
    ),
    max_leaves=20,
)


def same(a, b) -> bool:
    """Equal with identical types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(
            same(k1, k2) and same(a[k1], b[k2]) for k1, k2 in zip(a, b)
        )
    return a == b


@settings(max_examples=200, deadline=None)
@given(values)
def test_round_trip_is_exact(value):
    data = encode_value(value, key="k", allow_pickle=False)
    assert same(decode_value(data, key="k", allow_pickle=False), value)
    assert not is_pickled(data, key="k")


def test_special_floats_and_exact_container_types():
    value = {"nan": math.nan, "inf": -math.inf, "t": (1, [2, (3,)]), 1: None, (1, "a"): b""}
    back = decode_value(
        encode_value(value, key="k", allow_pickle=False), key="k", allow_pickle=False
    )
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf
    assert back["t"] == (1, [2, (3,)]) and type(back["t"][1][1]) is tuple
    assert back[(1, "a")] == b"" and back[1] is None


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "value,what",
    [
        (np.float64(1.0), "numpy.float64"),
        (Color.RED, "Color"),
        (OrderedDict(a=1), "OrderedDict"),
        ({1, 2}, "set"),
        (bytearray(b"x"), "bytearray"),
        ([1, {"deep": object()}], "object"),
    ],
)
def test_unsupported_values_name_the_key(value, what):
    with pytest.raises(UnsupportedValueError) as exc:
        encode_value(value, key="optim.extra", allow_pickle=False)
    msg = str(exc.value)
    assert "'optim.extra'" in msg and what in msg and "allow_pickle=True" in msg
    assert isinstance(exc.value, TypeError)


def test_pickle_opt_in_round_trip_and_refusal():
    data = encode_value({1, 2}, key="s", allow_pickle=True)
    assert is_pickled(data, key="s")
    assert decode_value(data, key="s", allow_pickle=True) == {1, 2}
    with pytest.raises(PickleNotAllowed, match="allow_pickle=True") as exc:
        decode_value(data, key="s", allow_pickle=False)
    assert exc.value.path == 'values["s"]' and isinstance(exc.value, PermissionError)
    assert not is_pickled(
        encode_value([1], key="s", allow_pickle=True), key="s"
    )  # msgpack-able stays msgpack
    with pytest.raises(UnsupportedValueError, match="neither"):
        encode_value(lambda: 1, key="f", allow_pickle=True)


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # truncated array
        b"\x01\x02",  # extra data
        msgpack.packb(msgpack.ExtType(9, b"")),  # unknown extension
        msgpack.packb(msgpack.ExtType(1, msgpack.packb({"a": 1}))),  # tuple payload not an array
        msgpack.packb({(1,): 2}, use_bin_type=True),  # list as a map key (unhashable on decode)
        b"\xa2\xff\xfe",  # invalid utf-8
    ],
)
def test_malformed_value_bytes(data):
    with pytest.raises(ManifestError) as exc:
        decode_value(data, key="v", allow_pickle=True)
    assert exc.value.path == 'values["v"]'
