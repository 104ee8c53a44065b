"""The ``cloudckpt`` command (also ``python -m cloudckpt``).

```
cloudckpt [--endpoint-url URL] [--profile NAME] [--timeout SECONDS] COMMAND ...
cloudckpt --version
cloudckpt ls RUN_URL [--details]           checkpoints of a run: step, time, size, objects, world size, complete
                                           (--details: own and shared bytes, base step,
                                           retained folders and what holds each folder)
cloudckpt show URL [--step N]              tensors (name, dtype, shape, chunks, bytes) and values
cloudckpt verify URL [--step N]            read every object, check every checksum
cloudckpt prune RUN_URL --keep-last N [--keep-every K] [--abandoned-after S] [--dry-run]
cloudckpt rm URL [--step N] [--dry-run]    delete one checkpoint (manifest first)
cloudckpt export URL OUT [--step N]        one consolidated OUT.safetensors, or OUT.pt (torch.save)
cloudckpt export URL DST --format safetensors [--prefix P] [--dtype D] [--max-shard-size S]
                                           a Hugging Face folder (local or s3://): cli_export
cloudckpt convert SRC DST --to dcp|cloudckpt [--trust]   to or from torch DCP (cli_convert.py)
```

``URL`` is a checkpoint URL, or a run URL with ``--step N``; ``show``, ``verify`` and ``export``
given a run URL without ``--step`` use its newest complete checkpoint. Credentials and endpoint
come from the standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...);
``--endpoint-url``, ``--profile`` and ``--timeout`` (accepted before or after the command, as
``aws`` does) override them for one run: they make the one ``StorageOptions`` every command uses
(:func:`storage_options`). An endpoint must be an ``http://`` or ``https://`` URL (exit 2
otherwise). ``ls``, ``show``, ``verify`` and ``prune`` take ``--json``: one JSON document on
stdout, shapes in :mod:`cloudckpt.cli_json`.

Mistakes are refused with one line and exit 2 before anything is changed: a malformed option
(argparse's errors are one line here, with a pointer to ``--help``), a bad endpoint or unknown
profile, ``ls``/``prune`` given a checkpoint instead of a run (``ls`` suggests ``show``),
``--step`` given with a URL that is already a checkpoint, ``export`` into a folder that does not
exist. A run with no checkpoints (or nothing at the URL) is not a mistake: ``ls`` says "no
checkpoints under URL" on stderr and exits 0 (``--json``: ``[]``). ``--timeout`` defaults to about 60 seconds.

``rm`` and ``prune`` delete only what the checkpoint layout owns: each checkpoint's
``manifest.msgpack`` (first), its ``data/<attempt>/r<rank>-<n>.bin`` objects and unfinished uploads
of those keys. Other keys under a checkpoint are left, and a line on stderr says so. ``rm`` takes a
checkpoint, complete or not (an incomplete one: its data objects and uploads); given a run it
refuses (exit 2), given a URL that is neither a checkpoint nor a run (a folder of runs, other
files) it refuses (exit 2, nothing removed), given a URL with nothing there it exits 1. A step of
a run (``--step N``, or a URL ending in ``step-<012d>``) is deleted through
``CheckpointManager(run).delete``: on a local path, a step folder that is a symlink leading out of
the run is refused (``AccessDenied``, exit 2). ``--dry-run`` lists every object and upload that
would go, one per line, and removes nothing.

Exit status: 0 success; 1 the operation failed (checkpoint missing, verification failed, storage
error); 2 usage error, bad URL, missing or refused credentials, missing bucket; 130 interrupted.
Errors are one line on stderr, never a traceback (set ``CLOUDCKPT_DEBUG=1`` to get one).
Progress bars (tqdm) are drawn on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import datetime
from typing import Any, Sequence

from cloudckpt.errors import (AccessDenied, BucketNotFound, CheckpointNotFound, CloudCkptError,
                              ConfigError, ObjectNotFound)
from cloudckpt.layout import MANIFEST_KEY
from cloudckpt import cli_json
from cloudckpt.cli_show import print_show
from cloudckpt.cli_options import (EXIT_USAGE, Parser, UsageError, global_options, seconds,
                                   storage_options, whole_number)
from cloudckpt.wording import plural

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130


# -- helpers ------------------------------------------------------------------------------------


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _fmt_time(value: datetime | None) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out=None) -> None:
    out = out or sys.stdout
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for row in [list(headers)] + cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)


def _progress(total: int | None, desc: str, unit: str = "obj"):
    """A tqdm bar on stderr when it is a terminal, else a silent stand-in."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                leave=False, disable=not sys.stderr.isatty())


