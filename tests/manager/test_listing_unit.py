"""Pure parts of the manager: step prefixes, URL joining, classifying a run-root listing."""

from __future__ import annotations

import pytest

from cloudckpt.layout import (
    classify_listing,
    folder_label,
    folder_of_prefix,
    join_url,
    parse_step_dir,
    step_dir,
    step_of_name,
)
from cloudckpt.runs.retention import RetentionPolicy, select_names
from cloudckpt.storage.base import CommonPrefix, ObjectInfo


def test_step_dir_round_trip():
    assert step_dir(0) == "step-000000000000/"
    assert step_dir(1234) == "step-000000001234/"
    assert parse_step_dir(step_dir(10**13)) == 10**13
    for bad in ("step-1/", "step-0000000000001", "step-00000000000a/", "x/", "step--00000000001/"):
        assert parse_step_dir(bad) is None
    for bad in (-1, 1.0, True, "3"):
        with pytest.raises(ValueError):
            step_dir(bad)


def test_join_url():
    assert join_url("s3://b/run", "step-000000000001/") == "s3://b/run/step-000000000001"
    assert join_url("s3://b/run/", "step-000000000001/") == "s3://b/run/step-000000000001"
    assert join_url("/tmp/run", "x") == "/tmp/run/x"


def test_classify_listing():
    m = "manifest.msgpack"
    items = [
        CommonPrefix(f"{step_dir(1)}data/"),
        ObjectInfo(f"{step_dir(1)}{m}", 10, None, 1.0),
        CommonPrefix(f"{step_dir(2)}data/"),  # incomplete
        ObjectInfo(f"{step_dir(3)}{m}", 5, None, 2.0),  # complete, no data objects
        ObjectInfo("step-4/manifest.msgpack", 1),  # a trainer's name: a checkpoint too
        CommonPrefix("other/data/"),  # an incomplete one named "other"
        ObjectInfo("README", 3),  # foreign: ignored
        ObjectInfo(f"{step_dir(5)}notes.txt", 3),  # neither manifest nor data
        CommonPrefix(f"{step_dir(6)}x/data/"),  # nested deeper: ignored
        ObjectInfo(f"{step_dir(7)}x/{m}", 3),  # a manifest one level deeper: ignored
        ObjectInfo(f"../{m}", 3),  # not a safe folder name: ignored
        CommonPrefix("../data/"),
        ObjectInfo(f"a\x01b/{m}", 3),  # a control character: ignored
        ObjectInfo(f"last/pins/{'0' * 16}.step-000000000009", 3),  # pins only: retained
    ]
    folders = classify_listing(items)
    assert sorted(folders) == sorted(
        ["last", "other", "step-4"] + [step_dir(s)[:-1] for s in (1, 2, 3)]
    )
    steps = {parse_step_dir(n + "/"): st for n, st in folders.items()}
    assert steps[1].manifest.size == 10 and steps[1].has_data
    assert steps[2].manifest is None and steps[2].has_data
    assert steps[3].manifest.last_modified == 2.0 and not steps[3].has_data
    assert folders["step-4"].manifest.size == 1 and folders["other"].has_data
    assert folders["last"].retained and not folders["other"].retained


def test_folder_names_and_their_steps():
    for name in ("last", "epoch=0-step=10.ckpt", "checkpoint-500", "a b", "é", "x" * 255):
        assert folder_of_prefix(name + "/") == name
    for bad in ("..", ".", "", "a/b", "a\\b", "a\x00", "x" * 256, "a/b/"):
        assert folder_of_prefix(bad + "/") is None, bad
    assert folder_of_prefix("last") is None  # a prefix ends in "/"
    assert step_of_name(step_dir(100)[:-1]) == 100
    assert step_of_name("epoch=0-step=10.ckpt") == 10
    assert step_of_name("checkpoint-500") == 500
    assert step_of_name("last") is None and step_of_name("9" * 31) is None
    assert folder_label(step_dir(7)[:-1]) == "step 7"
    assert folder_label("last") == "last" and folder_label("a b") == "'a b'"


def test_select_names_orders_and_keeps_the_newest():
    ordered = [("last", None), ("a-1", 1), ("b-2", 2), ("c-3", 3)]
    assert select_names(ordered, RetentionPolicy(keep_last=2)) == {"last", "a-1"}
    assert select_names(ordered, RetentionPolicy(keep_every=2)) == {"last", "a-1"}
    assert select_names(ordered, RetentionPolicy(keep_last=0)) == {"last", "a-1", "b-2"}
    assert select_names(ordered, RetentionPolicy()) == set()
    assert select_names([("z", None)], RetentionPolicy(keep_last=0)) == set()


class Unpicklable:
    """Unpickling this would append to a list: proves nothing is unpickled."""

    calls: list = []

    def __reduce__(self):
        return (Unpicklable.calls.append, ("unpickled",))


def test_decode_manifest_without_pickle_never_unpickles():
    from cloudckpt.manifest.builder import ManifestBuilder
    from cloudckpt.manifest.codec import encode_manifest
    from cloudckpt.stored import decode_manifest_without_pickle

    b = ManifestBuilder(world_size=2, metadata={"step": 3}, structure=None)
    b.add_tensor("w", "float32", (4,))
    b.add_chunk("w", (0,), (4,), "data/0123456789abcdef/r00000-0000.bin", 0, 16, (123,))
    b.set_value("lr", 0.5)
    b.set_value("obj", Unpicklable(), allow_pickle=True)
    raw = encode_manifest(b.build())
    Unpicklable.calls.clear()
    manifest, pickled = decode_manifest_without_pickle(raw)
    assert pickled == ("obj",) and Unpicklable.calls == []
    assert manifest.world_size == 2 and manifest.total_bytes() == 16
    assert manifest.values["lr"] == 0.5 and manifest.values["obj"] is None
    plain = ManifestBuilder(world_size=1)
    plain.set_value("x", [1, 2])
    manifest, pickled = decode_manifest_without_pickle(encode_manifest(plain.build()))
    assert pickled == () and manifest.values["x"] == [1, 2]
