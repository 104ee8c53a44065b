"""Many runs of the ``cloudckpt`` command in one process (one interpreter start instead of one
per run): ``python -m tests.reliability.cli_batch CASES.json RESULTS.json``.

Each case is ``{"argv": [...], "cwd": DIR, "stdout": "capture" | "closed"}``; each run calls
:func:`cloudckpt.cli.main` as ``python -m cloudckpt`` does, with ``sys.stdout`` a fresh text file
over a temporary file ("capture") or over a fresh pipe whose reading end is already closed
("closed": ``cloudckpt ... | head`` after head has gone); output the command leaves unflushed
shows as "unflushed output at exit" in its stderr, where the interpreter would complain.
Results, in order: ``{"status", "stdout", "stderr"}`` (``status``: what main returned, or the
SystemExit code of argparse). The real stderr of this process is left alone: the caller checks
it stays empty.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile


def run_case(case: dict) -> dict:
    """One run of the command; its stdout is a fresh block-buffered text file over a pipe with
    no reader or over a temporary file, as the command's would be."""
    from cloudckpt.cli import main

    os.chdir(case["cwd"])
    capture = None
    if case["stdout"] == "closed":
        read_end, fd = os.pipe()
        os.close(read_end)
    else:
        capture = tempfile.TemporaryFile()
        fd = os.dup(capture.fileno())
    sys.stdout = open(fd, "w")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = main(case["argv"])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
    try:
        sys.stdout.close()
    except OSError:  # what the command left unflushed (the interpreter would complain at exit)
        err.write("unflushed output at exit\n")
    finally:
        sys.stdout = sys.__stdout__
    out = ""
    if capture is not None:
        capture.seek(0)
        out = capture.read().decode()
        capture.close()
    return {"status": status, "stdout": out, "stderr": err.getvalue()}


def main(argv: list[str]) -> int:
    cases_path, results_path = argv
    with open(cases_path) as f:
        cases = json.load(f)
    results = [run_case(case) for case in cases]
    with open(results_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
