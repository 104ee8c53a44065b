"""Deterministic kill points inside a save, armed in a worker process of a test job.

The library has no test hooks, so a :class:`KillPoint` wraps library functions *inside the
worker* (never in the test process) and SIGKILLs the process, or the whole job, when the chosen
event happens:

- ``agree``: entering (``before``) or leaving (``after``) one phase's fail-together exchange of
  the save protocol (``ControlChannel.agree(what=...)``): phase boundaries.
- ``store``: the n-th request of one storage operation (``put``, ``create_multipart``,
  ``upload_part``, ``complete_multipart``, ``head``, ...), on data objects or on the manifest,
  just before it is issued or just after it returned (the choke points
  ``S3Connection.call`` and ``LocalStore._run``).
- ``body``: the manifest PUT's body is being sent: ``half`` of it went out (the request can never
  complete) or ``sent`` (all of it went out, the answer was not read: an ambiguous commit).
- ``link``: LocalStore only: the manifest's temporary file is written, not yet linked into place.
- ``stage``: async save only: just before / after the host staging copy.

``scope="job"`` kills every other rank of the job first (their PIDs are passed in), then the
rank itself: the whole job dies at that instant.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass

MANIFEST = "manifest.msgpack"


@dataclass(frozen=True)
class KillPoint:
    """Where a save is killed. ``may_commit``: the manifest request may have reached the store
    before the kill (the checkpoint may then be complete, and must then load bit-exact)."""

    name: str
    rank: int
    kind: str
    target: str = ""
    keys: str = "any"
    n: int = 1
    when: str = "before"
    scope: str = "rank"
    may_commit: bool = False
    backend: str = "s3"
    async_save: bool = False

    def __str__(self) -> str:
        return self.name


def _matches_key(filter_: str, key) -> bool:
    if filter_ == "any":
        return True
    if filter_ == "manifest":
        return key == MANIFEST
    return isinstance(key, str) and key.startswith("data/")


class _Trigger:
    def __init__(self, point: KillPoint, pids):
        self.point = point
        self.pids = [int(p) for p in pids]
        self.count = 0
        self.lock = threading.Lock()

    def hit(self) -> bool:
        """Count one matching event; True when it is the n-th."""
        with self.lock:
            self.count += 1
            return self.count == self.point.n

    def fire(self) -> None:
        me = os.getpid()
        if self.point.scope == "job":
            for pid in self.pids:
                if pid != me:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        os.kill(me, signal.SIGKILL)
        time.sleep(60)  # never reached: SIGKILL is delivered before the syscall returns


@contextlib.contextmanager
def armed(point: KillPoint | None, rank: int, pids=()):
    """Arm ``point`` in this process if it targets ``rank``; restore everything on exit (a point
    that never fired leaves the worker as it was)."""
    if point is None or point.rank != rank:
        yield None
        return
    trigger = _Trigger(point, pids)
    undo: list = []

    def patch(owner, name, value):
        undo.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    if point.kind == "agree":
        from cloudckpt.transport import ControlChannel

        orig_agree = ControlChannel.agree

        def agree(self, what, payload=b"", error=None, **kwargs):
            fire = what == point.target and trigger.hit()
            if fire and point.when == "before":
                trigger.fire()
            out = orig_agree(self, what, payload, error, **kwargs)
            if fire:
                trigger.fire()
            return out

        patch(ControlChannel, "agree", agree)
    elif point.kind in ("store", "body"):
        from cloudckpt.storage.local.store import LocalStore
        from cloudckpt.storage.s3.conn import S3Connection

        sending = threading.Event()
        op_wanted = point.target if point.kind == "store" else "put"
        keys_wanted = point.keys if point.kind == "store" else "manifest"

        def wrap_call(orig):
            async def call(self, op, key, *args, **kwargs):
                fire = op == op_wanted and _matches_key(keys_wanted, key) and trigger.hit()
                if fire and point.kind == "body":
                    sending.set()
                elif fire and point.when == "before":
                    trigger.fire()
                try:
                    return await orig(self, op, key, *args, **kwargs)
                finally:  # "after": the request completed, whatever it answered
                    if fire and point.kind == "store":
                        trigger.fire()

            return call

        patch(S3Connection, "call", wrap_call(S3Connection.__dict__["call"]))
        patch(LocalStore, "_run", wrap_call(LocalStore.__dict__["_run"]))
        if point.kind == "body":
            from cloudckpt.storage.s3.client import BodyPayload

            orig_write = BodyPayload.write_with_length

            async def write_with_length(self, writer, content_length=None):
                if not sending.is_set():
                    return await orig_write(self, writer, content_length)
                data = b"".join(bytes(v) for v in self._views)
                if point.when == "half":
                    await writer.write(data[: len(data) // 2])
                else:
                    await writer.write(data)
                trigger.fire()

            patch(BodyPayload, "write_with_length", write_with_length)
    elif point.kind == "link":
        import cloudckpt.storage.local.store as local

        orig_link = local._link_exclusive

        def link(tmp, path):
            if path.name == MANIFEST and trigger.hit():
                trigger.fire()
            return orig_link(tmp, path)

        undo.append((local, "_link_exclusive", orig_link))
        local._link_exclusive = link
    elif point.kind == "stage":
        from cloudckpt.runtime.staging import StagingPool

        orig_stage = StagingPool.stage

        def stage(self, items):
            fire = trigger.hit()
            if fire and point.when == "before":
                trigger.fire()
            out = orig_stage(self, items)
            if fire:
                trigger.fire()
            return out

        patch(StagingPool, "stage", stage)
    else:
        raise ValueError(f"unknown kill point kind {point.kind!r}")
    try:
        yield trigger
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def _all_points() -> list[tuple[bool, KillPoint]]:
    """(in CI?, point) for every hand-picked point: every phase of a 2-rank save, both ranks,
    kills of one rank and of the whole job."""
    K = KillPoint
    return [
        # planning
        (
            True,
            K(
                "plan: rank 0 after the existence check",
                0,
                "store",
                "head",
                "manifest",
                when="after",
            ),
        ),
        (True, K("plan: rank 1 before the planning exchange", 1, "agree", "save planning")),
        (
            True,
            K(
                "plan: job, rank 0 after the planning exchange",
                0,
                "agree",
                "save planning",
                when="after",
                scope="job",
            ),
        ),
        (
            True,
            K(
                "plan: rank 1 after the global plan",
                1,
                "agree",
                "save global planning",
                when="after",
            ),
        ),
        # data: single puts
        (True, K("data: rank 0 before its first data put", 0, "store", "put", "data")),
        (True, K("data: rank 1 after its first data put", 1, "store", "put", "data", when="after")),
        (
            False,
            K(
                "data: job, rank 0 after its second data put",
                0,
                "store",
                "put",
                "data",
                n=2,
                when="after",
                scope="job",
            ),
        ),
        # data: multipart
        (False, K("multipart: rank 0 before create", 0, "store", "create_multipart", "data")),
        (
            True,
            K(
                "multipart: rank 1 after create",
                1,
                "store",
                "create_multipart",
                "data",
                when="after",
            ),
        ),
        (
            True,
            K("multipart: rank 0 after part 1", 0, "store", "upload_part", "data", when="after"),
        ),
        (
            False,
            K(
                "multipart: rank 1 after part 2",
                1,
                "store",
                "upload_part",
                "data",
                n=2,
                when="after",
            ),
        ),
        (
            True,
            K(
                "multipart: job, rank 1 before part 3",
                1,
                "store",
                "upload_part",
                "data",
                n=3,
                scope="job",
            ),
        ),
        (True, K("multipart: rank 0 before complete", 0, "store", "complete_multipart", "data")),
        (
            False,
            K(
                "multipart: job, rank 1 after complete",
                1,
                "store",
                "complete_multipart",
                "data",
                when="after",
                scope="job",
            ),
        ),
        # between data and manifest
        (
            True,
            K(
                "gap: rank 1 before the upload exchange (its data all written)",
                1,
                "agree",
                "save upload",
            ),
        ),
        (
            True,
            K(
                "gap: rank 0 after the upload exchange (all data written)",
                0,
                "agree",
                "save upload",
                when="after",
            ),
        ),
        (
            True,
            K(
                "gap: job, rank 0 just before the manifest put",
                0,
                "store",
                "put",
                "manifest",
                scope="job",
            ),
        ),
        # the manifest write
        (True, K("manifest: rank 0 with half of the body sent", 0, "body", when="half")),
        (
            True,
            K(
                "manifest: job with the whole body sent, answer unread",
                0,
                "body",
                when="sent",
                scope="job",
                may_commit=True,
            ),
        ),
        (
            True,
            K(
                "manifest: rank 0 after the put returned",
                0,
                "store",
                "put",
                "manifest",
                when="after",
                may_commit=True,
            ),
        ),
        (
            True,
            K(
                "commit: rank 1 before the commit exchange",
                1,
                "agree",
                "save commit",
                may_commit=True,
            ),
        ),
        # async save: staging and background upload
        (False, K("async: rank 1 before staging", 1, "stage", async_save=True)),
        (
            True,
            K(
                "async: job, rank 0 after staging",
                0,
                "stage",
                when="after",
                scope="job",
                async_save=True,
            ),
        ),
        (
            True,
            K(
                "async: rank 1 after part 1 in the background",
                1,
                "store",
                "upload_part",
                "data",
                when="after",
                async_save=True,
            ),
        ),
        # file:// (LocalStore)
        (
            True,
            K(
                "file: rank 1 after its first data put",
                1,
                "store",
                "put",
                "data",
                when="after",
                backend="file",
            ),
        ),
        (
            True,
            K(
                "file: job, manifest temp file written, not linked",
                0,
                "link",
                scope="job",
                backend="file",
            ),
        ),
        (
            False,
            K(
                "file: rank 0 after the manifest put",
                0,
                "store",
                "put",
                "manifest",
                when="after",
                may_commit=True,
                backend="file",
            ),
        ),
    ]


def ci_kill_points() -> list[KillPoint]:
    """The kill points run in CI (21: every phase, both ranks, rank and job kills)."""
    return [p for ci, p in _all_points() if ci]


def long_kill_points() -> list[KillPoint]:
    """The long mode's extra points: the hand-picked ones CI skips, then every request of every
    kind on both ranks, before and after it."""
    K = KillPoint
    points = [p for ci, p in _all_points() if not ci]
    for rank in (0, 1):
        for when in ("before", "after"):
            for n in (1, 2):  # each rank writes two small objects (and one multipart one)
                points.append(
                    K(
                        f"long: rank {rank} {when} data put {n}",
                        rank,
                        "store",
                        "put",
                        "data",
                        n=n,
                        when=when,
                    )
                )
            for n in (1, 2, 3):
                points.append(
                    K(
                        f"long: job, rank {rank} {when} part {n}",
                        rank,
                        "store",
                        "upload_part",
                        "data",
                        n=n,
                        when=when,
                        scope="job",
                    )
                )
            for phase in ("save planning", "save global planning", "save upload"):
                # once the upload exchange is over, rank 0 commits whatever rank 1 does
                commits = phase == "save upload" and when == "after" and rank == 1
                points.append(
                    K(
                        f"long: rank {rank} {when} {phase}",
                        rank,
                        "agree",
                        phase,
                        when=when,
                        may_commit=commits,
                    )
                )
            points.append(
                K(
                    f"long: file rank {rank} {when} data put 2",
                    rank,
                    "store",
                    "put",
                    "data",
                    n=2,
                    when=when,
                    backend="file",
                )
            )
    points.append(K("long: job, rank 0 half manifest", 0, "body", when="half", scope="job"))
    points.append(K("long: rank 0 whole manifest sent", 0, "body", when="sent", may_commit=True))
    points.append(
        K(
            "long: job, rank 1 in the commit exchange",
            1,
            "agree",
            "save commit",
            scope="job",
            may_commit=True,
        )
    )
    return points


@contextlib.contextmanager
def rendezvous_before_manifest(directory: str | None, parties: int, timeout: float = 60.0):
    """Make this process's manifest put wait until ``parties`` processes (across jobs) reached
    theirs: each drops a file in ``directory`` and waits for ``parties`` files. Two jobs saving
    the same checkpoint then race exactly at the create-mode manifest put."""
    if directory is None:
        yield
        return
    from cloudckpt.storage.local.store import LocalStore
    from cloudckpt.storage.s3.conn import S3Connection

    def wait() -> None:
        open(os.path.join(directory, f"at-manifest-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + timeout
        while len([n for n in os.listdir(directory) if n.startswith("at-manifest-")]) < parties:
            if time.monotonic() > deadline:
                raise TimeoutError("the other job never reached its manifest put")
            time.sleep(0.005)

    def wrap(orig):
        async def call(self, op, key, *args, **kwargs):
            if op == "put" and key == MANIFEST:
                import asyncio

                await asyncio.to_thread(wait)
            return await orig(self, op, key, *args, **kwargs)

        return call

    undo = [
        (S3Connection, "call", S3Connection.__dict__["call"]),
        (LocalStore, "_run", LocalStore.__dict__["_run"]),
    ]
    S3Connection.call = wrap(undo[0][2])
    LocalStore._run = wrap(undo[1][2])
    try:
        yield
    finally:
        for owner, name, value in undo:
            setattr(owner, name, value)
