"""Hostile DCP ``.metadata`` files, generated at the opcode level, through the reader API
(``StorageReader.read_metadata`` / ``dcp.load``) and ``cloudckpt convert`` (exit 1, one line,
never "internal error"). Rules: reading one changes nothing but the objects it builds (no
attribute of any class changes), it ends in bounded time and memory with a typed error, and
lengths and offsets are checked against the data files' real sizes before any buffer exists.
``tests/interop/test_dcp_hostile.py`` covers globals outside the allow-list and malformed
fields; this file covers what the allow-list alone cannot stop."""

from __future__ import annotations

import collections
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
import tracemalloc

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from cloudckpt.cli.main import main as cli_main
from cloudckpt.dcp import StorageReader, StorageWriter
from cloudckpt.dcp.metadata import MEMORY_PER_BYTE, check_metadata, unpickle_metadata
from cloudckpt.errors import IntegrityError, InvalidRange, ManifestError
from tests.interop.helpers import failure_of
from tests.reliability.stores import REPO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HOLE = "__HOLE__"
_MD = "torch.distributed.checkpoint.metadata"


# -- the generator: a valid DCP metadata with a hostile value spliced in ----------------------


def g(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def s(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def splice(value: bytes, where: str = "planner_data") -> bytes:
    """A protocol-2 pickle of a valid ``Metadata`` whose ``where`` field holds the value that
    the opcodes ``value`` push (a fragment without memo opcodes)."""
    md = _good_metadata()
    setattr(md, where, HOLE)
    data = pickle.dumps(md, protocol=2)
    hole = s(HOLE)
    assert data.count(hole) == 1
    return data.replace(hole, value)


def build_on(cls: bytes, attr: str = "pwned", slots: bool = False) -> bytes:
    """BUILD on a global itself (a class, a function): pickle would set ``attr`` on it."""
    state = b"}" + s(attr) + b"K\x01s"
    return cls + ((b"N" + state + b"\x86") if slots else state) + b"b"


def shared_tuples(levels: int) -> bytes:
    """A tuple DAG: each level holds the one below twice (DUP), 2**levels nodes as a tree."""
    return b")" + b"2\x86" * levels


def nested_tuples(depth: int) -> bytes:
    return b")" + b"\x85" * depth


def as_key(key: bytes) -> bytes:
    return b"}" + key + b"Ns"  # {key: None}


def huge_size(n: int) -> bytes:
    """``torch.Size`` of ``n`` entries (5 bytes each)."""
    return g("torch", "Size") + b"(" + b"J\x00\x00\x01\x00" * n + b"t\x85R"


def _good_metadata() -> Metadata:
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([4]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))],
            )
        }
    )
    md.storage_data = {MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", 0, 100)}
    return md


def bare(cls):
    return cls.__new__(cls)


def partial(cls, **fields):
    obj = bare(cls)
    obj.__dict__.update(fields)
    return obj


def _metadata_with(**fields) -> bytes:
    md = _good_metadata()
    md.__dict__.update(fields)
    return pickle.dumps(md)


CLASSES = {
    "Metadata": g(_MD, "Metadata"),
    "MetadataIndex": g(_MD, "MetadataIndex"),
    "PosixPath": g("pathlib", "PosixPath"),
    "layout cache": g("torch.serialization", "_get_layout"),
    "torch.Size": g("torch", "Size"),
    "OrderedDict": g("collections", "OrderedDict"),
}
HOSTILE = {
    **{f"BUILD on {name}": splice(build_on(cls)) for name, cls in CLASSES.items()},
    **{f"slot BUILD on {name}": splice(build_on(cls, slots=True)) for name, cls in CLASSES.items()},
    "BUILD on a dtype": splice(build_on(g("torch", "float32"))),
    "BUILD twice": splice(g(_MD, "StorageMeta") + b")\x81}b}b"),
    # a MetadataIndex put in a tuple (DUP), then BUILD: its state would change after its use
    "BUILD after use": splice(
        g(_MD, "MetadataIndex") + b")\x81" + b"2}\x86" + b"0" + b"}" + s("fqn") + s("x") + b"sb"
    ),
    "shared-tuple key": splice(as_key(shared_tuples(40))),
    "nested-tuple key": splice(as_key(nested_tuples(300_000))),
    "nested lists": splice(b"]" * 100 + b"a" * 99),
    "list into itself": splice(b"]2a"),
    "empty containers": splice(b"(" + b"]" * 1_000_000 + b"l"),
    "torch.Size of 300,000": splice(huge_size(300_000)),
    "huge number": splice(b"\x8b" + (1 << 20).to_bytes(4, "little") + b"\x01" * (1 << 20)),
    "bare Metadata": pickle.dumps(bare(Metadata)),
    "bare tensor entry": _metadata_with(state_dict_metadata={"w": bare(TensorStorageMetadata)}),
    "partial tensor entry": _metadata_with(
        state_dict_metadata={"w": partial(TensorStorageMetadata, size=torch.Size([4]))}
    ),
    "bare index": splice(as_key(g(_MD, "MetadataIndex") + b")\x81"), "storage_data"),
    "bare storage info": _metadata_with(storage_data={MetadataIndex("w", [0]): bare(_StorageInfo)}),
    "unknown field": _metadata_with(extra=1),
    "field of another type": _metadata_with(storage_meta=5),
    "chunks not a list": _metadata_with(
        state_dict_metadata={
            "w": partial(
                TensorStorageMetadata,
                properties=TensorProperties(),
                size=torch.Size([4]),
                chunks="xx",
            )
        }
    ),
    "index without fqn": splice(
        as_key(g(_MD, "MetadataIndex") + b")\x81}" + s("offset") + b"Nsb"), "storage_data"
    ),
    "a set": splice(b"\x8f"),
}
# what a BUILD on a class would have set, and where
_TARGETS = [
    Metadata,
    MetadataIndex,
    pathlib.PosixPath,
    torch.Size,
    collections.OrderedDict,
    torch.float32,
]


def _write_ck(root: pathlib.Path) -> pathlib.Path:
    dcp.save({"w": torch.arange(4, dtype=torch.float32)}, storage_writer=StorageWriter(root))
    (root / ".metadata.checksums").unlink()  # a checkpoint as FileSystemWriter writes it
    return root


@pytest.fixture(scope="module")
def base_ck(tmp_path_factory) -> pathlib.Path:
    return _write_ck(tmp_path_factory.mktemp("dcpmeta") / "base")


def _with_metadata(base: pathlib.Path, at: pathlib.Path, data: bytes) -> pathlib.Path:
    shutil.copytree(base, at)
    (at / ".metadata").write_bytes(data)
    return at


def _convert_fails(src: pathlib.Path, dst: pathlib.Path, capsys) -> str:
    """``cloudckpt convert SRC DST --to cloudckpt --trust``: exit 1, one line, a typed error."""
    capsys.readouterr()
    status = cli_main(["convert", str(src), str(dst), "--to", "cloudckpt", "--trust"])
    err = capsys.readouterr().err
    assert status == 1, err
    assert err.startswith("cloudckpt convert: error: ") and err.count("\n") == 1, err
    assert "internal error" not in err
    assert not dst.exists() or not (dst / "manifest.msgpack").exists()
    return err


# -- each hostile pickle: refused by the reader and by convert, nothing changed ---------------


@pytest.mark.parametrize(
    "case", [c for c in HOSTILE if c not in ("shared-tuple key", "nested-tuple key")]
)
def test_a_hostile_metadata_is_refused_and_changes_nothing(case, base_ck, tmp_path, capsys):
    before = [dict(vars(t)) if hasattr(t, "__dict__") else None for t in _TARGETS]
    ck = _with_metadata(base_ck, tmp_path / "ck", HOSTILE[case])
    started = time.monotonic()
    with pytest.raises(ManifestError) as info:
        StorageReader(ck).read_metadata()
    refusal = str(info.value)
    assert refusal.startswith(".metadata")
    assert time.monotonic() - started < 60  # bounded: far below, generously guarded
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(4)}, storage_reader=StorageReader(ck))
    assert refusal in str(failure_of(info.value))  # DCP wraps it with its rank-local retry
    _convert_fails(ck, tmp_path / "out", capsys)
    after = [dict(vars(t)) if hasattr(t, "__dict__") else None for t in _TARGETS]
    assert after == before
    assert not hasattr(torch.float32, "pwned")


