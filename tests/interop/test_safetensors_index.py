"""The safetensors header and index parser (cloudckpt.hf.safetensors_index) and the in-memory
manifest built from it (cloudckpt.hf.catalog): pure, against files written by the safetensors
library itself, hand-made hostile files and generated ones (hypothesis)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from cloudckpt.errors import ConfigError, DuplicateKeyError, ManifestError, SafetensorsError
from cloudckpt.hf.catalog import (build_manifest, encode_bundle, manifest_of_bundle,
                                  map_names, parse_bundle)
from cloudckpt.hf.safetensors_index import (MAX_HEADER_BYTES, PREFIX_BYTES, SAFETENSORS_DTYPES,
                                            catalog, header_length, parse_header, parse_index)
from cloudckpt.manifest import encode_manifest
from tests.interop.safetensors_files import hostile_files, pack, two_tensors

TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8,
                torch.uint8, torch.bool, torch.float64, torch.int32]


def parse_file(data: bytes, key: str = "m.safetensors"):
    """Parse a whole file's bytes as a reader does: prefix, then header."""
    n = header_length(data[:PREFIX_BYTES], key=key, size=len(data))
    return parse_header(data[PREFIX_BYTES:PREFIX_BYTES + n], key=key, size=len(data))


@st.composite
def tensor_dicts(draw):
    names = draw(st.lists(st.text(min_size=1, max_size=12), min_size=0, max_size=6, unique=True))
    out = {}
    for name in names:
        dtype = draw(st.sampled_from(TORCH_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        out[name] = (torch.arange(math.prod(shape)) % 7).reshape(shape).to(dtype)
    return out


@settings(max_examples=60, deadline=None)
@given(tensor_dicts())
def test_files_written_by_safetensors_parse_to_their_tensors(tensors):
    data = st_save(tensors, metadata={"format": "pt"})
    parsed = parse_file(data)
    assert parsed.metadata == {"format": "pt"}
    assert {t.name for t in parsed.tensors} == set(tensors)
    for t in parsed.tensors:
        src = tensors[t.name]
        assert t.shape == tuple(src.shape) and t.dtype == str(src.dtype).removeprefix("torch.")
        stored = data[parsed.data_start + t.begin:parsed.data_start + t.end]
        assert stored == src.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    manifest = build_manifest([parsed], None)
    assert not manifest.checksums and set(manifest.tensors) == set(tensors)
    for t in parsed.tensors:
        (chunk,) = manifest.tensors[t.name].chunks
        assert chunk.byte_offset == parsed.data_start + t.begin and chunk.crc32c == ()


@pytest.mark.parametrize("case", sorted(hostile_files()))
def test_hostile_files_are_refused_with_a_typed_error(case):
    data = hostile_files()[case]
    with pytest.raises(SafetensorsError) as info:
        parse_file(data, key="bad.safetensors")
    assert str(info.value).startswith("bad.safetensors"), str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_header_may_be_padded_and_have_holes_between_tensors():
    header, data = two_tensors()
    header["b"]["data_offsets"] = [28, 44]
    parsed = parse_file(pack(header, data + bytes(4), pad=7))
    assert [(t.name, t.begin, t.end) for t in parsed.tensors] == [("a", 0, 24), ("b", 28, 44)]
    assert parsed.header_len == len(json.dumps(header)) + 7


def test_the_header_length_is_checked_before_anything_is_read():
    assert header_length((100).to_bytes(8, "little"), key="k", size=108) == 100
    for n, size in [(101, 108), (MAX_HEADER_BYTES + 1, 1 << 40), (0, 100), (1 << 63, 1 << 40)]:
        with pytest.raises(SafetensorsError):
            header_length(n.to_bytes(8, "little"), key="k", size=size)
    with pytest.raises(SafetensorsError):
        header_length(b"", key="k", size=3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.integers(0, 400))
def test_any_header_bytes_give_a_file_or_a_safetensors_error(raw, extra):
    try:
        parsed = parse_header(raw, key="k", size=PREFIX_BYTES + len(raw) + extra)
    except SafetensorsError:
        return
    _check_invariants(parsed, extra)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=12)


ITEMSIZES = {"F32": 4, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8}


@st.composite
def near_valid_headers(draw):
    """A valid layout (tensors back to back, gaps allowed) with up to two fields replaced by
    hostile values or offsets shifted (overlaps, out of range). Returns (header, data size)."""
    header, pos = {}, 0
    for name in draw(st.lists(st.text(max_size=6), max_size=5, unique=True)):
        dtype = draw(st.sampled_from(sorted(ITEMSIZES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        pos += draw(st.sampled_from([0, 0, 0, 1, 8]))
        n = math.prod(shape) * ITEMSIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    names = [k for k in header if k != "__metadata__"]
    for _ in range(draw(st.integers(0, 2)) if names else 0):
        entry = header[draw(st.sampled_from(names))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "shift", "entry"]))
        if field == "shift" and type(entry.get("data_offsets")) is list \
                and all(type(o) is int for o in entry["data_offsets"]):
            delta = draw(st.integers(-9, 9))
            entry["data_offsets"] = [o + delta for o in entry["data_offsets"]]
        elif field == "entry":
            entry.clear()
            entry.update(draw(st.dictionaries(st.sampled_from(["dtype", "shape", "x"]), JSON,
                                              max_size=2)))
        else:
            entry[field] = draw(JSON | st.sampled_from(["F4", [-1], [0, 10 ** 30], [3, 2]]))
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=3),
                                                      st.text(max_size=3) | JSON, max_size=2))
    return json.dumps(header).encode(), pos + draw(st.sampled_from([0, 0, 5]))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_valid_headers())
