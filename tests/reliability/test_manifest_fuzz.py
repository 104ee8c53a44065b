"""Fuzzed manifests, end to end: hypothesis mutates a real checkpoint's manifest (fields replaced by
hostile values of any type, fields deleted, integer columns re-encoded with hostile numbers,
crc tables cut, object keys escaping the root, value blobs of every extension type, structure
mappings, raw byte flips and cuts; framed with a correct checksum, or one in five bare, as format
version 1), writes it into the store, and runs ``read_manifest``,
``load_full`` and ``load`` on it. The rules of ``hostile.py`` hold for every case: refused ->
``ManifestError`` everywhere and an untouched destination; accepted -> only cloudckpt integrity,
storage or planning errors; never a file outside the root, never a write; and the process's
resident memory stays bounded over the whole run.

CI runs a few thousand cases on a LocalStore and a few hundred on S3 (derandomized: the same
cases every run); the long mode (``-m slow``) runs ``CLOUDCKPT_LONG_FUZZ_CASES`` (default 30,000)
fresh random ones.
"""

from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.hostile import (
    COLUMNS,
    HOSTILE_INTS,
    HOSTILE_KEYS,
    check_refusals,
    column_values,
    delete_at,
    hostile_value_blob,
    make_target,
    pack,
    paths_of,
    reencode_column,
    run_entry_points,
    set_at,
    valid_doc,
)

pytestmark = pytest.mark.timeout(3600)

CI_LOCAL_CASES = int(os.environ.get("CLOUDCKPT_FUZZ_CASES", "2500"))
CI_S3_CASES = int(os.environ.get("CLOUDCKPT_S3_FUZZ_CASES", "300"))
LONG_CASES = int(os.environ.get("CLOUDCKPT_LONG_FUZZ_CASES", "30000"))

_ints = st.one_of(
    st.sampled_from(HOSTILE_INTS), st.integers(-(2**63), 2**64 - 1), st.integers(-3, 100)
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    _ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        HOSTILE_KEYS
        + ("float32", "cloudckpt", "raw", "delta", "zlib", "none", "x", "v", "d", "l", "t")
    ),
    st.binary(max_size=40),
)
HOSTILE_VALUES = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
STRUCTURES = st.recursive(
    st.one_of(
        st.tuples(
            st.sampled_from(["x", "v", "q"]), st.sampled_from(["w", "m.b", "v.lr", "nope", ""])
        ).map(list),
        HOSTILE_VALUES,
    ),
    lambda inner: st.tuples(
        st.sampled_from(["d", "o", "l", "t"]),
        st.lists(
            st.one_of(inner, st.tuples(st.one_of(st.text(max_size=4), _ints), inner).map(list)),
            max_size=4,
        ),
    ).map(list),
    max_leaves=8,
)

MUTATIONS = ("replace", "delete", "column", "crc", "objects", "value", "blob", "structure")


def _mutate(doc: dict, data) -> None:
    kind = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    if kind in ("replace", "delete"):
        paths = paths_of(doc)
        path = data.draw(st.sampled_from(paths), label="path")
        if kind == "replace":
            set_at(doc, path, data.draw(HOSTILE_VALUES, label="value"))
        else:
            delete_at(doc, path)
    elif kind == "column":
        section, name = data.draw(st.sampled_from(COLUMNS), label="column")
        column = doc[section][name]
        values = column_values(column)
        action = data.draw(st.sampled_from(["set", "nudge", "append", "drop"]), label="col-op")
        if action == "append" or not values:
            values.append(data.draw(st.integers(-(2**62), 2**62)))
        elif action == "drop":
            values.pop(data.draw(st.integers(0, len(values) - 1)))
        else:
            i = data.draw(st.integers(0, len(values) - 1))
            delta = data.draw(st.sampled_from([-1, 1, -8, 8, 64]))
            value = (
                values[i] + delta
                if action == "nudge"
                else data.draw(
                    st.one_of(st.sampled_from(HOSTILE_INTS), st.integers(-(2**62), 2**62))
                )
            )
            values[i] = max(-(2**63), min(2**63 - 1, value))
        doc[section][name] = reencode_column(
            column, values, delta=data.draw(st.booleans(), label="delta")
        )
    elif kind == "crc":
        crc = bytearray(doc["chunks"]["crc32c"])
        action = data.draw(st.sampled_from(["flip", "cut4", "add4", "empty"]))
        if action == "flip" and crc:
            crc[data.draw(st.integers(0, len(crc) - 1))] ^= 0xFF
        elif action == "cut4":
            del crc[-4:]
        elif action == "add4":
            crc += b"\x00\x00\x00\x00"
        else:
            crc = bytearray()
        doc["chunks"]["crc32c"] = bytes(crc)
    elif kind == "objects":
        objects = doc["objects"]
        action = data.draw(st.sampled_from(["hostile", "duplicate", "append", "swap"]))
        i = data.draw(st.integers(0, len(objects) - 1))
        if action == "hostile":
            objects[i] = data.draw(st.sampled_from(HOSTILE_KEYS))
        elif action == "duplicate":
            objects[i] = objects[(i + 1) % len(objects)]
        elif action == "append":
            objects.append(data.draw(st.sampled_from(HOSTILE_KEYS + ("data/x/extra.bin",))))
        else:
            j = data.draw(st.integers(0, len(objects) - 1))
            objects[i], objects[j] = objects[j], objects[i]
    elif kind == "value":
        names = list(doc["values"]) + ["new"]
        name = data.draw(st.sampled_from(names))
        doc["values"][name] = hostile_value_blob(
            data.draw(st.integers(0, 5)), data.draw(HOSTILE_VALUES)
        )
    elif kind == "blob":
        field = data.draw(st.sampled_from(["metadata", "structure", "values"]))
        if field == "values":
            name = data.draw(st.sampled_from(list(doc["values"])))
            holder, key = doc["values"], name
        else:
            holder, key = doc, field
        blob = bytearray(holder[key])
        if blob and data.draw(st.booleans()):
            blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
        else:
            del blob[data.draw(st.integers(0, len(blob))) :]
        holder[key] = bytes(blob)
    else:  # structure
        try:
            doc["structure"] = msgpack.packb(data.draw(STRUCTURES), use_bin_type=True)
        except (OverflowError, ValueError, TypeError):
            doc["structure"] = b"\xc1"


