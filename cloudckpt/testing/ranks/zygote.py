"""The zygote of the multi-rank harness (:mod:`cloudckpt.testing.ranks.world`): one process per
owner that imported torch once and forks workers on request, so a world (re)start costs well under a
second after the first. It runs in its own session and exits (killing its workers) on EOF of its
control socket, i.e. when the owner closes it or dies, even by SIGKILL.

Test infrastructure: messages are pickled between the owner and its own zygote.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from cloudckpt.testing.ranks.worker import worker_main

_ZYGOTE_START_TIMEOUT_S = 120.0


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[3])


class _Zygote:
    """Owner-side handle of the zygote. Requests (SOCK_SEQPACKET, one pickle per message):
    ("spawn",) + a socket fd -> ("pid", pid); ("kill", [pids]) -> ("killed", {pid: status});
    ("status", pid) -> ("status", status or None). status is the raw waitpid status."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self.scratch_dir: str | None = None  # removed by the zygote when it exits

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        boot = (
            "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
            "from cloudckpt.testing.ranks.zygote import _zygote_main; "
            "_zygote_main(int(sys.argv[2]))"
        )
        path = [_repo_root()] + [p for p in sys.path if p]
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", boot, json.dumps(path), str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._sock = ours
        ours.settimeout(_ZYGOTE_START_TIMEOUT_S)
        try:
            msg = pickle.loads(ours.recv(4096))
        except (OSError, EOFError, pickle.UnpicklingError) as exc:
            self._close()
            raise RuntimeError("the harness zygote process did not start") from exc
        ours.settimeout(30.0)
        if msg[0] != "ready":
            self._close()
            raise RuntimeError(f"the harness zygote process failed to start: {msg!r}")
        self.scratch_dir = msg[2]

    def _request(self, msg: tuple, fds: list[int] | None = None) -> tuple:
        sock = self._sock
        if sock is None:  # (set with _proc, under the lock: callers checked _proc)
            raise OSError("the harness zygote process is not running")
        data = pickle.dumps(msg)
        if fds:
            socket.send_fds(sock, [data], fds)
        else:
            sock.send(data)
        return pickle.loads(sock.recv(1 << 16))

    def spawn(self) -> tuple[int, multiprocessing.connection.Connection, str]:
        """Fork one worker; return its pid, the owner's end of its connection and the
        zygote's scratch directory."""
        with self._lock:
            self._ensure()
            scratch = self.scratch_dir
            if scratch is None:
                raise RuntimeError("the harness zygote process did not start")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with theirs:
                reply = self._request(("spawn",), [theirs.fileno()])
            return reply[1], multiprocessing.connection.Connection(ours.detach()), scratch

    def kill(self, pids: list[int]) -> dict[int, int | None]:
        """SIGKILL and reap the given workers (only ones the zygote has not reaped yet)."""
        with self._lock:
            if not pids or self._proc is None or self._proc.poll() is not None:
                return {}
            try:
                return self._request(("kill", list(pids)))[1]
            except (OSError, EOFError):
                return {}

    def status(self, pid: int) -> int | None:
        """Raw wait status of an exited worker (waits up to 1 s), None if unknown/alive."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                return None
            try:
                return self._request(("status", pid))[1]
            except (OSError, EOFError):
                return None

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()  # EOF: the zygote kills its workers and exits
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._close()


_ZYGOTE = _Zygote()


def _describe_status(status: int | None) -> str:
    if status is None:
        return "exit status unknown"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.WEXITSTATUS(status)}"


def _zygote_main(fd: int) -> None:
    """The zygote's loop (runs in its own process): preload torch, then serve fork requests.
    On EOF from the owner it kills every live worker and exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch  # noqa: F401  (the point of the zygote: workers inherit the import)
    import torch.distributed  # noqa: F401

    sock = socket.socket(fileno=fd)
    live: set[int] = set()
    exited: dict[int, int] = {}

    def reap(pid: int = -1, flags: int = os.WNOHANG) -> None:
        while live:
            try:
                got, status = os.waitpid(pid, flags)
            except ChildProcessError:
                return
            if got == 0:
                return
            live.discard(got)
            exited[got] = status
            if pid != -1:
                return

    scratch = tempfile.mkdtemp(prefix="cloudckpt-world-")
    sock.send(pickle.dumps(("ready", os.getpid(), scratch)))
    while True:
        ready, _, _ = select.select([sock], [], [], 1.0)
        reap()
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
        if not data:
            break
        msg = pickle.loads(data)
        if msg[0] == "spawn":
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    sock.close()
                    signal.signal(signal.SIGINT, signal.SIG_IGN)
                    worker_main(multiprocessing.connection.Connection(fds[0]))
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    for stream in (sys.stdout, sys.stderr):
                        try:
                            stream.flush()
                        except Exception:
                            pass
                    os._exit(code)
            os.close(fds[0])
            live.add(pid)
            sock.send(pickle.dumps(("pid", pid)))
        elif msg[0] == "kill":
            statuses = {}
            for pid in msg[1]:
                if pid in live:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    reap(pid, 0)
                statuses[pid] = exited.pop(pid, None)
            sock.send(pickle.dumps(("killed", statuses)))
        elif msg[0] == "status":
            deadline = time.monotonic() + 1.0
            while msg[1] in live and time.monotonic() < deadline:
                reap()
                time.sleep(0.02)
            sock.send(pickle.dumps(("status", exited.get(msg[1]))))
    for pid in list(live):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in list(live):
        reap(pid, 0)
    shutil.rmtree(scratch, ignore_errors=True)