def test_the_generator_splices_into_a_metadata_that_loads(base_ck, tmp_path):
    """The hole itself holds a valid value: what the hostile cases refuse is their fragment."""
    md = unpickle_metadata(splice(s("fine")))
    assert md.planner_data == "fine" and md == unpickle_metadata(splice(s("fine")))
    assert unpickle_metadata(splice(as_key(shared_tuples(8)))).planner_data  # a small DAG is fine
    assert unpickle_metadata(splice(g("torch", "float32"))).planner_data is torch.float32
    md = _good_metadata()  # every allowed class, at each protocol DCP's writers use
    md.storage_meta = StorageMeta(checkpoint_id=pathlib.PosixPath("/a/b"), save_id="s")
    md.planner_data = collections.OrderedDict(a=("x", 1), b=[1.5, None, True, b"by", "\xe9"])
    md.state_dict_metadata["w"].properties = TensorProperties(
        dtype=torch.int8, memory_format=torch.channels_last, requires_grad=True
    )
    for protocol in (3, 4, 5):
        assert unpickle_metadata(pickle.dumps(md, protocol=protocol)) == md


def test_bare_objects_handed_to_the_reader_are_a_typed_error():
    """Metadata that did not come through read_metadata (DCP hands the planner's) is checked
    without AttributeError, however bare."""
    md = _good_metadata()
    md.state_dict_metadata["w"] = bare(TensorStorageMetadata)
    for hostile in (bare(Metadata), md, partial(Metadata, state_dict_metadata={}, storage_meta=3)):
        with pytest.raises(ManifestError):
            check_metadata(hostile)
    md = _good_metadata()
    md.storage_data = {MetadataIndex("w", [0]): bare(_StorageInfo)}
    with pytest.raises(ManifestError, match="no field"):
        check_metadata(md)


