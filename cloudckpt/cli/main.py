"""The ``cloudckpt`` command (also ``python -m cloudckpt``).

```
cloudckpt [--endpoint-url URL] [--profile NAME] [--timeout SECONDS] COMMAND ...
cloudckpt --version
cloudckpt ls RUN_URL [--details]           checkpoints of a run: step, time, size, objects,
                                           world size, complete
                                           (--details: own and shared bytes, base step,
                                           retained folders and what holds each folder)
cloudckpt show URL [--step N]              tensors (name, dtype, shape, chunks, bytes) and values
cloudckpt verify URL [--step N]            read every object, check every checksum
cloudckpt prune RUN_URL --keep-last N [--keep-every K] [--abandoned-after S] [--dry-run]
cloudckpt rm URL [--step N] [--dry-run]    delete one checkpoint (manifest first)
cloudckpt export URL OUT [--step N]        one consolidated OUT.safetensors, or OUT.pt (torch.save)
cloudckpt export URL DST --format safetensors [--prefix P] [--dtype D] [--max-shard-size S]
                                           a Hugging Face folder (local or s3://): cli/export.py
cloudckpt convert SRC DST --to dcp|cloudckpt [--trust]   to or from torch DCP (cli/convert.py)
```

``URL`` is a checkpoint URL, or a run URL with ``--step N``; ``show``, ``verify`` and ``export``
given a run URL without ``--step`` use its newest complete checkpoint (``rm`` never does: it
refuses a run and prints the ``--step`` to type). Credentials and endpoint
come from the standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...);
``--endpoint-url``, ``--profile`` and ``--timeout`` (accepted before or after the command, as
``aws`` does) override them for one run: they make the one ``StorageOptions`` every command uses
(:func:`storage_options`), made once and passed to the command as a
:class:`~cloudckpt.cli.store.CommandStorage`. An endpoint must be an ``http://`` or ``https://``
URL (exit 2 otherwise). ``ls``, ``show``, ``verify`` and ``prune`` take ``--json``: one JSON
document on stdout, shapes in :mod:`cloudckpt.cli.documents`.

Mistakes are refused with one line and exit 2 before anything is changed: a malformed option
(argparse's errors are one line here, with a pointer to ``--help``), a bad endpoint or unknown
profile, ``ls``/``prune`` given a checkpoint, a folder of checkpoints or a folder of runs instead
of a run (the line names the command to type: ``show URL/NAME``, ``ls URL/RUN``), a relative path
such as ``bucket/x`` that does not exist locally (it suggests ``s3://bucket/x``; as a destination
of ``convert`` or ``export --format``, ``./bucket/x`` says "a new local folder"), ``--step`` given
with a URL that is already a checkpoint, ``export`` into a folder that does not exist
(:mod:`cloudckpt.cli.urls`). A run with no checkpoints (or nothing under an S3 prefix) is not a
mistake: ``ls`` says "no checkpoints under URL" on stderr and exits 0 (``--json``: ``[]``); a
local folder that does not exist is (exit 1). ``--timeout`` defaults to about 60 seconds.

Counts: "objects" are a checkpoint's data objects everywhere (``ls``, ``show``, ``verify``,
``SaveResult.objects``); ``rm`` and ``prune`` name the manifest apart ("the manifest and 3
objects, 0 uploads").

``rm`` and ``prune`` delete only what the checkpoint layout owns: each checkpoint's
``manifest.msgpack`` (first), its ``data/<attempt>/r<rank>-<n>.bin`` objects and unfinished uploads
of those keys. Other keys under a checkpoint are left, and a line on stderr says so. ``rm`` takes a
checkpoint, complete or not (an incomplete one: its data objects and uploads); given a run it
refuses (exit 2) and names ``--step`` of its newest complete checkpoint, given a URL that is neither
a checkpoint nor a run (a folder of runs, other files) it refuses (exit 2, nothing removed), given a
URL with nothing there it exits 1. A step of a run (``--step N``, or a URL ending in
``step-<012d>``) is deleted through ``CheckpointManager(run).delete``: on a local path, a step
folder that is a symlink leading out of the run is refused (``AccessDenied``, exit 2). ``--dry-run``
lists every object and upload that would go, one per line, and removes nothing.

Exit status: 0 success; 1 the operation failed (checkpoint missing, verification failed, storage
error); 2 usage error, bad URL, missing or refused credentials, missing bucket; 130 interrupted;
141 stdout's reader went away.
Errors are one line on stderr, never a traceback (set ``CLOUDCKPT_DEBUG=1`` to get one). Output
into a pipe that closes early (``cloudckpt show URL | head``) ends quietly with 141, as unix
tools do (:mod:`cloudckpt.cli.stdout`).
Progress bars (tqdm) are drawn on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from cloudckpt.cli import documents
from cloudckpt.cli.convert import register as register_convert
from cloudckpt.cli.delete import cmd_prune, cmd_rm
from cloudckpt.cli.export import add_options as add_export_options
from cloudckpt.cli.export import cmd_export
from cloudckpt.cli.format import human_bytes, is_step_folder, label, local_time, table
from cloudckpt.cli.options import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    UsageError,
    global_options,
    seconds,
    storage_options,
    whole_number,
)
from cloudckpt.cli.show import cmd_show
from cloudckpt.cli.stdout import guarded, stdout_is_gone
from cloudckpt.cli.store import CommandStorage, progress
from cloudckpt.cli.urls import check_local_url, refuse_not_a_run, resolve_checkpoint
from cloudckpt.errors import AccessDenied, BucketNotFound, CloudCkptError, ConfigError
from cloudckpt.wording import plural

# -- commands -----------------------------------------------------------------------------------


def cmd_ls(args: Any, storage: CommandStorage) -> int:
    mgr = storage.manager(args.url)
    infos = mgr.list()
    if not infos:
        refuse_not_a_run(storage, args.url, "ls")
    with progress(sum(i.complete for i in infos), "reading manifests") as bar:
        infos = mgr.list(details=True, progress=bar.update) if infos else infos
    if not args.details:  # retained folders are listed with --details only
        infos = [i for i in infos if not i.retained]
    if args.json:
        documents.emit(documents.ls_document(infos, args.details))
    if not infos:
        print(f"no checkpoints under {args.url}", file=sys.stderr)
        return EXIT_OK
    if args.json:
        return EXIT_OK
    extra = (
        (
            lambda i: (
                human_bytes(i.own_bytes),
                human_bytes(i.shared_bytes),
                "-" if i.base_step is None else i.base_step,
            )
        )
        if args.details
        else lambda i: ()
    )
    named = any(not is_step_folder(i) for i in infos)  # a name column for trainers' names
    rows = [
        (
            "-" if i.step is None else i.step,
            local_time(i.created_at),
            human_bytes(i.total_bytes),
            "-" if i.objects is None else i.objects,
            "-" if i.world_size is None else i.world_size,
            "DAMAGED" if i.damaged else "yes" if i.complete else "RETAINED" if i.retained else "NO",
            *extra(i),
            *((i.name,) if named else ()),
        )
        for i in infos
    ]
    table(
        ("step", "time", "size", "objects", "world_size", "complete")
        + (("own", "shared", "base") if args.details else ())
        + (("name",) if named else ()),
        rows,
    )
    for i in infos:
        if i.damaged:
            print(f"{label(i)}: cannot be loaded: {i.damaged}", file=sys.stderr)
        for line in i.held_by if args.details else ():  # notes, like the damaged ones
            print(f"{label(i)}: held by {line}", file=sys.stderr)
    return EXIT_OK


def cmd_verify(args: Any, storage: CommandStorage) -> int:
    from cloudckpt.api.verify import verify

    url = resolve_checkpoint(storage, args.url, args.step, "verify")
    total = None
    if sys.stderr.isatty():
        from cloudckpt.stored import decode_manifest_without_pickle, read_manifest_bytes

        raw = read_manifest_bytes(url, store=storage.open(url))
        total = decode_manifest_without_pickle(raw)[0].total_bytes()
    with progress(total, "verifying", unit="B") as bar:
        report = verify(url, progress=bar.update, storage=storage.options)
    if args.json:
        documents.emit(documents.verify_document(url, report))
        return EXIT_OK if report.ok else EXIT_FAILED
    if report.ok:
        print(
            f"OK  {url}: {plural(report.objects_checked, 'object')}, "
            f"{human_bytes(report.bytes_checked)} checked"
        )
    else:
        print(
            f"FAILED  {url}: {plural(len(report.problems), 'problem')} "
            f"({plural(report.objects_checked, 'object')}, {human_bytes(report.bytes_checked)} "
            "checked)"
        )
    for problem in report.problems:
        print(f"  {problem}")
    for note in report.notes:
        print(f"  note: {note}")
    return EXIT_OK if report.ok else EXIT_FAILED


# -- entry point --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from cloudckpt.version import __version__

    p = Parser(
        prog="cloudckpt",
        description="Inspect and manage cloudckpt checkpoints in "
        "S3-compatible object stores or local paths.",
    )
    p.add_argument(
        "--version",
        action="version",
        version=f"cloudckpt {__version__}",
        help="print the version and exit",
    )
    global_options(p, default=None)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str,
        fn,
        help_: str,
        *,
        run_only: bool = False,
        json_: bool = False,
        url_help: str = "a checkpoint's URL, or a run's (its newest complete checkpoint, "
        "or the one of --step)",
    ):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument(
            "url",
            metavar="RUN_URL" if run_only else "URL",
            help="a run's URL (s3://BUCKET/PATH, file:///PATH or a path)" if run_only else url_help,
        )
        if not run_only:
            sp.add_argument(
                "--step",
                type=whole_number(0),
                default=None,
                metavar="N",
                help="the checkpoint of step N of the run at URL",
            )
        if json_:
            sp.add_argument(
                "--json",
                action="store_true",
                help="print one JSON document on stdout (for scripts)",
            )
        global_options(sp, default=argparse.SUPPRESS)
        sp.set_defaults(fn=fn)
        return sp

    sp = add(
        "ls",
        cmd_ls,
        "list the checkpoints of a run (objects: data objects, the manifest not counted)",
        run_only=True,
        json_=True,
    )
    sp.add_argument(
        "--details",
        action="store_true",
        help="also each checkpoint's own bytes, "
        "the bytes it shares with older ones (incremental) and its base step",
    )
    sp = add("show", cmd_show, "show a checkpoint's tensors and values", json_=True)
    sp.add_argument(
        "--allow-pickle",
        action="store_true",
        help="decode pickled values (runs code from the checkpoint: trusted only)",
    )
    add(
        "verify",
        cmd_verify,
        "read every object of a checkpoint and check every checksum",
        json_=True,
    )
    sp = add("prune", cmd_prune, "apply a retention policy to a run", run_only=True, json_=True)
    sp.add_argument(
        "--keep-last",
        type=whole_number(0),
        required=True,
        metavar="N",
        help="keep the N newest complete checkpoints (required)",
    )
    sp.add_argument(
        "--keep-every",
        type=whole_number(1),
        default=None,
        metavar="K",
        help="also keep every checkpoint whose step is a multiple of K",
    )
    sp.add_argument(
        "--abandoned-after",
        type=seconds(positive=False),
        default=3600.0,
        metavar="SECONDS",
        help="age after which an incomplete checkpoint is abandoned (default 3600)",
    )
    sp.add_argument("--dry-run", action="store_true", help="say what would be removed")
    sp = add(
        "rm",
        cmd_rm,
        "delete one checkpoint (manifest first, then its objects)",
        url_help="a checkpoint's URL, or a run's with --step N (a run without --step is "
        "refused: rm never picks a checkpoint for you)",
    )
    sp.add_argument(
        "--dry-run", action="store_true", help="list every object and upload that would be removed"
    )
    sp = add(
        "export",
        cmd_export,
        "write a checkpoint as one .safetensors or .pt file, or "
        "(--format safetensors) as a Hugging Face folder",
    )
    sp.add_argument(
        "out",
        metavar="OUT",
        help="the file to write, ending in .safetensors or .pt, in a folder that "
        "exists (with --format: a folder or s3:// prefix)",
    )
    sp.add_argument(
        "--allow-pickle",
        action="store_true",
        help="decode pickled values (runs code from the checkpoint: trusted only)",
    )
    add_export_options(sp)
    register_convert(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns (and, as a console script, exits with) the status. Output
    into a pipe closed early ends quietly with status 141 (:mod:`cloudckpt.cli.stdout`)."""
    return guarded(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    debug = bool(os.environ.get("CLOUDCKPT_DEBUG"))
    try:
        from cloudckpt.storage.urls import parse_store_url

        parse_store_url(args.url)  # a malformed URL is a usage error before anything runs
        check_local_url(args.url)  # bucket/x written without s3://
        return args.fn(args, CommandStorage(options=storage_options(args)))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # one line, no traceback: this is the command's whole error surface
        if debug or (isinstance(exc, BrokenPipeError) and stdout_is_gone()):
            raise
        status = (
            EXIT_USAGE
            if isinstance(exc, (UsageError, ConfigError, AccessDenied, BucketNotFound))
            else EXIT_FAILED
        )
        kind = (
            "error"
            if isinstance(exc, (CloudCkptError, UsageError, OSError))
            else f"internal error ({type(exc).__name__})"
        )
        text = " ".join(str(exc).split())
        print(f"cloudckpt {args.command}: {kind}: {text}", file=sys.stderr)
        return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