def _manifest_case(target, data) -> bytes:
    doc = valid_doc(target)
    # 1 in 5: a bare format version 1 manifest (no checksum): byte damage reaches the decoder
    version = 1 if data.draw(st.integers(0, 4), label="bare v1") == 0 else 2
    doc["version"] = version
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        try:
            _mutate(doc, data)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            pass  # an earlier mutation broke what this one wanted to edit: keep the doc as is
    try:
        raw = bytearray(pack(doc, version))
    except (OverflowError, ValueError, TypeError):  # msgpack cannot hold what was drawn
        raw = bytearray(target.valid)
    if data.draw(st.integers(0, 9), label="byte-level") == 0:  # 1 in 10: damage the bytes too
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        del raw[data.draw(st.integers(len(raw) // 2, len(raw))) :]
    return bytes(raw)


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _fuzz(target, cases: int, figures, *, derandomize: bool, label: str) -> dict:
    verdicts = {"refused": 0, "accepted": 0}

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(st.data())
    def case(data):
        raw = _manifest_case(target, data)
        target.write_manifest(raw)
        verdict = check_refusals(run_entry_points(target), "fuzzed manifest")
        verdicts[verdict] += 1

    before = _peak_rss()
    try:
        case()
    finally:
        target.write_manifest(target.valid)
    growth = _peak_rss() - before
    figures.add(f"fuzz cases ({label})", sum(verdicts.values()))
    figures.add(f"fuzz cases refused ({label})", verdicts["refused"])
    assert growth < 1 << 30, f"peak RSS grew by {growth / 2**20:.0f} MiB during the fuzz run"
    # the mutations must reach both outcomes, or the fuzzer is not testing much
    assert verdicts["refused"] > cases // 4 and verdicts["accepted"] > cases // 50, verdicts
    return verdicts


@pytest.fixture(scope="module")
def fuzz_local(tmp_path_factory):
    area = tmp_path_factory.mktemp("fuzz")
    return make_target(str(area / "ckpt"), area=area)


@pytest.fixture(scope="module")
def fuzz_s3(s3_server, storage):
    return make_target(
        s3_server.url(f"fuzz-{os.getpid()}/ckpt"), storage=storage, s3_server=s3_server
    )


def test_fuzzed_manifests_local_store(fuzz_local, figures):
    _fuzz(fuzz_local, CI_LOCAL_CASES, figures, derandomize=True, label="LocalStore")


def test_fuzzed_manifests_s3(fuzz_s3, figures):
    _fuzz(fuzz_s3, CI_S3_CASES, figures, derandomize=True, label="S3")


@pytest.mark.slow
def test_fuzzed_manifests_long(fuzz_local, fuzz_s3, figures):
    _fuzz(fuzz_local, LONG_CASES, figures, derandomize=False, label="LocalStore, long")
    _fuzz(fuzz_s3, max(LONG_CASES // 10, 100), figures, derandomize=False, label="S3, long")