@pytest.mark.parametrize("case", ["torch.Size of 300,000", "300,000 empty lists"])
def test_metadata_memory_is_a_small_factor_of_its_size(case):
    """A torch.Size of 300,000 entries (1.5 MB), 300,000 one-byte empty lists: refused, with
    the memory traced while reading under the bound (an empty list costs 152 bytes a byte)."""
    data = HOSTILE.get(case) or splice(b"(" + b"]" * 300_000 + b"l")
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match="torch.Size|memory"):
            unpickle_metadata(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_PER_BYTE * len(data) + (8 << 20), peak


# -- cases that kill or hang a process: in a subprocess, so that a crash is a failure ----------

_SCRIPT = textwrap.dedent("""
    import sys, time
    from cloudckpt.cli.main import main
    from cloudckpt.dcp import StorageReader
    from cloudckpt.errors import ManifestError
    started = time.monotonic()
    try:
        StorageReader(sys.argv[1]).read_metadata()
        print("READ")
    except ManifestError as exc:
        print("REFUSED", exc)
    print("STATUS", main(["convert", sys.argv[1], sys.argv[2], "--to", "cloudckpt", "--trust"]))
    print("SECONDS", time.monotonic() - started)
""")


@pytest.mark.parametrize("case", ["nested-tuple key", "shared-tuple key"])
def test_a_key_that_crashes_or_hangs_pickle_is_refused_in_bounded_time(case, base_ck, tmp_path):
    ck = _with_metadata(base_ck, tmp_path / "ck", HOSTILE[case])
    try:
        res = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(ck), str(tmp_path / "out")],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO, "CLOUDCKPT_DEBUG": ""},
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: reading the .metadata did not end within 120 s")
    assert res.returncode == 0, f"{case}: the process died ({res.returncode}): {res.stderr}"
    assert "REFUSED .metadata" in res.stdout and "STATUS 1" in res.stdout, res.stdout
    assert res.stderr.count("\n") == 1 and "cloudckpt convert: error: " in res.stderr
    assert "internal error" not in res.stderr