#: The StorageOptions of this run of the command (None: the AWS chain); set by :func:`main`.
_STORAGE = None


def _open(url: str):
    from cloudckpt.runtime import shared_store

    return shared_store(url, _STORAGE)  # closed at exit


def _has_manifest(store) -> bool:
    from cloudckpt.runtime import run_coroutine

    try:
        run_coroutine(store.head(MANIFEST_KEY))
        return True
    except ObjectNotFound:
        return False


def _resolve_checkpoint(url: str, step: int | None) -> str:
    """The checkpoint URL meant by ``url`` / ``--step`` (newest complete of a run by default)."""
    from cloudckpt.manager import join_url, step_dir

    is_checkpoint = _has_manifest(_open(url))
    if step is not None:
        if is_checkpoint:
            raise UsageError(f"{url} is a checkpoint already; give its run's URL with --step "
                             f"{step}, or drop --step")
        return join_url(url, step_dir(step))
    if is_checkpoint:
        return url
    latest = _manager(url).latest()
    if latest is None:
        raise CheckpointNotFound(f"no complete checkpoint at {url} (nor a run with one)")
    print(f"using the newest complete checkpoint: step {latest.step} ({latest.url})",
          file=sys.stderr)
    return latest.url


def _manager(url: str, **kwargs):
    from cloudckpt.manager import CheckpointManager

    return CheckpointManager(url, storage=_STORAGE, **kwargs)


def _refuse_checkpoint_as_run(url: str, command: str) -> None:
    """``ls``/``prune`` given a checkpoint (a manifest at URL) instead of a run: a UsageError."""
    if _has_manifest(_open(url)):
        raise UsageError(f"{url} is a checkpoint, not a run: {command} takes a run's URL; "
                         f"to see this checkpoint use: cloudckpt show {url}")


# -- commands -----------------------------------------------------------------------------------


def cmd_ls(args) -> int:
    mgr = _manager(args.url)
    infos = mgr.list()
    if not infos:
        _refuse_checkpoint_as_run(args.url, "ls")
    with _progress(sum(i.complete for i in infos), "reading manifests") as bar:
        infos = mgr.list(details=True, progress=bar.update) if infos else infos
    if not args.details:  # retained folders are listed with --details only
        infos = [i for i in infos if not i.retained]
    if args.json:
        cli_json.emit(cli_json.ls_document(infos, args.details))
    if not infos:
        print(f"no checkpoints under {args.url}", file=sys.stderr)
        return EXIT_OK
    if args.json:
        return EXIT_OK
    extra = (lambda i: (_human_bytes(i.own_bytes), _human_bytes(i.shared_bytes),
                        "-" if i.base_step is None else i.base_step)) if args.details else lambda i: ()
    rows = [(i.step, _fmt_time(i.created_at), _human_bytes(i.total_bytes),
             "-" if i.objects is None else i.objects,
             "-" if i.world_size is None else i.world_size,
             "DAMAGED" if i.damaged else "yes" if i.complete else
             "RETAINED" if i.retained else "NO",
             *extra(i)) for i in infos]
    _table(("step", "time", "size", "objects", "world_size", "complete")
           + (("own", "shared", "base") if args.details else ()), rows)
    for i in infos:
        if i.damaged:
            print(f"step {i.step}: cannot be loaded: {i.damaged}", file=sys.stderr)
        for line in i.held_by if args.details else ():  # notes, like the damaged ones
            print(f"step {i.step}: held by {line}", file=sys.stderr)
    return EXIT_OK


def _manifest_bytes(url: str) -> bytes:
    from cloudckpt.api.manifest_io import fetch_manifest_bytes
    from cloudckpt.runtime import run_coroutine

    try:
        return run_coroutine(fetch_manifest_bytes(_open(url)))
    except ObjectNotFound as exc:
        raise CheckpointNotFound(f"no complete checkpoint at {url} ({exc})") from exc


