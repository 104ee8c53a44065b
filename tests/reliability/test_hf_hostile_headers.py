"""A safetensors header built to amplify when parsed is refused before it is parsed (issue 28).

A header of up to 100 MB whose JSON decodes into far more Python objects than its bytes (empty
objects, tiny keys, repeated keys, tiny metadata entries, long lists of numbers) grew a load by
over a GiB before its first check ran. :mod:`cloudckpt.hf.json_cost` estimates what the parse
allocates from token counts of the bytes and refuses the document over
``MAX_PARSE_BYTES`` (256 MiB): each generated header here is refused with one typed error,
within a few seconds, growing the process by about one copy of its bytes. The estimate is
checked to be an upper bound of what ``json.loads`` allocates (``tracemalloc``) for each kind of
token, and real headers of 100,000 tensors still fit. See docs/reliability.md, section 33.
"""

from __future__ import annotations

import json
import sys
import time
import tracemalloc

import pytest
import torch

import cloudckpt
from cloudckpt.errors import SafetensorsError
from cloudckpt.hf.header import MAX_PARSE_BYTES, _checked_object, build_header, parse_header
from cloudckpt.hf.json_cost import estimate_parse_bytes
from cloudckpt.testing.memory import PeakRSS

MiB = 1 << 20
ENTRY = b'"t":{"dtype":"U8","shape":[0],"data_offsets":[0,0]'


def amplifying(kind: str, size: int) -> bytes:
    """A header's JSON of about ``size`` bytes made of one kind of cheap token."""
    n = size // 8
    return {
        "empty objects": b'{"a":[' + b"{}," * n + b"{}]}",
        "empty lists": b'{"a":{' + ENTRY[5:] + b',"x":[' + b"[]," * n + b"[]]}}",
        "repeated keys": b"{" + b'"k":{},' * n + b'"z":{}}',
        "tiny metadata": b'{"__metadata__":{' + b'"k":"",' * n + b'"z":""}}',
        "numbers": b'{"a":{' + ENTRY[5:] + b',"x":[' + b"1e5," * n + b"1]}}",
        "long shape": b'{"a":{"dtype":"U8","shape":[' + b"1," * n + b'1],"data_offsets":[0,1]}}',
        "tensor entries": b"{" + (ENTRY + b"},") * (size // 60) + ENTRY + b"}}",
        "deep nesting": b'{"a":' + b"[" * (size // 2) + b"]" * (size // 2) + b"}",
        "wide characters": b'{"__metadata__":{"k":"' + b"a" * size + "\U0001f600".encode() + b'"}}',
    }[kind]


def framed(doc: bytes) -> bytes:
    return len(doc).to_bytes(8, "little") + doc


KINDS = [
    "empty objects",
    "empty lists",
    "repeated keys",
    "tiny metadata",
    "numbers",
    "long shape",
    "tensor entries",
    "deep nesting",
    "wide characters",
]


@pytest.mark.parametrize("kind", KINDS)
def test_an_amplifying_header_is_refused_in_bounded_time_and_memory(kind):
    raw = framed(amplifying(kind, 48 * MiB))
    start = time.monotonic()
    with PeakRSS() as m:
        with pytest.raises(SafetensorsError, match="refused before parsing") as caught:
            parse_header(raw, file_size=len(raw), key="model.safetensors")
    took = time.monotonic() - start
    print(
        f"{kind}: {len(raw) / MiB:.0f} MiB header refused in {took:.2f} s, growth "
        f"{m.growth / MiB:.0f} MiB"
    )
    assert caught.value.path == "model.safetensors" and "\n" not in str(caught.value)
    assert took < 20  # generous: the counts take well under a second here
    assert m.growth <= len(raw) + 16 * MiB  # one copy of the JSON, nothing built from it


@pytest.mark.parametrize("kind", KINDS)
def test_the_estimate_is_an_upper_bound_of_what_parsing_allocates(kind):
    doc = amplifying(kind, 256 << 10) if kind != "deep nesting" else b"[" * 900 + b"]" * 900
    text = doc.decode()
    tracemalloc.start()
    try:
        parsed = json.loads(text, object_pairs_hook=_checked_object)
    except Exception:  # noqa: BLE001 - repeated keys and deep nesting fail part way
        parsed = None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del parsed
    # the text was decoded before tracing began: the rest of the estimate covers the parse
    assert estimate_parse_bytes(doc) - sys.getsizeof(text) >= peak, kind


def test_real_headers_of_a_hundred_thousand_tensors_still_parse():
    tensors = [
        (f"model.layers.{i}.self_attn.q_proj.weight", "bfloat16", (4096, 4096))
        for i in range(100_000)
    ]
    raw, want = build_header(tensors, {"format": "pt"})
    assert estimate_parse_bytes(raw[8:]) <= MAX_PARSE_BYTES
    got = parse_header(raw)
    assert len(got.tensors) == 100_000 and got.tensors[-1] == want.tensors[-1]


def test_a_long_number_is_refused_even_without_pythons_digit_limit():
    """Python's int conversion is quadratic in digits; its 4,300-digit limit is a process-wide
    setting a program may lift. A header number of more than 40 digits is refused either way."""
    doc = b'{"a":{' + ENTRY[5:] + b',"x":' + b"7" * 20_000 + b"}}"
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(SafetensorsError, match="more than 40 digits|at most 40"):
            parse_header(framed(doc), file_size=len(doc) + 8)
    finally:
        sys.set_int_max_str_digits(old)
    ok = b'{"a":{' + ENTRY[5:] + b',"x":' + b"7" * 40 + b',"y":"' + b"7" * 99 + b'"}}'
    assert parse_header(framed(ok), file_size=len(ok) + 8).tensors[0].name == "a"


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("shape", "[1e400]", "non-negative"),
        ("shape", '["4"]', "non-negative"),
        ("shape", "[4294967296,4294967296,4294967296,4294967296]", "2\\*\\*60"),
        ("data_offsets", "[0,1e400]", "begin <= end"),
        ("data_offsets", '["0","4"]', "begin <= end"),
        ("data_offsets", "[0,18446744073709551616]", "span"),
    ],
)
def test_odd_numbers_in_a_header_get_the_typed_error(field, value, match):
    fields = {"dtype": '"U8"', "shape": "[4]", "data_offsets": "[0,4]", field: value}
    doc = ('{"a":{' + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}}").encode()
    with pytest.raises(SafetensorsError, match=match):
        parse_header(framed(doc) + bytes(4), file_size=len(doc) + 12)


def test_a_load_of_an_amplifying_file_fails_before_it_grows(tmp_path):
    """Through ``load_safetensors`` (listing, header read, bundle, parse): the typed error, and
    the process grows by a few copies of the header's bytes, not by what parsing would build."""
    doc = amplifying("tiny metadata", 40 * MiB)
    (tmp_path / "model.safetensors").write_bytes(framed(doc))
    state = {"w": torch.zeros(4)}
    with PeakRSS() as m:
        with pytest.raises(SafetensorsError, match="refused before parsing"):
            cloudckpt.load_safetensors(state, str(tmp_path))
    print(f"load of a {len(doc) / MiB:.0f} MiB amplifying header: growth {m.growth / MiB:.0f} MiB")
    assert m.growth <= 4 * len(doc) + 64 * MiB
