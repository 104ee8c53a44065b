"""The typed reports ranks exchange at the end of a protocol phase (``ControlChannel.phase``).

Each report is a small frozen dataclass with an explicit msgpack codec, no pickle:

- plain records (:class:`SavePlanning`, :class:`SaveShares`, :class:`UploadReport`,
  :class:`SaveWritten`, :class:`ManifestRead`, :class:`LatestStep`, :class:`StopVote`,
  :class:`StepSaved`) encode as one map ``{"record": <name>, <field>: <value>, ...}`` of
  msgpack-native fields (``bool``, ``int``, ``str``, ``bytes``, ``X | None``,
  ``tuple[X, ...]``), checked against the
  annotations both when built and when decoded;
- plan reports (:class:`SavePlanReport`, :class:`LoadPlanReport`) carry a local plan in the
  planning package's own versioned columnar codec.

``decode`` accepts exactly what ``encode`` writes: anything else (not msgpack, another record,
a missing, extra or mistyped field) raises :class:`~cloudckpt.errors.ProtocolError` naming the
record and what is wrong. Peers are ranks of the same job, so this guards against version skew
and bugs, not against an attacker; the limits of the decoders still apply.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from cloudckpt.checksum import identity_digest
from cloudckpt.errors import PlanningError, ProtocolError
from cloudckpt.manifest.values import decode_value
from cloudckpt.planning.load.plan import LocalLoadPlan
from cloudckpt.planning.load.plan_codec import decode_local_load_plan, encode_local_load_plan
from cloudckpt.planning.save.assemble import WrittenChunks, decode_written_chunks
from cloudckpt.planning.save.local_plan import (
    LocalSavePlan,
    decode_local_save_plan,
    encode_local_save_plan,
)

__all__ = [
    "LatestStep",
    "LoadPlanReport",
    "ManifestRead",
    "SavePlanReport",
    "SavePlanning",
    "SaveShares",
    "SaveWritten",
    "distinct_structures",
    "StepSaved",
    "StopVote",
    "UploadReport",
]


def _conforms(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        item, ellipsis = typing.get_args(hint)
        assert ellipsis is Ellipsis, "only tuple[X, ...] fields are supported"
        return isinstance(value, tuple) and all(_conforms(v, item) for v in value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


class _Record:
    """Base of the plain records: a frozen dataclass whose ``RECORD`` names it on the wire."""

    RECORD: ClassVar[str]
    # set by @dataclass on each record (declared so that dataclasses.fields accepts ``cls``)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    _cached_hints: ClassVar[dict[str, Any]]

    @classmethod
    def _hints(cls) -> dict[str, Any]:
        hints = cls.__dict__.get("_cached_hints")
        if hints is None:
            every = typing.get_type_hints(cls)
            hints = {f.name: every[f.name] for f in dataclasses.fields(cls)}
            cls._cached_hints = hints
        return hints

    @classmethod
    def _wrong_fields(cls, fields: dict) -> str | None:
        hints = cls._hints()
        if set(fields) != set(hints):
            missing = sorted(set(hints) - set(fields))
            extra = sorted(set(fields) - set(hints), key=repr)
            return f"fields missing {missing}, unexpected {extra}"
        for name, hint in hints.items():
            if not _conforms(fields[name], hint):
                return f"field {name!r} is {type(fields[name]).__name__}, not {hint}"
        return None

    def __post_init__(self) -> None:
        wrong = self._wrong_fields(
            {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        )
        if wrong is not None:
            raise TypeError(f"{type(self).__name__}: {wrong}")

    def encode(self) -> bytes:
        doc = {"record": self.RECORD}
        doc.update((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return msgpack.packb(doc, use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes):
        try:
            doc = msgpack.unpackb(raw, raw=False, use_list=False)
        except Exception as exc:  # msgpack raises several types on garbage
            raise _malformed(cls.RECORD, f"not msgpack ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("record") != cls.RECORD:
            got = doc.get("record") if isinstance(doc, dict) else type(doc).__name__
            raise _malformed(cls.RECORD, f"got {got!r} instead")
        fields = {k: v for k, v in doc.items() if k != "record"}
        wrong = cls._wrong_fields(fields)
        if wrong is not None:
            raise _malformed(cls.RECORD, wrong)
        return cls(**fields)


def _malformed(record: str, detail: str) -> ProtocolError:
    return ProtocolError(
        f"malformed {record} report from a peer rank: {detail} "
        "(run the same cloudckpt version on every rank)"
    )


# -- save -----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SavePlanning(_Record):
    """Save phase 1: the rank's local plan fingerprint, the attempt id (the coordinator's; ``""``
    elsewhere), its plan-cache vote: the key digests of the global plans it holds, whether
    the save hashes its chunks and whether it has a base to read (the coordinator's word
    counts for both), the rank's write-rate class (0: unknown;
    :mod:`cloudckpt.planning.save.rates`) and the length of its encoded local plan (the slot of
    the gather that sends it to the coordinator, when the plan cache cannot serve)."""

    RECORD: ClassVar[str] = "save planning"
    fingerprint: bytes
    attempt: str
    cached_plans: tuple[bytes, ...]
    incremental: bool = False
    with_base: bool = False
    write_rate_class: int = 0
    plan_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class SaveShares(_Record):
    """Save phase 2, the coordinator's (when the plan cache cannot serve every rank): it planned
    the save, and every rank's share (:mod:`cloudckpt.planning.save.share`) fits ``width``
    bytes, the slot of the scatter that sends them."""

    RECORD: ClassVar[str] = "save shares"
    width: int


@dataclass(frozen=True, kw_only=True)
class UploadReport(_Record):
    """Save phase 3, every rank's to every rank: the digest of the global plan its share was
    cut from, what it wrote (and left to its base), the length of its :class:`SaveWritten`
    with its nesting (the slot of the gather that sends it to the coordinator) and the content
    hash of its encoded nesting (a rank whose nesting a lower rank sends too sends none)."""

    RECORD: ClassVar[str] = "save upload"
    plan_digest: bytes
    bytes_written: int
    objects: int
    bytes_reused: int = 0
    written_bytes: int = 0
    structure_digest: bytes = b""


@dataclass(frozen=True, kw_only=True)
class SaveWritten(_Record):
    """Save phase 3, every rank's to the coordinator alone (a gather, for the commit): where
    its chunks landed (an encoded :class:`WrittenChunks`, with the values it owns) and its
    encoded nesting (``b""`` when a lower rank's is the same: :func:`distinct_structures`)."""

    RECORD: ClassVar[str] = "save written"
    written: bytes
    structure: bytes

    def written_chunks(self) -> WrittenChunks:
        return decode_written_chunks(self.written)

    def structure_value(self) -> Any:
        return decode_value(self.structure, key="structure", allow_pickle=False)


@dataclass(frozen=True)
class SavePlanReport:
    """Save phase 2 (when the plan cache cannot serve every rank): the rank's local plan, as the
    coordinator receives it (a gather, not a phase's exchange)."""

    plan: LocalSavePlan

    def encode(self) -> bytes:
        return encode_local_save_plan(self.plan)

    @classmethod
    def decode(cls, raw: bytes) -> SavePlanReport:
        try:
            return cls(decode_local_save_plan(raw))
        except PlanningError as exc:
            raise _malformed("save plan", str(exc)) from exc


def distinct_structures(
    reports: Sequence[UploadReport], landed: Sequence[SaveWritten]
) -> list[Any]:
    """Every distinct nesting the ranks hold, decoded once each, in rank order: ranks of one
    layout (every rank of an FSDP job, every rank of a pipeline stage) send theirs once.
    :class:`~cloudckpt.errors.ProtocolError` for a nesting that does not match its hash, or
    one left out that no lower rank sent."""
    decoded: dict[bytes, Any] = {}
    for rank, (report, written) in enumerate(zip(reports, landed)):
        digest = report.structure_digest
        if written.structure:
            if identity_digest(written.structure) != digest:
                raise _malformed(SaveWritten.RECORD, f"rank {rank}'s nesting is not its hash's")
            decoded.setdefault(digest, written.structure_value())
        elif digest not in decoded:
            raise _malformed(SaveWritten.RECORD, f"rank {rank} left out a nesting no rank sent")
    return list(decoded.values())


# -- load -----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ManifestRead(_Record):
    """Load phase 1: the coordinator read the manifest, ``length`` bytes (broadcast next)."""

    RECORD: ClassVar[str] = "manifest read"
    length: int


@dataclass(frozen=True)
class LoadPlanReport:
    """Load phase 2: the rank's local load plan, and whether its restore (after the data)
    runs code that may raise (``load_state_dict()``, a container's own item assignment): the
    load then closes with an exchange of the restores' outcomes."""

    plan: LocalLoadPlan
    restore_can_fail: bool = True

    def encode(self) -> bytes:
        return (b"\x01" if self.restore_can_fail else b"\x00") + encode_local_load_plan(self.plan)

    @classmethod
    def decode(cls, raw: bytes) -> LoadPlanReport:
        if not isinstance(raw, bytes) or raw[:1] not in (b"\x00", b"\x01"):
            raise _malformed("load plan", "no restore flag")
        try:
            return cls(decode_local_load_plan(raw[1:]), raw[:1] == b"\x01")
        except PlanningError as exc:
            raise _malformed("load plan", str(exc)) from exc


# -- manager and preemption -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LatestStep(_Record):
    """The coordinator's choice of the checkpoint to load: the newest complete one (its step, or
    the name of a folder not named ``step-<N>``), or ``None``."""

    RECORD: ClassVar[str] = "latest step"
    step: int | str | None


@dataclass(frozen=True, kw_only=True)
class StopVote(_Record):
    """Whether this rank received a stop signal (preemption)."""

    RECORD: ClassVar[str] = "stop vote"
    stop: bool


@dataclass(frozen=True, kw_only=True)
class StepSaved(_Record):
    """The coordinator's view of whether the step to save on preemption is already complete."""

    RECORD: ClassVar[str] = "step saved"
    saved: bool
