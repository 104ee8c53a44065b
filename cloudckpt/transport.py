"""Collectives for cloudckpt: a control channel for small msgpack payloads, and tensor broadcasts.

Knows nothing of storage or checkpoints. Two pieces:

- :class:`ControlChannel`: byte payloads (plans, statuses, manifests) exchanged over a dedicated
  gloo group with its own timeout, so cloudckpt's control traffic never interleaves with the
  training's collectives on the default group, and a dead peer turns into
  :class:`~cloudckpt.errors.CollectiveTimeout` instead of a hang. :meth:`ControlChannel.phase`
  is the one primitive of a protocol step, *fail together*: run a block on every rank, then
  exchange every rank's typed report (or its error) with :meth:`ControlChannel.agree`; if any
  rank failed, every rank raises the same :class:`~cloudckpt.errors.CheckpointError` naming each
  failed rank's cause.
- :class:`Broadcaster`: broadcasts, all-gathers and exchanges (every member's slot to every
  member) of flat uint8 tensors inside subgroups of the channel's ranks.
  Subgroups are created deterministically (every rank of the channel calls ``new_group`` for every
  subgroup, in the same order) and cached for later loads. The backend is the job's: NCCL moves
  CUDA tensors, gloo CPU tensors.

Which ranks a process group holds, and the creation of groups, is :mod:`cloudckpt.groups`'s
to say; the groups (control lanes, broadcast subgroups) are held by the runtime context for the
default process group they were created in (:func:`cloudckpt.groups.cached_group`). A channel
object itself belongs to the world it was created in.

Without ``torch.distributed`` initialised, the channel is a world of one and every call is local;
so is it with ``process_group="self"`` (:data:`SELF`): this process alone, even in a
distributed job (a checkpoint saved by rank 0 only, loaded by each rank on its own).
"""

from __future__ import annotations

import traceback as _tb
from collections.abc import Sequence
from typing import Any, Generic, Literal, Protocol, TypeVar

import msgpack
import torch
import torch.distributed as dist

from cloudckpt import groups
from cloudckpt.errors import CollectiveTimeout, RankFailure, checkpoint_error_class
from cloudckpt.wording import phase_words, ranks_phrase

INLINE_BYTES = 504
"""Payloads up to this size travel in the first (and then only) all-gather of a control channel."""
_LENGTH_BYTES = 8


def describe_failure(rank: int, exc: BaseException) -> RankFailure:
    """Turn an exception into the serialisable record carried by :class:`CheckpointError`."""
    tb = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__))
    return RankFailure(rank=rank, error_type=type(exc).__name__, message=str(exc), traceback=tb)


class PhaseReport(Protocol):
    """What a rank tells the others at the end of a :class:`Phase`: a record with an explicit
    codec; ``encode`` never returns empty bytes, ``decode`` raises
    :class:`~cloudckpt.errors.ProtocolError` on malformed bytes."""

    def encode(self) -> bytes: ...

    @classmethod
    def decode(cls, raw: bytes) -> PhaseReport: ...


R = TypeVar("R", bound=PhaseReport)


