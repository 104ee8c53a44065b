"""cloudckpt.hf.header and cloudckpt.hf.shards, pure: headers built and parsed agree with the
safetensors library both ways, hostile headers are refused with one typed error, and the
export's planning (files, boxes, windows) covers every byte once, in order, within its bounds."""

from __future__ import annotations

import ast
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cloudckpt.errors import SafetensorsHeaderError
from cloudckpt.hf.header import (DTYPES, ITEMSIZE, MAX_HEADER_BYTES, build_header,
                                 parse_header, safetensors_dtype, torch_dtype_name)
from cloudckpt.hf.shards import (INDEX_FILE, SINGLE_FILE, ExportTensor, contiguous_boxes,
                                 plan_shards, plan_windows)

NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                max_size=12).filter(lambda s: s != "__metadata__")
SHAPES = st.lists(st.integers(0, 5), max_size=4).map(tuple)


def _tensor(dtype: str, shape) -> torch.Tensor:
    t = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape) % 7
    return t.to(getattr(torch, dtype))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (exact, float8 included, where == would compare values)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_the_dtype_table_matches_torch_and_safetensors():
    from safetensors.torch import _TYPES  # the library's own table

    for st_name, torch_name in DTYPES.items():
        assert _TYPES[st_name] == getattr(torch, torch_name)
        assert ITEMSIZE[st_name] == getattr(torch, torch_name).itemsize
        assert safetensors_dtype(getattr(torch, torch_name)) == st_name
        assert torch_dtype_name(f"torch.{torch_name}") == torch_name == torch_dtype_name(st_name)
    with pytest.raises(SafetensorsHeaderError, match="complex128"):
        safetensors_dtype(torch.complex128)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(NAMES, st.tuples(st.sampled_from(sorted(DTYPES.values())), SHAPES),
                       max_size=6),
       st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
def test_built_headers_read_back_here_and_in_safetensors(spec, metadata):
    tensors = {name: _tensor(dtype, shape) for name, (dtype, shape) in spec.items()}
    raw, header = build_header([(n, t.dtype, t.shape) for n, t in tensors.items()], metadata)
    assert len(raw) % 8 == 0 and header.data_start == len(raw)
    data = b"".join(_bytes(t).numpy().tobytes() for t in tensors.values())
    assert parse_header(raw + data, file_size=len(raw) + len(data)) == header
    loaded = st_load(raw + data)  # the library reads what we build
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(_bytes(loaded[name]), _bytes(t))
    # and we read what the library builds
    if tensors:
        blob = st_save(tensors, metadata=metadata or None)
        parsed = parse_header(blob, file_size=len(blob))
        assert {e.name: (e.torch_dtype, e.shape) for e in parsed.tensors} == \
            {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()}
        assert dict(parsed.metadata) == metadata


def _file(doc, data_size=0, length=None) -> bytes:
    text = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + b"\0" * data_size


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize("blob, words", [
    (b"\x01\x02", "8 bytes"),
    (_file(GOOD, 8, length=MAX_HEADER_BYTES + 1), "more than"),
    (_file(GOOD, 8, length=10**6), "past the end"),
    (_file(b"\xff\xfe{}"), "not UTF-8"),
    (_file(b"{\"a\": "), "not valid JSON"),
    (_file(b"[" * 100000 + b"]" * 100000), "nested too deeply|must be a JSON object"),
    (_file(b"[1, 2]"), "JSON object"),
    (_file(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
           b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}', 16), "twice"),
    (_file({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, 8), "unknown dtype"),
    (_file({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8), "shape"),
    (_file({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4), "shape"),
    (_file({"a": {"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}}, 4), "shape"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, 8), "begin <= end"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, 12), "span 12"),
    (_file({"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 8]}}, 8),
     "span 8"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12), "overlaps"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, 16), "hole"),
    (_file(GOOD, 9), "the file holds 9"),
    (_file(GOOD, 0), "the file holds 0"),
    (_file({"a": {"dtype": "F32", "shape": [2]}}), "exactly"),
    (_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, 8), "exactly"),
    (_file({"__metadata__": {"k": 1}, **GOOD}, 8), "__metadata__"),
    (_file({"": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8), "empty name"),
    (_file(b'{"a": NaN}'), "NaN"),
    (_file(b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 8]}}',
           8), "not valid"),
])
def test_hostile_headers_are_refused_with_one_typed_error(blob, words):
    with pytest.raises(SafetensorsHeaderError, match=words):
        parse_header(blob, file_size=len(blob))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 300))
def test_any_bytes_parse_or_raise_the_typed_error(junk, length):
    blob = struct.pack("<Q", length) + junk
    try:
        parse_header(blob, file_size=len(blob))
    except SafetensorsHeaderError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=4), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 200))