def test_generated_headers_parse_to_sound_files_or_are_refused(generated):
    raw, data_len = generated
    try:
        parsed = parse_header(raw, key="k", size=PREFIX_BYTES + len(raw) + data_len)
    except SafetensorsError:
        return
    _check_invariants(parsed, data_len)
    manifest = build_manifest([parsed], None)  # whatever parsed is a valid manifest
    assert manifest.total_bytes() == sum(t.end - t.begin for t in parsed.tensors)


def _check_invariants(parsed, data_len: int) -> None:
    spans = []
    for t in parsed.tensors:
        assert 0 <= t.begin <= t.end <= data_len
        assert t.end - t.begin == math.prod(t.shape) * np.dtype(
            {"bfloat16": "u2", "float8_e4m3fn": "u1", "float8_e5m2": "u1"}.get(t.dtype, t.dtype)
        ).itemsize
        if t.end > t.begin:
            spans.append((t.begin, t.end))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_the_index_names_safe_relative_files():
    raw = json.dumps({"metadata": {"total_size": 1}, "weight_map": {"a": "m-1.safetensors"}})
    assert parse_index(raw.encode(), key="i.json") == {"a": "m-1.safetensors"}
    for bad in ([], {"weight_map": []}, {"weight_map": {"a": "../x.safetensors"}},
                {"weight_map": {"a": "/etc/x"}}, {"weight_map": {"a": 3}}, {"nothing": {}}):
        with pytest.raises(SafetensorsError):
            parse_index(json.dumps(bad).encode(), key="i.json")
    with pytest.raises(SafetensorsError):
        parse_index(b'{"weight_map": {"a": "x", "a": "y"}}', key="i.json")


def _two_files():
    header, data = two_tensors()
    one = parse_file(pack(header, data), "one.safetensors")
    two = parse_file(pack({"c": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}},
                          bytes(8)), "two.safetensors")
    return one, two


def test_a_tensor_in_two_files_or_missing_from_the_file_the_index_names_is_refused():
    one, two = _two_files()
    assert list(catalog([one, two])) == ["a", "b", "c"]
    with pytest.raises(SafetensorsError, match="two files"):
        catalog([one, parse_file(pack(*two_tensors()), "copy.safetensors")])
    assert catalog([one, two], {"a": "one.safetensors", "c": "two.safetensors"})
    with pytest.raises(SafetensorsError, match="does not have it"):
        catalog([one, two], {"a": "two.safetensors"})
    with pytest.raises(SafetensorsError, match="does not have it"):
        catalog([one, two], {"zzz": "one.safetensors"})


def test_key_map_renames_drops_and_refuses_collisions():
    names = ["model.a", "model.b", "lm_head"]
    assert map_names(names, None) == names
    assert map_names(names, {"model.a": "x"}) == ["x", "model.b", "lm_head"]
    assert map_names(names, lambda n: n.removeprefix("model.") if n != "lm_head" else None) \
        == ["a", "b", None]
    with pytest.raises(DuplicateKeyError):
        map_names(names, lambda n: "same")
    with pytest.raises(ConfigError):
        map_names(names, lambda n: 3)
    with pytest.raises(ConfigError):
        map_names(names, 42)


def test_the_bundle_round_trips_and_its_manifest_is_never_stored():
    header, data = two_tensors()
    raw_index = json.dumps({"weight_map": {"a": "one.safetensors"}}).encode()
    body = json.dumps(header).encode()
    bundle = encode_bundle([("one.safetensors", 8 + len(body) + len(data), body)],
                           ("model.safetensors.index.json", raw_index))
    files, weight_map = parse_bundle(bundle)
    assert weight_map == {"a": "one.safetensors"} and files[0].key == "one.safetensors"
    manifest = manifest_of_bundle(bundle, {"a": "renamed"})
    assert list(manifest.tensors) == ["renamed", "b"]
    assert manifest.tensors["b"].chunks[0].byte_offset == 8 + len(body) + 24
    with pytest.raises(ManifestError, match="cannot be stored"):
        encode_manifest(manifest)
    for bad in (b"", b"\x93\x01\x02\x03", encode_bundle([("k", "size", b"{}")], None)[:-1]):
        with pytest.raises(SafetensorsError):
            parse_bundle(bad)