class ControlChannel:
    """Small-payload collectives among the ranks of ``process_group`` (default: the world).

    ``timeout`` bounds every collective: a peer that does not answer in time makes every waiting
    rank raise :class:`CollectiveTimeout`. Ranks are numbered 0..size-1 within the group; rank 0
    is the coordinator. ``lane`` names the gloo group the channel uses (created once per ranks,
    timeout and lane): exchanges of one lane must never run from two threads at once, exchanges
    of different lanes may (the preemption checks of a training loop use their own lane while an
    async save's background phases use ``"protocol"``). With ``process_group="self"`` the
    channel is this process alone (:attr:`distributed` is false: every call is local).
    """

    def __init__(self, process_group=None, *, timeout: float = 600.0, lane: str = "protocol"):
        self.timeout = float(timeout)
        self.lane = lane
        self.ranks: tuple[int, ...] = groups.group_ranks(process_group)
        self.rank = groups.group_rank(process_group)
        self.distributed = groups.distributed() and not groups.is_self(process_group)
        self._group = None
        self.backend = "gloo"
        if self.distributed:
            self.backend = str(dist.get_backend(process_group)).lower()

    @property
    def group(self):
        """The channel's gloo group (``None`` for a world of one), created (collectively) by
        the first exchange that needs it: after :meth:`join`, so that a call some ranks never
        make fails there instead of hanging in the group's creation."""
        if self._group is None and self.distributed:
            self._group = _control_group(self.ranks, self.timeout, self.lane)
        return self._group

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def join(self, call: str, url: str, wait: float | None) -> None:
        """Open a collective call: return once every rank of the channel made the same call
        (``call`` of ``url``), else raise :class:`~cloudckpt.errors.CollectiveMismatch` on
        every rank that made one, within ``wait`` seconds (``None``: the channel's timeout).
        See :func:`cloudckpt.groups.join`."""
        if self.distributed:
            wait = self.timeout if wait is None else wait
            groups.join(self.ranks, self.rank, call=call, url=url, lane=self.lane, wait=wait)

    # -- raw byte collectives -------------------------------------------------------------------

    def all_gather_bytes(self, payload: bytes, *, inline: int = INLINE_BYTES) -> list[bytes]:
        """Every rank contributes ``payload``; every rank gets all payloads in rank order.

        One all-gather when every payload fits ``inline`` bytes (:data:`INLINE_BYTES` for phase
        reports and votes; more for an exchange expected to carry more, such as load plans;
        every rank must pass the same), two otherwise (the second only as wide as the longest
        payload)."""
        if self.size == 1:
            return [bytes(payload)]
        try:
            firsts = [_slot(b"", inline) for _ in self.ranks]
            dist.all_gather(firsts, _slot(payload, inline), group=self.group)
            width = max(_length(f) for f in firsts)
            if width <= inline:
                return [_unslot(f) for f in firsts]
            outs = [_slot(b"", width) for _ in self.ranks]  # as wide as the longest payload
            dist.all_gather(outs, _slot(payload, width), group=self.group)
        except RuntimeError as exc:
            raise self._collective_failed("all_gather", exc) from exc
        return [_unslot(o) for o in outs]

    def broadcast_bytes(
        self, payload: bytes | None, *, src: int = 0, length: int | None = None
    ) -> bytes:
        """Rank ``src`` sends ``payload``; every rank returns it. ``length``: the payload's
        length when every rank knows it already (e.g. from a phase report): one broadcast
        instead of two."""
        data = bytes(payload or b"") if self.rank == src else b""  # None sends nothing
        if self.size == 1:
            return data
        try:
            if length is None:
                n = torch.tensor([len(data)], dtype=torch.int64)
                dist.broadcast(n, src=self.ranks[src], group=self.group)
                length = int(n.item())
            buf = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if self.rank == src and length
                else torch.empty(length, dtype=torch.uint8)
            )
            if length:
                dist.broadcast(buf, src=self.ranks[src], group=self.group)
        except RuntimeError as exc:
            raise self._collective_failed("broadcast", exc) from exc
        return data if self.rank == src else bytes(buf.numpy().tobytes())

    def gather_bytes(self, payload: bytes, *, width: int) -> list[bytes]:
        """Every rank sends ``payload`` (at most ``width`` bytes, the same ``width`` on every
        rank); the coordinator returns them all in rank order, the others ``[]``. One gather."""
        if self.size == 1:
            return [bytes(payload)]
        slots = [_slot(b"", width) for _ in self.ranks] if self.is_coordinator else None
        self._rooted(dist.gather, _slot(payload, width), slots, dst=self.ranks[0])
        return [_unslot(t) for t in slots] if slots is not None else []

    def scatter_bytes(self, payloads: Sequence[bytes] | None, *, width: int) -> bytes:
        """The coordinator sends ``payloads[r]`` (at most ``width`` bytes each; ``None`` on the
        other ranks) to rank ``r``; every rank returns its own. One scatter."""
        if self.size == 1:
            return bytes(payloads[0]) if payloads else b""
        slots = [_slot(p, width) for p in payloads] if self.is_coordinator and payloads else None
        mine = _slot(b"", width)
        self._rooted(dist.scatter, mine, slots, src=self.ranks[0])
        return _unslot(mine)

    def _rooted(self, op, tensor: torch.Tensor, tensors: list | None, **root: int) -> None:
        try:
            op(tensor, tensors, group=self.group, **root)
        except RuntimeError as exc:
            raise self._collective_failed(op.__name__, exc) from exc

    def barrier(self) -> None:
        """Wait for every rank (bounded by the channel's timeout)."""
        self.all_gather_bytes(b"")

    # -- fail together --------------------------------------------------------------------------

    def phase(
        self, what: str, report: type[R] | None = None, *, inline: int = INLINE_BYTES
    ) -> Phase[R]:
        """One step of a protocol, run on every rank of the channel and closed by an agreement::

            with channel.phase("save upload", UploadReport) as upload:
                ...                                   # this rank's work (may raise)
                upload.report = UploadReport(...)     # optional: what this rank tells the others
            upload.reports                            # every rank's report, rank order

        Every rank must enter the same phases in the same order. Leaving the block exchanges
        every rank's outcome (:meth:`agree`, named ``what``): if the block raised on any rank
        (any ``BaseException``; encoding the report included), every rank raises the same
        :class:`CheckpointError` on leaving it. Otherwise :attr:`Phase.reports` holds every rank's
        report decoded with ``report.decode`` (``None`` where a rank set none: a coordinator-only
        result is ``reports[0]``). A phase costs one exchange of the encoded reports: one
        all-gather when every rank's fits ``inline`` bytes (see :meth:`all_gather_bytes`).
        """
        return Phase(self, what, report, inline)

    def agree(
        self,
        what: str,
        payload: bytes = b"",
        error: BaseException | None = None,
        *,
        inline: int = INLINE_BYTES,
    ) -> list[bytes]:
        """Exchange one phase's outcome. Returns every rank's ``payload`` if all succeeded.

        If any rank passes an ``error``, every rank raises the same :class:`CheckpointError`
        (``"<words> failed on rank 1"`` / ``"... on ranks 0, 2"``; a one-process job:
        ``"<words>: <message>"``, where ``<words>`` is :func:`phase_words` of ``what``) with
        each failed rank's :class:`RankFailure`; the
        local error is chained as the cause where there is one. When every failure is of one
        :class:`CheckpointError` subclass (e.g. ``CheckpointExists``), that subclass is raised.
        """
        if error is not None:
            f = describe_failure(self.rank, error)
            record = msgpack.packb([False, [f.error_type, f.message, f.traceback], b""])
        else:
            record = msgpack.packb([True, None, bytes(payload)])
        gathered = self.all_gather_bytes(record, inline=inline)
        failures: dict[int, RankFailure] = {}
        payloads: list[bytes] = []
        for r, raw in enumerate(gathered):
            ok, info, body = msgpack.unpackb(raw)
            if ok:
                payloads.append(body)
            else:
                failures[r] = RankFailure(
                    rank=r, error_type=info[0], message=info[1], traceback=info[2]
                )
        if not failures:
            return payloads
        cls = checkpoint_error_class(f.error_type for f in failures.values())
        words = phase_words(what)
        if self.size == 1:  # one process: its own message, without the rank bookkeeping
            exc = cls(f"{words}: {failures[0].message}")
            exc.failures = failures
        else:
            exc = cls(f"{words} failed on {ranks_phrase(failures)}", failures=failures)
        if error is not None and isinstance(exc, type(error)):
            # keep the detecting rank's structured fields (keys, object key, byte range...)
            exc.__dict__.update({k: v for k, v in vars(error).items() if k != "failures"})
        raise exc from error

    def _collective_failed(self, op: str, exc: BaseException) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"control {op} among ranks {list(self.ranks)} failed or timed out after "
            f"{self.timeout:.0f} s (a peer died or hung): {exc}"
        )