def test_contiguous_boxes_cover_the_tensor_once_in_order(shape, itemsize, max_bytes):
    max_bytes = max(max_bytes, itemsize)
    flat = torch.arange(math.prod(shape)).reshape(shape)
    seen = []
    for offsets, sizes in contiguous_boxes(shape, itemsize, max_bytes):
        box = flat
        for d, (o, n) in enumerate(zip(offsets, sizes)):
            box = box.narrow(d, o, n)
        assert box.is_contiguous() or box.numel() <= 1
        values = box.reshape(-1).tolist()
        assert values == list(range(values[0], values[0] + len(values))) if values else True
        assert len(values) * itemsize <= max_bytes or 0 in shape
        seen += values
    assert seen == list(range(flat.numel()))


TENSORS = st.lists(st.tuples(st.sampled_from(["float32", "bfloat16", "int64", "bool"]),
                             st.lists(st.integers(0, 9), max_size=3)), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(TENSORS, st.integers(1, 3000), st.integers(16, 300))
def test_shards_and_windows_lay_out_every_byte_once(spec, max_shard, window):
    tensors = [ExportTensor(f"t{i}", f"src.t{i}", dtype, tuple(shape))
               for i, (dtype, shape) in enumerate(spec)]
    plan = plan_shards(tensors, max_shard, {"format": "pt"})
    files = plan.files
    assert [t for f in files for t in f.tensors] == tensors  # order kept
    if len(files) == 1:
        assert files[0].name == SINGLE_FILE
    else:
        assert [f.name for f in files] == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                           for i in range(1, len(files) + 1)]
    for f in files:  # within the limit, unless one tensor alone is larger
        assert f.header.data_size <= max_shard or len(f.tensors) == 1
        assert parse_header(f.header_bytes).tensors == f.header.tensors
        written = 0
        for pieces in plan_windows(f, window):
            end = 0
            for p in pieces:
                assert p.slot % 8 == 0 and p.slot >= end and p.slot + p.nbytes <= window
                end = p.slot + p.nbytes
                entry = f.header.tensors[p.tensor]
                itemsize = ITEMSIZE[entry.dtype]
                stride = [math.prod(entry.shape[d + 1:]) for d in range(len(entry.shape))]
                start = entry.start + itemsize * sum(o * s for o, s in zip(p.offsets, stride))
                assert start == written  # the file's bytes, in order, no gap
                written += p.nbytes
        assert written == f.header.data_size
    index = plan.index()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors)
    assert index["weight_map"] == {t.name: f.name for f in files for t in f.tensors}
    assert INDEX_FILE == "model.safetensors.index.json"


def test_header_and_shards_are_pure():
    """No I/O, no torch: only these imports (the export's planning runs on the manifest)."""
    import cloudckpt.hf

    allowed = {"__future__", "json", "math", "collections.abc", "dataclasses", "types",
               "cloudckpt.errors", "cloudckpt.hf.header"}
    for name in ("header.py", "shards.py"):
        tree = ast.parse((Path(cloudckpt.hf.__file__).parent / name).read_text())
        used = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        used |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert used <= allowed, (name, used - allowed)
