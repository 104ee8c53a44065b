"""The typed phase reports: every record round-trips, anything else is refused with
ProtocolError."""

from __future__ import annotations

import types
import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.api import reports
from cloudckpt.errors import ProtocolError
from cloudckpt.planning.load.plan import plan_local_load
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.planning.save.global_plan import plan_global_save
from cloudckpt.planning.save.local_plan import LocalSavePlan

RECORDS = sorted(
    (
        c
        for c in vars(reports).values()
        if isinstance(c, type) and issubclass(c, reports._Record) and c is not reports._Record
    ),
    key=lambda c: c.__name__,
)
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)


def _strategy(hint):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_strategy(a) for a in typing.get_args(hint)))
    if hint is type(None):
        return st.none()
    if origin is tuple:
        return st.lists(_strategy(typing.get_args(hint)[0]), max_size=8).map(tuple)
    return {
        bool: st.booleans(),
        int: st.integers(-(2**63), 2**64 - 1),
        str: TEXT,
        bytes: st.binary(max_size=64),
    }[hint]


def records(cls):
    return st.builds(cls, **{name: _strategy(hint) for name, hint in cls._hints().items()})


def test_every_record_is_covered_and_named_once():
    assert {c.__name__ for c in RECORDS} == {
        "LatestStep",
        "ManifestRead",
        "SavePlanning",
        "SaveShares",
        "SaveWritten",
        "StepSaved",
        "StopVote",
        "UploadReport",
    }
    assert len({c.RECORD for c in RECORDS}) == len(RECORDS)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip(cls, data):
    record = data.draw(records(cls))
    raw = record.encode()
    assert raw and cls.decode(raw) == record
    for other in RECORDS:  # another record's bytes are never taken for this one
        if other is not cls:
            with pytest.raises(ProtocolError, match=f"malformed {other.RECORD} report"):
                other.decode(raw)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_protocol_error(cls, raw):
    try:
        record = cls.decode(raw)
    except ProtocolError as exc:
        assert str(exc).startswith(f"malformed {cls.RECORD} report from a peer rank: ")
        assert "same cloudckpt version" in str(exc)
    else:
        assert isinstance(record, cls)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_malformed_documents_are_refused(cls, data):
    record = data.draw(records(cls))
    doc = msgpack.unpackb(record.encode(), raw=False)
    name = data.draw(st.sampled_from(sorted(cls._hints())))
    broken = {
        "truncated": record.encode()[:-1],
        "trailing bytes": record.encode() + b"\x00",
        "not a map": msgpack.packb([doc[k] for k in doc]),
        "no record name": msgpack.packb({k: v for k, v in doc.items() if k != "record"}),
        "missing field": msgpack.packb({k: v for k, v in doc.items() if k != name}),
        "extra field": msgpack.packb({**doc, "extra": 1}),
        "mistyped field": msgpack.packb({**doc, name: 1.5}),
    }
    for raw in broken.values():
        with pytest.raises(ProtocolError, match=f"malformed {cls.RECORD} report"):
            cls.decode(raw)


def test_field_types_are_exact():
    """bool is not an int and an int is not a bool, on the wire and when built."""
    with pytest.raises(ProtocolError, match="field 'step' is bool"):
        reports.LatestStep.decode(msgpack.packb({"record": "latest step", "step": True}))
    with pytest.raises(ProtocolError, match="field 'stop' is int"):
        reports.StopVote.decode(msgpack.packb({"record": "stop vote", "stop": 1}))
    with pytest.raises(ProtocolError, match="field 'cached_plans'"):
        reports.SavePlanning.decode(
            msgpack.packb(
                {
                    "record": "save planning",
                    "fingerprint": b"f",
                    "attempt": "a",
                    "cached_plans": ["not bytes"],
                    "incremental": False,
                    "with_base": False,
                    "write_rate_class": 0,
                    "plan_bytes": 0,
                }
            )
        )
    with pytest.raises(TypeError, match="StopVote: field 'stop' is int"):
        reports.StopVote(stop=1)
    with pytest.raises(TypeError, match="SavePlanning: field 'cached_plans' is list"):
        reports.SavePlanning(fingerprint=b"", attempt="", cached_plans=[b"x"])