def cmd_show(args) -> int:
    import cloudckpt

    from cloudckpt.manager import decode_manifest_without_pickle

    url = _resolve_checkpoint(args.url, args.step)
    pickled: tuple[str, ...] = ()
    if args.allow_pickle:
        manifest = cloudckpt.read_manifest(url, allow_pickle=True, storage=_STORAGE)
    else:
        manifest, pickled = decode_manifest_without_pickle(_manifest_bytes(url))
    if args.json:
        cli_json.emit(cli_json.show_document(url, manifest, pickled))
    else:
        print_show(url, manifest, pickled, table=_table, human_bytes=_human_bytes,
                   fmt_time=_fmt_time)
    return EXIT_OK


def cmd_verify(args) -> int:
    import cloudckpt

    url = _resolve_checkpoint(args.url, args.step)
    total = None
    if sys.stderr.isatty():
        from cloudckpt.manager import decode_manifest_without_pickle

        total = decode_manifest_without_pickle(_manifest_bytes(url))[0].total_bytes()
    with _progress(total, "verifying", unit="B") as bar:
        report = cloudckpt.verify(url, progress=bar.update, storage=_STORAGE)
    if args.json:
        cli_json.emit(cli_json.verify_document(url, report))
        return EXIT_OK if report.ok else EXIT_FAILED
    if report.ok:
        print(f"OK  {url}: {plural(report.objects_checked, 'object')}, "
              f"{_human_bytes(report.bytes_checked)} checked")
    else:
        print(f"FAILED  {url}: {plural(len(report.problems), 'problem')} "
              f"({plural(report.objects_checked, 'object')}, {_human_bytes(report.bytes_checked)} "
              "checked)")
    for problem in report.problems:
        print(f"  {problem}")
    for note in report.notes:
        print(f"  note: {note}")
    return EXIT_OK if report.ok else EXIT_FAILED


def _left_note(url: str, plan, verb: str) -> None:
    """One stderr line about the keys a deletion leaves because the layout does not own them."""
    if plan.left:
        more = ", ..." if plan.left > len(plan.left_examples) else ""
        print(f"{verb} {plural(plan.left, 'key')} under {url} that "
              f"{'is' if plan.left == 1 else 'are'} not part of a checkpoint: "
              f"{', '.join(plan.left_examples)}{more}", file=sys.stderr)


def _print_keys(base: str, plan) -> None:
    """Every object and upload of ``plan`` (keys relative to ``base``), one per line."""
    from cloudckpt.manager import join_url

    for key in plan.objects:
        print(f"  {join_url(base, key)}")
    for upload in plan.uploads:
        print(f"  upload {join_url(base, upload.key)} {upload.upload_id}")


def cmd_prune(args) -> int:
    mgr = _manager(args.url, keep_last=args.keep_last, keep_every=args.keep_every,
                   abandoned_after=args.abandoned_after)
    if not mgr.list():
        _refuse_checkpoint_as_run(args.url, "prune")
    with _progress(None, "deleting") as bar:
        removed = mgr.prune_plans(dry_run=args.dry_run, progress=bar.update)
    if args.json:
        cli_json.emit(cli_json.prune_document(mgr.url, removed, args.dry_run))
        for info, plan in removed:
            _left_note(info.url, plan, "would leave" if args.dry_run else "left")
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    if not removed:
        print("nothing to remove")
    for info, plan in removed:
        state = "complete" if info.complete else "abandoned"
        counts = f"{plural(len(plan.objects), 'object')}, {plural(len(plan.uploads), 'upload')}"
        if plan.kept:
            counts += f"; {plural(plan.kept, 'object')} kept, other checkpoints use them"
        print(f"{verb} step {info.step} ({state})  {info.url}  ({counts})")
        if args.dry_run:
            _print_keys(mgr.url, plan)
        _left_note(info.url, plan, "would leave" if args.dry_run else "left")
    return EXIT_OK


def _step_of_url(url: str) -> tuple[str, int] | None:
    """(run URL, step) when ``url``'s last segment is a step folder ``step-<012d>`` of a run."""
    from cloudckpt.manager import parse_step_dir

    parent, _, last = url.rstrip("/").rpartition("/")
    step = parse_step_dir(last + "/")
    if step is None or not parent.strip("/") or parent.endswith((":", "/")):
        return None  # no run above it (a bucket, a filesystem root, a relative name)
    return parent, step


