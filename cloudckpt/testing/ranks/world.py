"""Multi-rank test harness: persistent gloo worlds of real processes on 127.0.0.1.

`ProcessWorld(n)` starts n worker processes that each initialise the default process group
(gloo, rendezvous through a TCPStore that rank 0 opens on a free port) and then serve many calls:
`world.run(fn, *args, **kwargs)` runs `fn(*args, **kwargs)` on every rank and returns the list of
per-rank results, rank order.

Contract:
- `fn` must be picklable by reference (a module-level function of an importable module, e.g. a
  test module; workers get the caller's `sys.path` and the repository root). Arguments and results
  are pickled: this is test infrastructure, not library code.
- Any rank raising (or dying) -> `RankFailedError` naming each failed rank with its full traceback
  text; the other ranks get `failure_grace` seconds to answer (they are often blocked in a
  collective waiting for the failed one).
- A rank not answering within the timeout -> `WorldTimeoutError` naming the silent ranks, with
  their Python stacks (faulthandler), raised within the timeout plus about a second.
- After any failure or timeout the workers are killed; the next `run()` transparently starts a
  fresh world (`generation` counts the starts). A world whose calls all succeed keeps its workers.
- Worker environment: the caller's `os.environ` at world start, then `env`, then RANK,
  WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; GLOO_SOCKET_IFNAME=lo unless
  set; then the rank's own `rank_env` entry (if given). torch is already imported by then
  (variables torch reads at import time are not honoured). Workers run with
  `torch.set_num_threads(1)`.
- Placement (for simulated clusters, :mod:`cloudckpt.testing.cluster.simulated`): `netns[rank]`
  names a network namespace (``ip netns`` name or a path) the rank enters before anything else, and
  `master_addr` is where rank 0's rendezvous store is reached (default 127.0.0.1).
- Workers are forked from a shared "zygote" process that imported torch once, so a (re)start costs
  well under a second after the first. The zygote and the workers run in their own session;
  they exit when the owning process dies (even by SIGKILL): the zygote on EOF of its control
  socket, the workers from a watcher thread. `close()` (also `__exit__`, and at interpreter exit)
  kills the workers.
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cloudckpt.testing.ranks.zygote import _ZYGOTE, _describe_status

__all__ = ["ProcessWorld", "RankFailedError", "WorldTimeoutError"]

_FAILURE_GRACE_S = 3.0
_STACK_DUMP_WAIT_S = 0.5


class RankFailedError(RuntimeError):
    """One or more ranks raised (or died). `failures` maps rank -> traceback text;
    `missing` lists the ranks that had not answered when the world was torn down."""

    def __init__(self, message: str, *, failures: dict[int, str], missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.failures = failures
        self.missing = missing


class WorldTimeoutError(TimeoutError):
    """Ranks did not answer within the timeout. `missing` lists them; `stacks` maps rank ->
    the Python stacks dumped by the stuck worker (best effort)."""

    def __init__(self, message: str, *, missing: tuple[int, ...], stacks: dict[int, str]):
        super().__init__(message)
        self.missing = missing
        self.stacks = stacks


# -- owner side ---------------------------------------------------------------------------------

_LIVE_WORLDS: weakref.WeakSet[ProcessWorld] = weakref.WeakSet()


@atexit.register
def _close_everything() -> None:
    for world in list(_LIVE_WORLDS):
        world.close()
    _ZYGOTE.close()


class ProcessWorld:
    """A persistent group of `world_size` gloo ranks serving `run()` calls (see module doc).

    Options (keyword-only): `timeout` (seconds; default per call, and the limit for a start),
    `env` (extra worker environment), `failure_grace` (seconds the other ranks get to answer
    once one rank failed), `rank_env` (per-rank extra environment, applied last), `netns`
    (per-rank network namespace; None entries stay in the caller's), `master_addr` (address of
    rank 0's rendezvous store)."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        failure_grace: float = _FAILURE_GRACE_S,
        rank_env: list[dict[str, str]] | None = None,
        netns: list[str | None] | None = None,
        master_addr: str = "127.0.0.1",
    ):
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        for name, per_rank in (("rank_env", rank_env), ("netns", netns)):
            if per_rank is not None and len(per_rank) != world_size:
                raise ValueError(f"{name} needs one entry per rank ({world_size})")
        self.rank_env = [dict(e or {}) for e in rank_env] if rank_env else None
        self.netns = list(netns) if netns else None
        self.master_addr = master_addr
        self.world_size = world_size
        self.timeout = float(timeout)
        self.env = dict(env or {})
        self.failure_grace = float(failure_grace)
        self.generation = 0
        self._pids: list[int] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._stack_files: list[str] = []
        self._call_id = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = f"pids={self._pids}" if self._pids else "stopped"
        return f"<ProcessWorld size={self.world_size} generation={self.generation} {state}>"

    @property
    def pids(self) -> list[int]:
        """PIDs of the running workers, rank order (empty when stopped)."""
        return list(self._pids)

    @property
    def running(self) -> bool:
        return bool(self._pids)

    def start(self) -> None:
        """Start the workers and wait until every rank joined the process group (no-op if
        running). Raises RankFailedError / WorldTimeoutError like `run()`."""
        with self._lock:
            if not self._pids:
                self._start_locked()

    def _start_locked(self) -> None:
        self.generation += 1
        _LIVE_WORLDS.add(self)
        try:
            deadline = time.monotonic() + self.timeout
            for _ in range(self.world_size):
                pid, conn, scratch = _ZYGOTE.spawn()
                self._pids.append(pid)
                self._conns.append(conn)
                self._stack_files.append(os.path.join(scratch, f"{pid}.stacks"))
            base_env = {**os.environ, **self.env}
            for rank, conn in enumerate(self._conns):
                conn.send(
                    {
                        "rank": rank,
                        "world_size": self.world_size,
                        "env": base_env,
                        "stack_file": self._stack_files[rank],
                        "owner_pid": os.getpid(),
                        "pg_timeout": self.timeout,
                        "sys_path": list(sys.path),
                        "master_addr": self.master_addr,
                        "rank_env": self.rank_env[rank] if self.rank_env else {},
                        "netns": self.netns[rank] if self.netns else None,
                    }
                )
            port = self._collect("port", deadline, ranks=[0])[0][2]
            for conn in self._conns[1:]:
                conn.send(("port", port))
            self._collect("ready", deadline, what="start")
        except BaseException:
            self._kill_locked()
            raise

    def close(self) -> None:
        """Stop all workers (politely for a moment, then SIGKILL). Idempotent."""
        with self._lock:
            for conn in self._conns:
                try:
                    conn.send(("close",))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 2.0
            for conn in self._conns:  # a worker closes its end when it exits
                try:
                    while conn.poll(max(0.0, deadline - time.monotonic())):
                        conn.recv()
                except (EOFError, OSError):
                    pass
            self._kill_locked()

    def _kill_locked(self) -> None:
        _ZYGOTE.kill(self._pids)
        for conn in self._conns:
            conn.close()
        self._pids, self._conns = [], []
        _LIVE_WORLDS.discard(self)
        for path in self._stack_files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._stack_files = []

    def __enter__(self) -> ProcessWorld:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results in rank order.

        Starts (or restarts) the world first if needed; a start has its own `self.timeout`.
        Raises RankFailedError if any rank raised or died, WorldTimeoutError if a rank did not
        answer within `timeout` (default `self.timeout`); the world is torn down after either."""
        limit = self.timeout if timeout is None else float(timeout)
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        what = getattr(fn, "__qualname__", repr(fn))
        with self._lock:
            if not self._pids:
                self._start_locked()
            self._call_id += 1
            call_id = self._call_id
            if not all(_worker_alive(pid) for pid in self._pids):
                # a worker died between calls (killed from outside): start a fresh world
                self._kill_locked()
                self._start_locked()
            try:
                for conn in self._conns:
                    conn.send(("call", call_id, list(sys.path), payload))
                replies = self._collect(
                    "result", time.monotonic() + limit, call_id=call_id, what=what
                )
            except BaseException:
                self._kill_locked()
                raise
        return [pickle.loads(reply[2]) for reply in replies]

    def _collect(
        self,
        kind: str,
        deadline: float,
        *,
        ranks: list[int] | None = None,
        call_id: int | None = None,
        what: str = "start",
    ) -> list[tuple]:
        """Wait for one `kind` message from each of `ranks`; raise on failure or timeout."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        pending = {self._conns[r]: r for r in ranks}
        replies: dict[int, tuple] = {}
        failures: dict[int, str] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = multiprocessing.connection.wait(list(pending), timeout=remaining)
            for conn in [c for c in list(pending) if c in ready]:
                rank = pending[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    status = _ZYGOTE.status(self._pids[rank])
                    failures[rank] = f"rank {rank} died ({_describe_status(status)})"
                    del pending[conn]
                    continue
                if call_id is not None and msg[1] != call_id:
                    continue  # a late answer to an earlier call
                if msg[0] == "error":
                    failures[rank] = msg[2]
                    del pending[conn]
                elif msg[0] == kind:
                    replies[rank] = msg
                    del pending[conn]
            if failures:
                deadline = min(deadline, time.monotonic() + self.failure_grace)
        missing = tuple(sorted(pending.values()))
        if failures:
            lines = [
                f"{len(failures)} of {self.world_size} ranks failed in {what}: "
                f"ranks {sorted(failures)}"
            ]
            if missing:
                lines.append(f"ranks {list(missing)} had not answered")
            for rank in sorted(failures):
                lines.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
            raise RankFailedError("\n".join(lines), failures=failures, missing=missing)
        if missing:
            stacks = self._dump_stacks(missing)
            lines = [
                f"ranks {list(missing)} of {self.world_size} did not answer {what} "
                f"within the timeout"
            ]
            for rank in missing:
                if stacks.get(rank):
                    lines.append(f"--- rank {rank} stacks ---\n{stacks[rank].rstrip()}")
            raise WorldTimeoutError("\n".join(lines), missing=missing, stacks=stacks)
        return [replies[r] for r in ranks]

    def _dump_stacks(self, ranks: tuple[int, ...]) -> dict[int, str]:
        """Ask stuck workers to dump their Python stacks (faulthandler on SIGUSR1)."""
        for rank in ranks:
            try:
                os.kill(self._pids[rank], signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(_STACK_DUMP_WAIT_S)
        stacks = {}
        for rank in ranks:
            try:
                text = Path(self._stack_files[rank]).read_text(errors="replace")
            except (OSError, IndexError):
                text = ""
            stacks[rank] = "\n".join(text.splitlines()[-60:])
        return stacks


def _worker_alive(pid: int) -> bool:
    """Whether worker ``pid`` still runs (not gone, not a zombie); no waiting."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False
