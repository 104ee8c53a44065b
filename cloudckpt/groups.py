"""Process groups as cloudckpt sees them: which ranks a ``process_group`` argument names.

The one place cloudckpt resolves a process group. ``None`` (or ``torch.distributed``'s
``WORLD``) is every rank; a group object its ranks; ``"self"`` (:data:`SELF`) this process
alone, with no collective even when ``torch.distributed`` is initialised. Without
``torch.distributed`` initialised every group is this process alone.

:func:`join` is the handshake that opens every collective save and load (the rank-0 guard):
through the job's rendezvous store, never a gloo collective, every rank of the group says which
call it makes. Contract:

- Every rank that called returns once all have called with the same call and URL: four store
  requests per rank (tens of microseconds), plus the wait for the last rank to arrive, which
  the call's first exchange would wait anyway.
- When some rank has not called within ``wait`` seconds of this rank's arrival, every rank
  that called raises :class:`~cloudckpt.errors.CollectiveMismatch` naming the ranks that did
  not join (one decision per call, taken atomically in the store: no rank goes on into the
  call's collectives while another gives up). A rank arriving after that decision raises it
  too, or, when it was never there (it skipped a call the others abandoned), moves on to the
  next call: a guarded call that failed does not desynchronise later ones.
- When ranks made different calls (one saves, one loads; different URLs), every rank raises
  the same :class:`~cloudckpt.errors.CollectiveMismatch` naming what each rank called.
- Calls are numbered per group of ranks and lane, per default process group.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import threading
from dataclasses import dataclass, field

import msgpack
import torch.distributed as dist

from cloudckpt.errors import CollectiveMismatch, CollectiveTimeout, ProtocolError
from cloudckpt.runtime.context import current
from cloudckpt.statedict.torch_private import default_store
from cloudckpt.wording import ranks_phrase, seconds

SELF = "self"
"""The ``process_group`` that names this process alone: no collective, even when
``torch.distributed`` is initialised."""


def distributed() -> bool:
    """Whether ``torch.distributed`` is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def is_self(process_group) -> bool:
    """Whether ``process_group`` is :data:`SELF`; ``ValueError`` for any other string."""
    if isinstance(process_group, str):
        if process_group != SELF:
            raise ValueError(
                f"process_group must be a torch.distributed process group, None (the world) "
                f"or {SELF!r} (this process alone), got {process_group!r}"
            )
        return True
    return False


def group_ranks(process_group=None) -> tuple[int, ...]:
    """The global ranks of ``process_group`` (default: the world) in group order; ``(0,)``
    without ``torch.distributed``; this process's own global rank for :data:`SELF`. The one
    place cloudckpt resolves a process group."""
    if not distributed():
        is_self(process_group)  # a bad string fails the same with or without a job
        return (0,)
    if is_self(process_group):
        return (dist.get_rank(),)
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(process_group))


def group_rank(process_group=None) -> int:
    """This process's rank within ``process_group`` (0 is the coordinator; 0 without
    ``torch.distributed``). No collective. Raises ``ValueError`` for a non-member."""
    if not distributed() or is_self(process_group):
        return 0
    return group_ranks(process_group).index(dist.get_rank())


# -- the join handshake -------------------------------------------------------------------------

_GO = b"go"
_MISMATCH = b"m"  # + msgpack [[call, url, [ranks]], ...]
_ABORT = b"a"  # + msgpack [ranks that had not joined]
_SELF_HINT = "pass process_group='self' to save from one rank"


@dataclass
class _Calls:
    """This process's count of joined calls for one group of ranks and lane."""

    next: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def join(ranks: tuple[int, ...], rank: int, *, call: str, url: str, lane: str, wait: float) -> None:
    """The handshake that opens a collective call (see the module docstring). ``ranks``: the
    group's global ranks; ``rank``: this process's rank in it; ``call``: what it calls
    (``"save"``, ``"load"``...); ``wait``: seconds to wait for the others. A no-op for a group
    of one."""
    if len(ranks) == 1:
        return
    group = hashlib.blake2b(msgpack.packb([lane, list(ranks)]), digest_size=8).hexdigest()
    calls = current().joins.get(dist.group.WORLD, (ranks, lane), _Calls)
    me = msgpack.packb([call, url.rstrip("/")])
    store = default_store()
    with calls.lock:
        skipped = False
        while True:
            number, calls.next = calls.next, calls.next + 1
            prefix = f"cloudckpt/join/{group}/{number}"
            try:
                state = _round(store, prefix, len(ranks), rank, me, wait)
            except RuntimeError as exc:
                raise CollectiveTimeout(
                    f"{call} {url}: the job's rendezvous store failed while the ranks joined "
                    f"the call: {exc}"
                ) from exc
            kind, detail = _outcome(state, len(ranks))
            if kind == "go":
                if number:  # every rank is past the previous call: forget it
                    _forget(store, f"cloudckpt/join/{group}/{number - 1}", rank)
                return
            if kind == "mismatch":
                raise CollectiveMismatch(_mismatch_message(detail, ranks))
            if rank in detail:  # the others gave up on a call this rank never made: next one
                skipped = True
                continue
            raise CollectiveMismatch(
                _missing_message(call, url, [ranks[r] for r in detail], wait, skipped)
            )