def cmd_rm(args) -> int:
    """Delete one checkpoint, complete or incomplete: only the keys the layout owns. A step of a
    run (``--step N``, or a URL ending in ``step-<012d>``) goes through
    ``CheckpointManager(run).delete`` and its guards; a run or a folder that is neither is
    refused (exit 2), and a URL with nothing there is "nothing to remove" (exit 1). A URL with no
    manifest that holds step checkpoints is a run, unless it is a step that owns keys itself."""
    from cloudckpt.manager import join_url, step_dir
    from cloudckpt.run_cleanup import delete_checkpoint, plan_checkpoint
    from cloudckpt.runtime import run_coroutine

    located = (args.url, args.step) if args.step is not None else _step_of_url(args.url)
    if located is not None:
        if args.step is not None and _has_manifest(_open(args.url)):
            raise UsageError(f"{args.url} is a checkpoint already; give its run's URL with "
                             f"--step {args.step}, or drop --step")
        mgr, step = _manager(located[0]), located[1]
        url, base = join_url(mgr.url, step_dir(step)), mgr.url
        plan = mgr.plan_delete(step)  # refuses a step folder that leads out of the run

        def delete(progress) -> int:
            return mgr.delete(step, progress=progress)
    else:  # from the folder above it, when there is one: siblings may reference its objects
        from cloudckpt.run_layout import split_folder
        from cloudckpt.storage import parse_store_url

        url, plan, above = args.url, None, split_folder(args.url)
        if above is not None and os.path.islink(parse_store_url(url).path or "/"):
            above = None  # a folder the user named through a symlink: itself, no siblings
        base, prefix = (url, "") if above is None else (above[0], above[1] + "/")
        store = _open(base)

        def delete(progress) -> int:
            return run_coroutine(delete_checkpoint(store, prefix, progress=progress))
    # a run is refused; a step of a run that owns something is a checkpoint whatever it holds
    if (plan.empty if plan is not None else not _has_manifest(_open(url))):
        others = _manager(url).list()
        if others:
            raise UsageError(f"{url} is a run with {plural(len(others), 'checkpoint')}, not a "
                             "checkpoint; give one checkpoint URL or --step N")
    if plan is None:
        plan = run_coroutine(plan_checkpoint(store, prefix))
    if plan.empty and plan.left:
        raise UsageError(f"{url} is neither a checkpoint nor a run ({plural(plan.left, 'key')} "
                         "there, none part of a checkpoint); nothing removed")
    if plan.empty:
        used = f": its {plural(plan.kept, 'object')} are used by other checkpoints" \
            if plan.kept else ""
        print(f"nothing to remove at {url}{used}", file=sys.stderr)
        return EXIT_FAILED
    state = "" if plan.has_manifest else "incomplete checkpoint, "
    if args.dry_run:
        print(f"would remove {url} ({state}{plural(len(plan.objects), 'object')}, "
              f"{plural(len(plan.uploads), 'upload')})")
        _print_keys(base, plan)
        _left_note(url, plan, "would leave")
        return EXIT_OK
    with _progress(len(plan.objects), "deleting") as bar:
        removed = delete(bar.update)
    kept = f"; {plural(plan.kept, 'object')} kept, other checkpoints use them" if plan.kept else ""
    print(f"removed {url} ({state}{plural(removed, 'object')}, "
          f"{plural(len(plan.uploads), 'upload')}{kept})")
    _left_note(url, plan, "left")
    return EXIT_OK


def cmd_export(args) -> int:
    """Write one consolidated file; see :mod:`cloudckpt.export` for how OUT is written (a fresh,
    exclusively created temporary file renamed onto OUT; nothing left behind on failure)."""
    from cloudckpt import cli_export
    from cloudckpt.export import export, export_kind

    if cli_export.wants_folder(args):
        return cli_export.cmd_export_folder(args, _resolve_checkpoint(args.url, args.step),
                                            _STORAGE, _progress)
    out = args.out
    if export_kind(out) is None:
        raise UsageError(f"OUT must end with .safetensors or .pt, got {out!r}")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {out}: the folder {folder} does not exist; create it "
                         "first")
    if os.path.isdir(out):
        raise UsageError(f"cannot write {out}: it is a folder; give a file name")
    url = _resolve_checkpoint(args.url, args.step)
    skipped = export(url, out, allow_pickle=args.allow_pickle, storage=_STORAGE)
    if skipped:
        print(f"warning: {plural(len(skipped), 'non-tensor value')} not representable in "
              f"JSON {'was' if len(skipped) == 1 else 'were'} "
              f"left out: {', '.join(skipped[:5])}", file=sys.stderr)
    print(f"exported {url} -> {out}")
    return EXIT_OK


