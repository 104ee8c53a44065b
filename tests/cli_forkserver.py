"""``python -m cloudckpt ARGS`` for the tests, without paying the imports each time.

A command-line test starts the CLI dozens of times; each fresh interpreter spends most of its
seconds importing (aiobotocore, aiohttp, torch for the commands that need it). This module keeps
one fork server per test process: it imported those once, and forks a child for every command.
The child is what ``python -m cloudckpt`` would be: its own process, the environment and working
directory given (replaced whole), stdin from /dev/null, stdout and stderr captured, the module run
as ``__main__``, and the interpreter's exit steps (uncaught errors printed, threads joined, atexit
handlers run, streams flushed) giving the exit status. Tests that need a real interpreter start
(imports, signals, pipes) keep starting their own subprocess.

Test infrastructure: requests are pickled over a private socket between a test process and its
own server (as in :mod:`cloudckpt.testing.ranks.zygote`).
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1])


class _Server:
    """The owner's handle: starts the server on first use, one request at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn = None

    def _start(self) -> None:
        folder = tempfile.mkdtemp(prefix="cloudckpt-cli-fork-")
        address = os.path.join(folder, "socket")
        key = os.urandom(16)
        listener = multiprocessing.connection.Listener(address, family="AF_UNIX", authkey=key)
        env = dict(os.environ, PYTHONPATH=REPO)
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, tests.cli_forkserver as m; m.serve(sys.argv[1])",
                address,
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(key)
        self._proc.stdin.close()
        self._conn = listener.accept()
        listener.close()  # removes the socket file
        shutil.rmtree(folder, ignore_errors=True)
        atexit.register(self.close)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()  # EOF: the server exits
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None

    def run(
        self, args: list[str], *, cwd: str, env: dict[str, str], timeout: float, closed_stdout: bool
    ) -> subprocess.CompletedProcess:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            with tempfile.TemporaryDirectory(prefix="cloudckpt-cli-run-") as out:
                paths = (os.path.join(out, "stdout"), os.path.join(out, "stderr"))
                self._conn.send(
                    ("run", list(args), str(cwd), dict(env), paths, float(timeout), closed_stdout)
                )
                status = self._conn.recv()
                stdout, stderr = (Path(p).read_text(errors="replace") for p in paths)
        argv = [sys.executable, "-m", "cloudckpt", *args]
        if status is None:
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(argv, status, stdout, stderr)


_SERVER = _Server()


def run_cli(
    args, *, cwd: str, env: dict[str, str], timeout: float = 120.0, closed_stdout: bool = False
) -> subprocess.CompletedProcess:
    """Like ``subprocess.run([sys.executable, "-m", "cloudckpt", *args], cwd=cwd, env=env,
    capture_output=True, text=True, timeout=timeout)``, in a child of the fork server.
    ``closed_stdout``: stdout is a pipe whose reader has already gone (``cloudckpt ... | head``
    after head exited); ``stdout`` is then empty."""
    return _SERVER.run(
        [str(a) for a in args], cwd=str(cwd), env=env, timeout=timeout, closed_stdout=closed_stdout
    )


# -- server side ---------------------------------------------------------------------------------


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return _returncode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.005)


def serve(address: str) -> None:
    """Import what the commands need, then fork one child per request until EOF."""
    import torch  # noqa: F401  (export, verify, convert import it)

    import cloudckpt.cli.main  # noqa: F401
    import cloudckpt.storage  # noqa: F401

    key = sys.stdin.buffer.read()
    conn = multiprocessing.connection.Client(address, family="AF_UNIX", authkey=key)
    while True:
        try:
            _, args, cwd, env, paths, timeout, closed_stdout = conn.recv()
        except EOFError:
            return
        pid = os.fork()
        if pid == 0:
            conn.close()
            _become_the_command(args, cwd, env, paths, closed_stdout)  # never returns
        conn.send(_wait(pid, timeout))


def _become_the_command(
    args: list[str], cwd: str, env: dict[str, str], paths: tuple[str, str], closed_stdout: bool
) -> None:
    """In the child: set up the process as ``python -m cloudckpt ARGS`` would have it, run the
    module, and exit with its status."""
    import runpy

    os.setpgid(0, 0)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in zip((1, 2), paths):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.close(null)
    if closed_stdout:
        read_end, write_end = os.pipe()
        os.close(read_end)
        os.dup2(write_end, 1)
        os.close(write_end)
    _open_stdio(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
    sys.argv = [str(Path(REPO) / "cloudckpt" / "__main__.py"), *args]
    sys.modules.pop("cloudckpt.__main__", None)
    try:
        runpy.run_module("cloudckpt", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except BaseException:  # what the interpreter does with an uncaught error
        sys.excepthook(*sys.exc_info())
        code = 1
    # The interpreter's exit, less the tear-down of every module (over a second with torch
    # imported, and nothing a command's behaviour depends on).
    threading._shutdown()  # joins the non-daemon threads, as Py_Finalize does
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = 120  # the status Python gives when flushing at exit fails
    os._exit(code)


def _open_stdio(*, unbuffered: bool) -> None:
    """sys.stdout and sys.stderr made anew over fds 1 and 2, buffered as the interpreter makes
    them at start-up for this command's environment (the server's were made for its own):
    stdout block-buffered unless ``PYTHONUNBUFFERED`` (line-buffered on a terminal), stderr
    line-buffered."""
    import io

    def stream(fd: int, *, errors: str, line_buffering: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            binary,
            encoding="utf-8",
            errors=errors,
            line_buffering=line_buffering,
            write_through=unbuffered,
        )

    sys.stdout = sys.__stdout__ = stream(1, errors="strict", line_buffering=os.isatty(1))
    sys.stderr = sys.__stderr__ = stream(2, errors="backslashreplace", line_buffering=True)


def _exit_status(code) -> int:
    """The exit status of ``sys.exit(code)``: None is 0, an int is itself, anything else is
    printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