class Phase(Generic[R]):
    """A protocol step in progress (see :meth:`ControlChannel.phase`).

    ``report``: this rank's report, set inside the block (an instance of the phase's report
    type), or left ``None``. ``reports``: after the block, every rank's report in rank order.
    """

    def __init__(
        self,
        channel: ControlChannel,
        what: str,
        report_type: type[R] | None,
        inline: int = INLINE_BYTES,
    ):
        self.channel = channel
        self.what = what
        self.report_type = report_type
        self.inline = inline
        self.report: R | None = None
        # loosely typed: None where a rank set no report, and the caller knows which ranks do
        self.reports: tuple[Any, ...] = ()

    def __enter__(self) -> Phase[R]:
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        error, payload = exc, b""
        if error is None and self.report is not None:
            try:
                if self.report_type is None or not isinstance(self.report, self.report_type):
                    raise TypeError(
                        f"{self.what}: the report must be a "
                        f"{getattr(self.report_type, '__name__', 'None')}, got "
                        f"{type(self.report).__name__}"
                    )
                payload = self.report.encode()
            except BaseException as encode_error:  # reported to every rank like the block's own
                error = encode_error
        # raises if any rank failed
        payloads = self.channel.agree(self.what, payload, error, inline=self.inline)
        decode = self.report_type.decode if self.report_type is not None else None
        self.reports = tuple(decode(p) if p and decode is not None else None for p in payloads)
        return False