def _plans():
    pieces = (
        PieceSpec("w", "float32", (4, 6), (0, 0), (4, 6)),
        PieceSpec("b", "int64", (3,), (0,), (3,)),
    )
    local = LocalSavePlan(rank=0, world_size=1, pieces=pieces, value_names=("step",))
    return local, plan_global_save([local], rank=0)


def test_plan_reports_round_trip_and_refuse_garbage():
    from cloudckpt.planning.save.assemble import WrittenChunks, assemble_manifest

    local, global_plan = _plans()
    back = reports.SavePlanReport.decode(reports.SavePlanReport(local).encode())
    assert back.plan == local and back.plan.fingerprint() == local.fingerprint()

    n = len(global_plan.writes)
    written = WrittenChunks(
        rank=0,
        object_keys=("data/a/r0-0.bin",),
        chunk_ids=[w.chunk_id for w in global_plan.writes],
        object_index=[0] * n,
        byte_offset=[0, 96],
        byte_length=[96, 24],
        crcs=[1, 2],
        values={"step": b"\x01"},
    )
    manifest = assemble_manifest(
        global_plan.skeleton, [written], world_size=1, checksum_block_size=1 << 20
    )
    requests = [
        PieceSpec("w", "float32", (4, 6), (2, 0), (2, 6)),
        PieceSpec("b", "int64", (3,), (0,), (3,)),
    ]
    load_plan = plan_local_load(manifest, requests, rank=0, value_names=("step",), strict=False)
    again = reports.LoadPlanReport.decode(reports.LoadPlanReport(load_plan).encode())
    assert reports.LoadPlanReport(again.plan).encode() == reports.LoadPlanReport(load_plan).encode()
    for flag in (True, False):  # whether the rank's restore may raise travels with its plan
        back = reports.LoadPlanReport.decode(reports.LoadPlanReport(load_plan, flag).encode())
        assert back.restore_can_fail is flag and back.plan == load_plan
    with pytest.raises(ProtocolError, match="malformed load plan report"):
        reports.LoadPlanReport.decode(b"\x02" + reports.LoadPlanReport(load_plan).encode()[1:])

    for cls, name in ((reports.SavePlanReport, "save plan"), (reports.LoadPlanReport, "load plan")):
        for raw in (
            b"",
            b"\xc1",
            msgpack.packb({"format": "other"}),
            reports.StopVote(stop=True).encode(),
        ):
            with pytest.raises(ProtocolError, match=f"malformed {name} report from a peer rank"):
                cls.decode(raw)


def test_distinct_structures_decodes_each_nesting_once_and_refuses_a_missing_or_false_one():
    from cloudckpt.checksum import identity_digest
    from cloudckpt.manifest.values import encode_value

    a = encode_value({"w": 1}, key="structure", allow_pickle=False)
    b = encode_value({"v": 2}, key="structure", allow_pickle=False)

    def upload(nesting: bytes) -> reports.UploadReport:
        return reports.UploadReport(
            plan_digest=b"d", bytes_written=0, objects=0, structure_digest=identity_digest(nesting)
        )

    ups = [upload(a), upload(b), upload(a)]
    sent = [reports.SaveWritten(written=b"", structure=s) for s in (a, b, b"")]
    got = reports.distinct_structures(ups, sent)
    assert got == [
        reports.SaveWritten(written=b"", structure=a).structure_value(),
        reports.SaveWritten(written=b"", structure=b).structure_value(),
    ]
    with pytest.raises(ProtocolError, match="left out a nesting no rank sent"):
        reports.distinct_structures(ups[1:], sent[1:])  # rank 1's (a) was never sent
    with pytest.raises(ProtocolError, match="not its hash's"):
        reports.distinct_structures([upload(a)], [reports.SaveWritten(written=b"", structure=b)])
