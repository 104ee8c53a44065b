"""A hostile DCP checkpoint cannot run code through cloudckpt's reader: ``.metadata`` goes through
a restricted unpickler (any global outside DCP's metadata classes is refused before it is
called), malformed fields are refused before any data is read, and non-tensor values that
torch's weights_only unpickler refuses never reach DCP's planner (which would unpickle them with
weights_only=False) unless ``allow_pickle=True``."""

from __future__ import annotations

import fractions
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from cloudckpt.dcp import StorageReader, StorageWriter
from cloudckpt.dcp.metadata import unpickle_metadata
from cloudckpt.errors import CloudCkptError, ManifestError, PickleNotAllowed
from tests.interop.helpers import failure_of

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Call:
    """Pickles as a call of ``fn(*args)``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _metadata(**fields) -> Metadata:
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
    for k, v in fields.items():
        setattr(md, k, v)
    return md


def _write(folder, data: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".metadata").write_bytes(data)


def test_a_real_metadata_passes(tmp_path):
    _write(tmp_path, pickle.dumps(_metadata()))
    md = StorageReader(tmp_path).read_metadata()
    assert md.state_dict_metadata["w"].size == torch.Size([4])


@pytest.mark.parametrize("attack", ["os.system", "eval", "exec via getattr", "planner_data"])
def test_metadata_that_would_run_code_is_refused_and_runs_nothing(tmp_path, attack):
    marker = tmp_path / "ran"
    command = f"touch {marker}"
    payload = {
        "os.system": _Call(os.system, command),
        "eval": _Call(eval, f"__import__('os').system({command!r})"),
        "exec via getattr": _Call(
            getattr, __builtins__ if isinstance(__builtins__, dict) else __builtins__, "exec"
        ),
        "planner_data": _metadata(planner_data=_Call(os.system, command)),
    }[attack]
    _write(tmp_path / "ck", pickle.dumps(payload))
    with pytest.raises(ManifestError, match="not unpickled"):
        StorageReader(tmp_path / "ck").read_metadata()
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(4)}, storage_reader=StorageReader(tmp_path / "ck"))
    assert "not unpickled" in str(failure_of(info.value))
    assert not marker.exists()


# Globals a hostile file could name, as the GLOBAL opcode (protocol 0-3) and STACK_GLOBAL (4+):
DANGEROUS = [
    ("os", "system"),
    ("posix", "system"),
    ("subprocess", "Popen"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("importlib", "import_module"),
    ("pickle", "loads"),
    ("torch", "load"),
    ("torch", "save"),
    ("torch", "from_file"),
    ("torch.serialization", "load"),
    ("collections", "Counter"),
    ("torch.distributed.checkpoint.metadata", "torch"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ("numpy", "load"),
    ("shutil", "rmtree"),
    ("cloudckpt.runtime.loop", "reset"),
]


def _global_opcode(module: str, name: str, stack: bool) -> bytes:
    if stack:
        enc = [s.encode() for s in (module, name)]
        body = b"".join(b"\x8c" + bytes([len(e)]) + e for e in enc) + b"\x93"
        return b"\x80\x04" + body + b"."
    return b"c" + f"{module}\n{name}\n".encode() + b"."


@pytest.mark.parametrize("module,name", DANGEROUS)
@pytest.mark.parametrize("stack", [False, True], ids=["GLOBAL", "STACK_GLOBAL"])
def test_every_global_outside_the_allow_list_is_refused(module, name, stack):
    with pytest.raises(ManifestError, match=f"{module}.{name}"):
        unpickle_metadata(_global_opcode(module, name, stack))


def test_what_metadata_holds_is_admitted():
    assert unpickle_metadata(_global_opcode("torch", "bfloat16", True)) is torch.bfloat16
    assert unpickle_metadata(_global_opcode("torch", "Size", False)) is torch.Size


@pytest.mark.parametrize(
    "case",
    [
        "not a pickle",
        "truncated",
        "a dict",
        "escaping file name",
        "absolute file name",
        "negative offset",
        "chunk outside",
        "bool length",
    ],
)
def test_malformed_metadata_is_a_typed_error(tmp_path, case):
    good = pickle.dumps(_metadata())
    md = _metadata()
    if case == "escaping file name":
        md.storage_data = {MetadataIndex("w", [0]): _StorageInfo("../../etc/passwd", 0, 10)}
    elif case == "absolute file name":
        md.storage_data = {MetadataIndex("w", [0]): _StorageInfo("/etc/passwd", 0, 10)}
    elif case == "negative offset":
        md.storage_data = {MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", -5, 10)}
    elif case == "bool length":
        md.storage_data = {MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", 0, True)}
    elif case == "chunk outside":
        md.state_dict_metadata["w"].chunks = [
            ChunkStorageMetadata(torch.Size([2]), torch.Size([4]))
        ]
    data = {
        "not a pickle": b"hello, world",
        "truncated": good[: len(good) // 2],
        "a dict": pickle.dumps({"state_dict_metadata": {}}),
    }.get(case, pickle.dumps(md))
    _write(tmp_path, data)
    with pytest.raises(ManifestError) as info:
        StorageReader(tmp_path).read_metadata()
    assert isinstance(info.value, CloudCkptError) and ".metadata" in str(info.value)


def test_a_value_that_needs_more_than_weights_only_never_reaches_the_planner(tmp_path):
    marker = tmp_path / "ran"
    state = {"w": torch.ones(3), "evil": _Call(os.system, f"touch {marker}")}
    dcp.save(state, storage_writer=StorageWriter(tmp_path / "ck"))
    out = {"w": torch.zeros(3), "evil": None}
    with pytest.raises(CheckpointException) as info:
        dcp.load(out, storage_reader=StorageReader(tmp_path / "ck"))
    err = failure_of(info.value)
    assert isinstance(err, PickleNotAllowed) and "allow_pickle=True" in str(err)
    assert "'evil'" in str(err)
    assert not marker.exists()


def test_allow_pickle_hands_values_to_the_planner(tmp_path):
    counts = fractions.Fraction(1, 3)  # not in torch's weights_only allow-list
    dcp.save(
        {"w": torch.ones(3), "counts": counts, "plain": [1, (2, 3)]},
        storage_writer=StorageWriter(tmp_path / "ck"),
    )
    out = {"w": torch.zeros(3), "counts": None, "plain": None}
    with pytest.raises(CheckpointException):
        dcp.load(out, storage_reader=StorageReader(tmp_path / "ck"))
    out = {"w": torch.zeros(3), "counts": None, "plain": None}
    dcp.load(out, storage_reader=StorageReader(tmp_path / "ck", allow_pickle=True))
    assert out["counts"] == counts and out["plain"] == [1, (2, 3)]
    assert torch.equal(out["w"], torch.ones(3))


def test_a_bytes_entry_reads_as_a_value(tmp_path):
    """BytesStorageMetadata entries are values: plain ones pass the weights_only check."""
    dcp.save({"step": 7, "lr": 0.5, "name": "x"}, storage_writer=StorageWriter(tmp_path / "ck"))
    md = StorageReader(tmp_path / "ck").read_metadata()
    assert all(isinstance(v, BytesStorageMetadata) for v in md.state_dict_metadata.values())
    out = {"step": 0, "lr": 0.0, "name": ""}
    dcp.load(out, storage_reader=StorageReader(tmp_path / "ck"))
    assert out == {"step": 7, "lr": 0.5, "name": "x"}