# -- lengths and offsets against the data files' real sizes -----------------------------------


def _lying(md: Metadata, **info) -> bytes:
    ((index, good),) = md.storage_data.items()
    md.storage_data = {index: _StorageInfo(**{**vars(good), **info})}
    return pickle.dumps(md)


@pytest.mark.parametrize(
    "case", ["2^40-byte item", "1.25 GiB item", "offset past the end", "2^40-element chunk"]
)
def test_lengths_are_checked_against_the_files_before_any_buffer(case, base_ck, tmp_path, capsys):
    md = StorageReader(base_ck).read_metadata()
    if case == "2^40-byte item":
        data = _lying(md, length=1 << 40)
    elif case == "1.25 GiB item":
        data = _lying(md, length=5 << 28)
    elif case == "offset past the end":
        data = _lying(md, offset=1 << 20)
    else:
        md.state_dict_metadata["w"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([1 << 40]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 40]))],
        )
        ((index, info),) = md.storage_data.items()
        md.storage_data = {MetadataIndex("w", [0]): info}
        data = pickle.dumps(md)
    ck = _with_metadata(base_ck, tmp_path / "ck", data)
    tracemalloc.start()
    try:
        if case == "2^40-element chunk":  # no destination can exist: the reader's own steps
            reader = StorageReader(ck)
            reader.set_up_storage_reader(reader.read_metadata(), True)
            index = MetadataIndex("w", [0])
            item = ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=index,
                storage_index=index,
                dest_offsets=torch.Size([0]),
                storage_offsets=torch.Size([0]),
                lengths=torch.Size([1 << 40]),
            )
            with pytest.raises(IntegrityError, match="does not fit"):
                reader.read_data(LoadPlan([item]), planner=None)
        else:
            with pytest.raises(CheckpointException) as info:
                dcp.load({"w": torch.zeros(4)}, storage_reader=StorageReader(ck))
            err = failure_of(info.value)
            assert isinstance(err, InvalidRange) and "past the file" in str(err), err
        text = _convert_fails(ck, tmp_path / "out", capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "does not fit" in text or "past the file" in text, text
    assert peak < 64 << 20, peak


def test_a_planner_data_of_another_type_converts_with_flat_names(base_ck, tmp_path, capsys):
    for i, planner_data in enumerate((7, ["w"], {"w": 3}, {("a", 1): ("w",)})):
        md = StorageReader(base_ck).read_metadata()
        md.planner_data = planner_data
        ck = _with_metadata(base_ck, tmp_path / f"ck{i}", pickle.dumps(md))
        status = cli_main(
            ["convert", str(ck), str(tmp_path / f"out{i}"), "--to", "cloudckpt", "--trust"]
        )
        assert status == 0, capsys.readouterr().err


def test_a_global_of_torch_imports_nothing():
    """``torch.NAME`` is looked up in torch's namespace, never through torch's module
    ``__getattr__``, which imports the submodule of that name (running its code). Checked in a
    fresh interpreter, where most of these lazily imported submodules are not imported yet."""
    probe = textwrap.dedent("""
        import sys
        from cloudckpt.dcp.metadata import unpickle_metadata
        from cloudckpt.errors import ManifestError
        lazy = [n for n in ("onnx", "_inductor", "_export", "_dynamo")
                if f"torch.{n}" not in sys.modules]
        assert len(lazy) >= 2, lazy
        for name in lazy:
            global_op = b"\\x80\\x04c" + b"torch\\n" + name.encode() + b"\\n."
            try:
                unpickle_metadata(global_op)
            except ManifestError as exc:
                assert f"torch.{name}" in str(exc), exc
            else:
                raise AssertionError(f"torch.{name} was accepted")
            assert f"torch.{name}" not in sys.modules, f"torch.{name} was imported"
        print("ok")
    """)
    res = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