def _slot(payload: bytes, width: int) -> torch.Tensor:
    """``payload`` after its length, in ``width + 8`` bytes (the length alone if it is longer)."""
    slot = bytearray(len(payload).to_bytes(_LENGTH_BYTES, "little"))
    slot += payload + bytes(width - len(payload)) if len(payload) <= width else bytes(width)
    return torch.frombuffer(slot, dtype=torch.uint8)


def _length(slot: torch.Tensor) -> int:
    return int.from_bytes(slot[:_LENGTH_BYTES].numpy().tobytes(), "little")


def _unslot(slot: torch.Tensor) -> bytes:
    """The payload of a :func:`_slot` (``b""`` when it did not fit: a caller's bug)."""
    n, fits = _length(slot), _length(slot) <= len(slot) - _LENGTH_BYTES
    return slot[_LENGTH_BYTES : _LENGTH_BYTES + n].numpy().tobytes() if fits else b""


def _control_group(ranks: tuple[int, ...], timeout: float, lane: str):
    return groups.cached_group(
        ("control", ranks, timeout, lane),
        lambda: groups.new_group(
            ranks, "gloo", timeout, every_rank_calls=len(ranks) == dist.get_world_size()
        ),
    )


class Broadcaster:
    """Broadcasts, all-gathers and exchanges of flat uint8 tensors within subgroups of a
    :class:`ControlChannel`'s ranks.

    Subgroup members are channel-local ranks. :meth:`prepare` must be called with the same list
    of member tuples, in the same order, on every rank of the channel before any broadcast: every
    rank creates (or reuses) every group, members or not, because torch numbers groups per
    process and a group is only found again when every process created the same sequence.
    That needs every rank of the world, so :attr:`can_use_subgroups` is false when the channel is
    a strict subgroup of the world: callers then broadcast only to the whole channel. The backend
    is the job's (``nccl`` moves CUDA buffers, ``gloo`` CPU buffers).
    """

    def __init__(self, channel: ControlChannel):
        self.channel = channel
        self.backend = "nccl" if channel.backend == "nccl" else "gloo"
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

    @property
    def can_use_subgroups(self) -> bool:
        return not self.channel.distributed or len(self.channel.ranks) == dist.get_world_size()

    def prepare(self, member_sets: Sequence[tuple[int, ...]]) -> None:
        if not self.channel.distributed:
            return
        if len(self.channel.ranks) != dist.get_world_size():
            return  # subgroups need every rank of the world: see class docstring
        for members in member_sets:
            self._group(members)

    def _group(self, members: tuple[int, ...]):
        ranks = tuple(self.channel.ranks[m] for m in members)
        if len(ranks) == len(self.channel.ranks):
            # the whole channel: reuse the control group for gloo, the default backend otherwise
            if self.backend == "gloo":
                return self.channel.group
        return groups.cached_group(
            ("broadcast", self.backend, ranks, self.channel.timeout),
            lambda: groups.new_group(
                ranks, self.backend, self.channel.timeout, every_rank_calls=True
            ),
        )

    def broadcast(self, buf: torch.Tensor, *, src: int, members: tuple[int, ...]) -> None:
        """Broadcast ``buf`` (a contiguous tensor on :attr:`device`) from channel rank ``src``."""
        if len(members) <= 1 or not self.channel.distributed:
            return
        try:
            dist.broadcast(buf, src=self.channel.ranks[src], group=self._group(members))
        except RuntimeError as exc:
            raise self.channel._collective_failed("broadcast", exc) from exc

    def all_gather(
        self, out: torch.Tensor, mine: torch.Tensor, *, members: tuple[int, ...]
    ) -> None:
        """Every member contributes ``mine`` (contiguous, on :attr:`device`, the same size on
        every member); ``out`` (``len(members)`` times that size) receives member ``j``'s at
        slot ``j`` (``members`` sorted). ``mine`` may be this rank's slot of ``out`` itself."""
        me = members.index(self.channel.rank)
        n = mine.numel()
        if len(members) <= 1 or not self.channel.distributed:
            if out[me * n : (me + 1) * n].data_ptr() != mine.data_ptr():
                out[me * n : (me + 1) * n].copy_(mine)
            return
        ranks = [self.channel.ranks[m] for m in members]
        order = sorted(range(len(members)), key=ranks.__getitem__)  # a group's rank order
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        try:
            if order == list(range(len(members))):
                gather(out, mine, group=self._group(members))
                return
            by_group = torch.empty_like(out)
            gather(by_group, mine, group=self._group(members))
        except RuntimeError as exc:
            raise self.channel._collective_failed("all_gather", exc) from exc
        for g, j in enumerate(order):
            out[j * n : (j + 1) * n].copy_(by_group[g * n : (g + 1) * n])

    def exchange(self, slots: Sequence[torch.Tensor], *, members: tuple[int, ...]) -> None:
        """Every member ``j`` sends its ``slots[j]`` to every other member, into their
        ``slots[j]`` (contiguous tensors on :attr:`device`; ``slots[j]`` has the same size on
        every member, possibly 0: nothing to send). A ring: in ``len(members) - 1`` steps each
        member passes one slot on to the next member while taking one from the previous, so
        every member's link carries the others' bytes once, all links at the same time."""
        n = len(members)
        if n <= 1 or not self.channel.distributed:
            return
        me = members.index(self.channel.rank)
        group = self._group(members)
        right = self.channel.ranks[members[(me + 1) % n]]
        left = self.channel.ranks[members[(me - 1) % n]]
        try:
            for step in range(n - 1):
                out, into = slots[(me - step) % n], slots[(me - step - 1) % n]
                ops = []
                if out.numel():
                    ops.append(dist.P2POp(dist.isend, out, right, group))
                if into.numel():
                    ops.append(dist.P2POp(dist.irecv, into, left, group))
                if ops:
                    for work in dist.batch_isend_irecv(ops):
                        work.wait()
        except RuntimeError as exc:
            raise self.channel._collective_failed("exchange", exc) from exc