def _round(store, prefix: str, size: int, rank: int, me: bytes, wait: float) -> bytes:
    """One call's handshake; returns its decided state (go, mismatch or abort)."""
    store.set(f"{prefix}/r{rank}", me)
    if store.add(f"{prefix}/n", 1) == size:  # the last to arrive decides
        seen = store.multi_get([f"{prefix}/r{r}" for r in range(size)])
        by_call: dict[bytes, list[int]] = {}
        for r, raw in enumerate(seen):
            by_call.setdefault(bytes(raw), []).append(r)
        verdict = _GO
        if len(by_call) > 1:
            calls = [[*_call_of(raw), who] for raw, who in by_call.items()]
            verdict = _MISMATCH + msgpack.packb(calls)
        return bytes(store.compare_set(f"{prefix}/s", "", verdict))
    try:
        store.wait([f"{prefix}/s"], _dt.timedelta(seconds=wait))
        return bytes(store.get(f"{prefix}/s"))
    except dist.DistStoreError:
        if not _timed_out(store, prefix):
            raise
    missing = [r for r in range(size) if not store.check([f"{prefix}/r{r}"])]
    return bytes(store.compare_set(f"{prefix}/s", "", _ABORT + msgpack.packb(missing)))


def _timed_out(store, prefix: str) -> bool:
    """Whether a failed wait was a timeout (the store still answers), not a broken store."""
    try:
        store.check([f"{prefix}/n"])
    except RuntimeError:
        return False
    return True


def _forget(store, prefix: str, rank: int) -> None:
    """Delete this rank's keys of a call every rank is past (rank 0 also the shared ones)."""
    store.delete_key(f"{prefix}/r{rank}")
    if rank == 0:
        store.delete_key(f"{prefix}/n")
        store.delete_key(f"{prefix}/s")


def _call_of(raw: bytes) -> tuple[str, str]:
    """``(call, url)`` of a rank's entry in the store (written by :func:`join`)."""
    try:
        call, url = msgpack.unpackb(raw)
        if isinstance(call, str) and isinstance(url, str):
            return call, url
    except (ValueError, TypeError, msgpack.UnpackException):
        pass
    return "an unreadable call (another cloudckpt version?)", ""


def _outcome(state: bytes, size: int) -> tuple[str, list]:
    """A decided state read from the store: ``("go", [])``, ``("mismatch", [[call, url,
    ranks], ...])`` or ``("abort", ranks that had not joined)``; ``ProtocolError`` for anything
    else."""
    if state == _GO:
        return "go", []
    try:
        detail = msgpack.unpackb(state[1:]) if state[:1] in (_MISMATCH, _ABORT) else None
    except (ValueError, TypeError, msgpack.UnpackException):
        detail = None

    def ranks_ok(value) -> bool:
        return isinstance(value, list) and all(type(r) is int and 0 <= r < size for r in value)

    if state[:1] == _ABORT and isinstance(detail, list) and ranks_ok(detail):
        return "abort", detail
    if (
        state[:1] == _MISMATCH
        and isinstance(detail, list)
        and detail
        and all(
            isinstance(d, list)
            and len(d) == 3
            and isinstance(d[0], str)
            and isinstance(d[1], str)
            and ranks_ok(d[2])
            for d in detail
        )
    ):
        return "mismatch", detail
    raise ProtocolError(
        f"the rendezvous store holds a malformed join decision ({len(state)} bytes): another "
        f"program uses cloudckpt's keys, or the ranks run different cloudckpt versions"
    )


def _mismatch_message(calls: list, ranks: tuple[int, ...]) -> str:
    parts = [
        f"{ranks_phrase(ranks[r] for r in who)} called {call}" + (f" of {url}" if url else "")
        for call, url, who in calls
    ]
    differs = " and ".join(
        what
        for what, values in (
            ("operation", {c[0] for c in calls}),
            ("URL", {c[1] for c in calls}),
        )
        if len(values) > 1
    )
    return (
        f"saves and loads are collective and every rank must make the same call, but the "
        f"{differs or 'call'} differs: {'; '.join(parts)} ({_SELF_HINT})"
    )


def _missing_message(call: str, url: str, missing: list[int], wait: float, skipped: bool) -> str:
    late = " (this rank came late to an earlier call the others had given up on)" if skipped else ""
    return (
        f"{call} of {url}: saves and loads are collective, but {ranks_phrase(missing)} of the "
        f"process group did not join within {seconds(wait)}{late}; call it on every rank, or "
        f"{_SELF_HINT} (a rank merely slower than that: raise the options' join_timeout)"
    )


def cached_group(key: tuple, create):
    """The group of ``key`` among those cloudckpt created in the current default process group
    (``context.GroupCache``: created once per world, created anew after the default group was
    destroyed and initialised again); ``create()`` makes it the first time."""
    return current().groups.get(dist.group.WORLD, key, create)


def new_group(ranks: tuple[int, ...], backend: str, timeout: float, *, every_rank_calls: bool):
    """A process group over ``ranks``. With ``every_rank_calls``, every rank of the world calls
    this for the same groups in the same order (members or not; torch's numbering stays
    aligned). Otherwise only members call it (local synchronisation), which works when every
    member has created the same number of groups before."""
    return dist.new_group(
        list(ranks),
        backend=backend,
        timeout=_dt.timedelta(seconds=timeout),
        use_local_synchronization=not every_rank_calls,
    )