# -- entry point --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from cloudckpt import __version__, cli_export

    p = Parser(prog="cloudckpt", description="Inspect and manage cloudckpt checkpoints in "
                "S3-compatible object stores or local paths.")
    p.add_argument("--version", action="version", version=f"cloudckpt {__version__}",
                   help="print the version and exit")
    global_options(p, default=None)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn, help_: str, *, run_only: bool = False, json_: bool = False):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("url", metavar="RUN_URL" if run_only else "URL",
                        help="a run's URL (s3://BUCKET/PATH, file:///PATH or a path)" if run_only
                        else "a checkpoint's URL, or a run's (its newest complete checkpoint, "
                             "or the one of --step)")
        if not run_only:
            sp.add_argument("--step", type=whole_number(0), default=None, metavar="N",
                            help="the checkpoint of step N of the run at URL")
        if json_:
            sp.add_argument("--json", action="store_true",
                            help="print one JSON document on stdout (for scripts)")
        global_options(sp, default=argparse.SUPPRESS)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("ls", cmd_ls, "list the checkpoints of a run", run_only=True, json_=True)
    sp.add_argument("--details", action="store_true", help="also each checkpoint's own bytes, "
                    "the bytes it shares with older ones (incremental) and its base step")
    sp = add("show", cmd_show, "show a checkpoint's tensors and values", json_=True)
    sp.add_argument("--allow-pickle", action="store_true",
                    help="decode pickled values (runs code from the checkpoint: trusted only)")
    add("verify", cmd_verify, "read every object of a checkpoint and check every checksum",
        json_=True)
    sp = add("prune", cmd_prune, "apply a retention policy to a run", run_only=True, json_=True)
    sp.add_argument("--keep-last", type=whole_number(0), required=True, metavar="N",
                    help="keep the N newest complete checkpoints (required)")
    sp.add_argument("--keep-every", type=whole_number(1), default=None, metavar="K",
                    help="also keep every checkpoint whose step is a multiple of K")
    sp.add_argument("--abandoned-after", type=seconds(positive=False), default=3600.0,
                    metavar="SECONDS",
                    help="age after which an incomplete checkpoint is abandoned (default 3600)")
    sp.add_argument("--dry-run", action="store_true", help="say what would be removed")
    sp = add("rm", cmd_rm, "delete one checkpoint (manifest first, then its objects)")
    sp.add_argument("--dry-run", action="store_true",
                    help="list every object and upload that would be removed")
    sp = add("export", cmd_export, "write a checkpoint as one .safetensors or .pt file")
    sp.add_argument("out", metavar="OUT",
                    help="the file to write, ending in .safetensors or .pt, in a folder that "
                         "exists (with --format: a folder or s3:// prefix)")
    sp.add_argument("--allow-pickle", action="store_true",
                    help="decode pickled values (runs code from the checkpoint: trusted only)")
    cli_export.add_options(sp)
    from cloudckpt.cli_convert import register
    register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns (and, as a console script, exits with) the status."""
    global _STORAGE
    args = build_parser().parse_args(argv)
    debug = bool(os.environ.get("CLOUDCKPT_DEBUG"))
    try:
        from cloudckpt.runtime import set_default_storage
        from cloudckpt.storage import parse_store_url

        parse_store_url(args.url)  # a malformed URL is a usage error before anything runs
        _STORAGE = storage_options(args)
        if _STORAGE is not None:  # also for any call below that is given no storage
            set_default_storage(_STORAGE)
        return args.fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # one line, no traceback: this is the command's whole error surface
        if debug:
            raise
        status = EXIT_USAGE if isinstance(
            exc, (UsageError, ConfigError, AccessDenied, BucketNotFound)) else EXIT_FAILED
        kind = "error" if isinstance(exc, (CloudCkptError, UsageError, OSError)) else \
            f"internal error ({type(exc).__name__})"
        text = " ".join(str(exc).split())
        print(f"cloudckpt {args.command}: {kind}: {text}", file=sys.stderr)
        return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
