"""The ``cloudckpt`` command's stdout when its reader goes away (``cloudckpt show URL | head``).

Contract: :func:`guarded` runs the whole command, argument parsing (``--help``, ``--version``)
included, and flushes stdout before it returns. When a write or that flush fails because stdout
is a pipe whose reader has closed it, the command ends quietly as other unix tools do: exit
status :data:`EXIT_BROKEN_PIPE` (128 + SIGPIPE, what a shell shows for ``yes | head``), nothing
on stderr, stdout pointed at ``/dev/null`` so that the interpreter's own flush at exit does not
complain either. A ``BrokenPipeError`` from anything else (a socket) is not this: it is raised
on. SIGPIPE itself stays ignored (Python's default): with its default action, a write to a reset
S3 connection would kill the process mid-deletion.
"""

from __future__ import annotations

import os
import select
import sys
from collections.abc import Callable

EXIT_BROKEN_PIPE = 141


def stdout_is_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll: POLLERR on the write end)."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or no real stdout: assume so
        return True


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def guarded(run: Callable[[], int]) -> int:
    """``run()``'s exit status, or :data:`EXIT_BROKEN_PIPE` when stdout's reader went away."""
    try:
        try:
            status = run()
        finally:  # SystemExit of --help and of usage errors too: their text is in the buffer
            sys.stdout.flush()
        return status
    except BrokenPipeError:
        if not stdout_is_gone():
            raise
        _silence_stdout()
        return EXIT_BROKEN_PIPE
