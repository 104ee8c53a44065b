"""The index and the in-memory manifest of a safetensors checkpoint (cloudckpt.hf.catalog): pure,
against files written by the safetensors library itself and hand-made ones. The headers' own
parser, hostile and generated headers: tests/interop/test_hf_header.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from cloudckpt.errors import ConfigError, DuplicateKeyError, ManifestError, SafetensorsError
from cloudckpt.hf.catalog import (
    build_manifest,
    encode_bundle,
    locate_tensors,
    manifest_of_bundle,
    map_names,
    parse_bundle,
    parse_index,
)
from cloudckpt.hf.header import parse_header
from cloudckpt.manifest.codec import encode_manifest
from tests.interop.safetensors_files import pack, two_tensors

TORCH_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float64,
    torch.int32,
]


def parse_file(data: bytes, key: str = "m.safetensors"):
    return parse_header(data, file_size=len(data), key=key)


@st.composite
def tensor_dicts(draw):
    # "__metadata__" names the header's metadata, not a tensor (refused: see the test below)
    names = draw(
        st.lists(
            st.text(min_size=1, max_size=12).filter(lambda n: n != "__metadata__"),
            min_size=0,
            max_size=6,
            unique=True,
        )
    )
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
        assert t.shape == tuple(src.shape)
        assert t.torch_dtype == str(src.dtype).removeprefix("torch.")
        stored = data[parsed.data_start + t.start : parsed.data_start + t.end]
        assert stored == src.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    manifest = build_manifest({"m.safetensors": parsed}, None)
    assert not manifest.checksums and set(manifest.tensors) == set(tensors)
    for t in parsed.tensors:
        (chunk,) = manifest.tensors[t.name].chunks
        assert chunk.byte_offset == parsed.data_start + t.start and chunk.crc32c == ()
        assert manifest.tensors[t.name].dtype == t.torch_dtype


def test_a_tensor_named_like_the_metadata_entry_is_refused():
    """The safetensors library writes a tensor named ``__metadata__`` beside the metadata entry
    (two members of one name): which one a reader sees depends on its JSON parser, so refused."""
    data = st_save({"__metadata__": torch.zeros(2)}, metadata={"format": "pt"})
    with pytest.raises(SafetensorsError):
        parse_file(data)


def test_the_index_names_safe_relative_files():
    raw = json.dumps({"metadata": {"total_size": 1}, "weight_map": {"a": "m-1.safetensors"}})
    assert parse_index(raw.encode(), key="i.json") == {"a": "m-1.safetensors"}
    for bad in (
        [],
        {"weight_map": []},
        {"weight_map": {"a": "../x.safetensors"}},
        {"weight_map": {"a": "/etc/x"}},
        {"weight_map": {"a": 3}},
        {"nothing": {}},
    ):
        with pytest.raises(SafetensorsError, match="^i.json"):
            parse_index(json.dumps(bad).encode(), key="i.json")
    for raw in (
        b'{"weight_map": {"a": "x", "a": "y"}}',
        b'{"weight_map": {"a": "\\udc00"}}',
        b'{"weight_map": NaN}',
        b"\xff",
    ):
        with pytest.raises(SafetensorsError, match="^i.json"):
            parse_index(raw, key="i.json")


def _two_files():
    header, data = two_tensors()
    return {
        "one.safetensors": parse_file(pack(header, data), "one.safetensors"),
        "two.safetensors": parse_file(
            pack({"c": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}}, bytes(8)),
            "two.safetensors",
        ),
    }


def test_a_tensor_in_two_files_or_missing_from_the_file_the_index_names_is_refused():
    files = _two_files()
    assert list(locate_tensors(files)) == ["a", "b", "c"]
    copy = parse_file(pack(*two_tensors()), "copy.safetensors")
    with pytest.raises(SafetensorsError, match="two files"):
        locate_tensors({**files, "copy.safetensors": copy})
    assert locate_tensors(files, {"a": "one.safetensors", "c": "two.safetensors"})
    with pytest.raises(SafetensorsError, match="does not have it"):
        locate_tensors(files, {"a": "two.safetensors"})
    with pytest.raises(SafetensorsError, match="does not have it"):
        locate_tensors(files, {"zzz": "one.safetensors"})


def test_key_map_renames_drops_and_refuses_collisions():
    names = ["model.a", "model.b", "lm_head"]
    assert map_names(names, None) == names
    assert map_names(names, {"model.a": "x"}) == ["x", "model.b", "lm_head"]
    assert map_names(names, lambda n: n.removeprefix("model.") if n != "lm_head" else None) == [
        "a",
        "b",
        None,
    ]
    with pytest.raises(DuplicateKeyError):
        map_names(names, lambda n: "same")
    with pytest.raises(ConfigError):
        map_names(names, lambda n: 3)
    with pytest.raises(ConfigError):
        map_names(names, 42)


def test_the_bundle_round_trips_and_its_manifest_is_never_stored():
    header, data = two_tensors()
    raw_index = json.dumps({"weight_map": {"a": "one.safetensors"}}).encode()
    blob = pack(header, data)
    head = blob[: len(blob) - len(data)]
    bundle = encode_bundle(
        [("one.safetensors", len(blob), head)], ("model.safetensors.index.json", raw_index)
    )
    files, weight_map = parse_bundle(bundle)
    assert weight_map == {"a": "one.safetensors"} and list(files) == ["one.safetensors"]
    manifest = manifest_of_bundle(bundle, {"a": "renamed"})
    assert list(manifest.tensors) == ["renamed", "b"]
    assert manifest.tensors["b"].chunks[0].byte_offset == len(head) + 24
    with pytest.raises(ManifestError, match="cannot be stored"):
        encode_manifest(manifest)
    twice = encode_bundle([("one.safetensors", len(blob), head)] * 2, None)
    for bad in (b"", b"\x93\x01\x02\x03", encode_bundle([("k", "size", b"{}")], None)[:-1], twice):
        with pytest.raises(SafetensorsError):
            parse_bundle(bad)
    # a header the bundle carries is checked against the file's size, as when read
    with pytest.raises(SafetensorsError, match="^one.safetensors: the tensors' data"):
        parse_bundle(encode_bundle([("one.safetensors", len(blob) + 1, head)], None))
