"""cloudckpt.hf.header (the one safetensors parser, of export and import) and
cloudckpt.export.shards, pure: headers built and parsed agree with the safetensors library both
ways; hand-made hostile files, random bytes and generated near-valid headers are refused with the
one typed error or parse to what the library reads; and the export's planning (files, boxes,
windows) covers every byte once, in order, within its bounds."""

from __future__ import annotations

import ast
import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cloudckpt.errors import SafetensorsError
from cloudckpt.export.shards import (
    INDEX_FILE,
    SINGLE_FILE,
    ExportTensor,
    contiguous_boxes,
    plan_shards,
    plan_windows,
)
from cloudckpt.hf.catalog import build_manifest
from cloudckpt.hf.header import (
    DTYPES,
    ITEMSIZE,
    MAX_HEADER_BYTES,
    build_header,
    header_length,
    parse_header,
    safetensors_dtype,
    torch_dtype_name,
)
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from tests.interop.safetensors_files import (
    STRICTER_THAN_LIBRARY,
    edge_files,
    hostile_files,
    pack,
    two_tensors,
)

NAMES = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12
).filter(lambda s: s != "__metadata__")
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
        assert (
            ITEMSIZE[st_name] == getattr(torch, torch_name).itemsize == DTYPE_ITEMSIZE[torch_name]
        )
        assert safetensors_dtype(getattr(torch, torch_name)) == st_name
        assert torch_dtype_name(f"torch.{torch_name}") == torch_name == torch_dtype_name(st_name)
    with pytest.raises(SafetensorsError, match="complex128"):
        safetensors_dtype(torch.complex128)
    with pytest.raises(SafetensorsError, match="empty, reserved or repeated"):
        build_header([("a", "float32", (1,)), ("a", "float32", (1,))])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(NAMES, st.tuples(st.sampled_from(sorted(DTYPES.values())), SHAPES), max_size=6),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
)
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
        assert {e.name: (e.torch_dtype, e.shape) for e in parsed.tensors} == {
            n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()
        }
        assert dict(parsed.metadata) == metadata


def _library_reads(blob: bytes):
    """The safetensors library's own reading of a file: name -> tensor, or None if refused."""
    try:
        return st_load(blob)
    except Exception:  # SafetensorError, or torch refusing what the library let through
        return None


@pytest.mark.parametrize("case", sorted(hostile_files()))
def test_hostile_files_are_refused_with_one_typed_error(case):
    """Each hand-made hostile file is refused for its own reason, naming the file, with the one
    error type; the safetensors library refuses it too, except where cloudckpt is stricter."""
    blob, words = hostile_files()[case]
    with pytest.raises(SafetensorsError, match=words) as info:
        parse_header(blob, file_size=len(blob), key="bad.safetensors")
    assert str(info.value).startswith("bad.safetensors: ") and isinstance(info.value, ValueError)
    assert info.value.path.startswith("bad.safetensors")
    assert (_library_reads(blob) is not None) == (case in STRICTER_THAN_LIBRARY)


@pytest.mark.parametrize("case", sorted(edge_files()))
def test_odd_valid_files_read_as_the_library_reads_them(case):
    blob = edge_files()[case]
    header = parse_header(blob, file_size=len(blob))
    loaded = _library_reads(blob)
    assert loaded is not None and set(loaded) == {t.name for t in header.tensors}
    for t in header.tensors:
        want = loaded[t.name]
        assert (t.torch_dtype, t.shape) == (
            str(want.dtype).removeprefix("torch."),
            tuple(want.shape),
        )
        assert (
            blob[header.data_start + t.start : header.data_start + t.end]
            == _bytes(want).numpy().tobytes()
        )


def test_padding_is_allowed_holes_are_not():
    """As the safetensors library: spaces after the JSON are fine (the data then starts after
    them); a hole between tensors, or bytes after the last one, are refused."""
    header, data = two_tensors()
    parsed = parse_header(blob := pack(header, data, pad=7), file_size=len(blob))
    assert [(t.name, t.start, t.end) for t in parsed.tensors] == [("a", 0, 24), ("b", 24, 40)]
    assert parsed.data_start == 8 + len(json.dumps(header)) + 7 and parsed.file_size == len(blob)
    header["b"]["data_offsets"] = [28, 44]
    for blob in (pack(header, data + bytes(4)), pack(two_tensors()[0], data + bytes(4))):
        with pytest.raises(SafetensorsError, match="hole|the file holds 44"):
            parse_header(blob, file_size=len(blob))
        assert _library_reads(blob) is None


def test_the_header_length_is_checked_before_anything_is_read():
    assert header_length((100).to_bytes(8, "little"), file_size=108) == 100
    assert header_length((100).to_bytes(8, "little") + b"{") == 100  # more bytes: ignored
    for n, size in [
        (101, 108),
        (MAX_HEADER_BYTES + 1, 1 << 40),
        (0, 100),
        (1, 100),
        (1 << 63, 1 << 40),
    ]:
        with pytest.raises(SafetensorsError, match="k.safetensors"):
            header_length(n.to_bytes(8, "little"), file_size=size, key="k.safetensors")
    with pytest.raises(SafetensorsError):
        header_length(b"", file_size=3)
    with pytest.raises(SafetensorsError, match="truncated"):  # the length, but not the JSON
        parse_header((100).to_bytes(8, "little") + b"{}")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 300))
def test_any_bytes_parse_or_raise_the_typed_error(junk, length):
    blob = struct.pack("<Q", length) + junk
    try:
        parse_header(blob, file_size=len(blob))
    except SafetensorsError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.integers(0, 400))
def test_any_header_bytes_give_a_sound_header_or_the_typed_error(raw, extra):
    blob = pack(raw, bytes(extra)) if len(raw) >= 2 else pack(b"{}", bytes(extra))
    try:
        parsed = parse_header(blob, file_size=len(blob))
    except SafetensorsError:
        return
    _check_sound(parsed, blob)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def near_valid_files(draw):
    """A valid layout (tensors back to back, sometimes a gap or trailing bytes) with up to two
    fields replaced by hostile values or offsets shifted (overlaps, out of range)."""
    header, pos = {}, 0
    for name in draw(st.lists(st.text(max_size=6), max_size=5, unique=True)):
        dtype = draw(st.sampled_from(["F32", "BF16", "I64", "U8", "BOOL", "F64"]))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        pos += draw(st.sampled_from([0, 0, 0, 1, 8]))
        n = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    names = [k for k in header if k != "__metadata__"]
    for _ in range(draw(st.integers(0, 2)) if names else 0):
        entry = header[draw(st.sampled_from(names))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "shift", "entry"]))
        if (
            field == "shift"
            and type(entry.get("data_offsets")) is list
            and all(type(o) is int for o in entry["data_offsets"])
        ):
            delta = draw(st.integers(-9, 9))
            entry["data_offsets"] = [o + delta for o in entry["data_offsets"]]
        elif field == "entry":
            entry.clear()
            entry.update(
                draw(st.dictionaries(st.sampled_from(["dtype", "shape", "x"]), JSON, max_size=2))
            )
        else:
            entry[field] = draw(JSON | st.sampled_from(["F4", [-1], [0, 10**30], [3, 2]]))
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=3), st.text(max_size=3) | JSON, max_size=2)
        )
    trailing = draw(st.sampled_from([0, 0, 5]))
    return pack(header, bytes((7 * i + 1) % 256 for i in range(pos + trailing)))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_valid_files())
def test_generated_headers_parse_to_sound_files_or_are_refused(blob):
    """Whatever parses is sound and is what the safetensors library reads (and a valid
    manifest); whatever the library reads and cloudckpt refuses is one of the documented
    stricter rules."""
    try:
        parsed = parse_header(blob, file_size=len(blob), key="k")
    except SafetensorsError as exc:
        if _library_reads(blob) is not None:
            assert re.search("empty name|at most 64|__metadata__|unknown dtype", str(exc)), exc
        return
    _check_sound(parsed, blob)
    manifest = build_manifest({"k": parsed}, None)  # whatever parsed is a valid manifest
    assert manifest.total_bytes() == parsed.data_size


def _check_sound(parsed, blob: bytes) -> None:
    """The tensors lie back to back from the data's start to the file's end, each spanning its
    shape's bytes, and the safetensors library reads the same tensors from the same bytes."""
    pos = 0
    for t in parsed.tensors:
        assert t.start == pos and t.nbytes == math.prod(t.shape) * ITEMSIZE[t.dtype]
        pos = t.end
    assert parsed.data_start + pos == len(blob) == parsed.file_size
    loaded = _library_reads(blob)
    assert loaded is not None and set(loaded) == {t.name for t in parsed.tensors}
    for t in parsed.tensors:
        assert (str(loaded[t.name].dtype).removeprefix("torch."), tuple(loaded[t.name].shape)) == (
            t.torch_dtype,
            t.shape,
        )
        assert (
            blob[parsed.data_start + t.start : parsed.data_start + t.end]
            == _bytes(loaded[t.name]).numpy().tobytes()
        )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=4), st.sampled_from([1, 2, 4, 8]), st.integers(1, 200))
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


TENSORS = st.lists(
    st.tuples(
        st.sampled_from(["float32", "bfloat16", "int64", "bool"]),
        st.lists(st.integers(0, 9), max_size=3),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=100, deadline=None)
@given(TENSORS, st.integers(1, 3000), st.integers(16, 300))
def test_shards_and_windows_lay_out_every_byte_once(spec, max_shard, window):
    tensors = [
        ExportTensor(f"t{i}", f"src.t{i}", dtype, tuple(shape))
        for i, (dtype, shape) in enumerate(spec)
    ]
    plan = plan_shards(tensors, max_shard, {"format": "pt"})
    files = plan.files
    assert [t for f in files for t in f.tensors] == tensors  # order kept
    if len(files) == 1:
        assert files[0].name == SINGLE_FILE
    else:
        assert [f.name for f in files] == [
            f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
        ]
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
                stride = [math.prod(entry.shape[d + 1 :]) for d in range(len(entry.shape))]
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

    allowed = {
        "__future__",
        "json",
        "math",
        "re",
        "collections.abc",
        "dataclasses",
        "types",
        "cloudckpt.errors",
        "cloudckpt.hf.header",
        "cloudckpt.hf.json_cost",
        "cloudckpt.manifest.dtypes",
    }
    package = Path(cloudckpt.__file__).parent
    for name in ("hf/header.py", "hf/json_cost.py", "export/shards.py"):
        tree = ast.parse((package / name).read_text())
        used = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        used |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert used <= allowed, (name, used - allowed)
