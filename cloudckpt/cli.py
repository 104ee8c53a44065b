"""The ``cloudckpt`` command (also ``python -m cloudckpt``).

```
cloudckpt ls RUN_URL                       checkpoints of a run: step, time, size, objects, world size, complete
cloudckpt show URL [--step N]              tensors (name, dtype, shape, chunks, bytes) and values
cloudckpt verify URL [--step N]            read every object, check every checksum
cloudckpt prune RUN_URL --keep-last N [--keep-every K] [--abandoned-after S] [--dry-run]
cloudckpt rm URL [--step N] [--dry-run]    delete one checkpoint (manifest first)
cloudckpt export URL OUT [--step N]        one consolidated OUT.safetensors, or OUT.pt (torch.save)
```

``URL`` is a checkpoint URL, or a run URL with ``--step N``; ``show``, ``verify`` and ``export``
given a run URL without ``--step`` use its newest complete checkpoint. Credentials and endpoint
come from the standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
``--timeout SECONDS`` (before the command) gives up on an endpoint that does not answer after
about SECONDS (default: about 60).

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
import itertools
import json
import os
import sys
from datetime import datetime
from typing import Any, Sequence

from cloudckpt.errors import (AccessDenied, BucketNotFound, CheckpointNotFound, CloudCkptError,
                              ConfigError, ObjectNotFound)
from cloudckpt.layout import MANIFEST_KEY
from cloudckpt.wording import plural

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A command-line mistake detected after parsing (exit status 2)."""


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


def _fmt_epoch(seconds: float) -> str:
    """A manifest's creation time (unix seconds), or the number itself when it is no time."""
    try:
        return _fmt_time(datetime.fromtimestamp(seconds).astimezone())
    except (OverflowError, OSError, ValueError):
        return f"{seconds!r} (not a valid time)"


def _safe_repr(value: Any, depth: int = 0) -> str:
    """``repr(value)`` that never fails: an int of more than 256 bits is shown by its size
    (``repr`` refuses ints of more than 4300 digits), containers show their first 20 items and
    8 levels."""
    t = type(value)
    if t is int and value.bit_length() > 256:
        return f"<int of {value.bit_length()} bits>"
    if t in (list, tuple, dict):
        if depth >= 8:
            return "[...]" if t is list else "(...)" if t is tuple else "{...}"
        items = list(itertools.islice(value.items() if t is dict else value, 20))
        parts = [f"{_safe_repr(k, depth + 1)}: {_safe_repr(v, depth + 1)}" for k, v in items] \
            if t is dict else [_safe_repr(v, depth + 1) for v in items]
        if len(value) > 20:
            parts.append("...")
        text = ", ".join(parts)
        return f"[{text}]" if t is list else f"{{{text}}}" if t is dict else \
            f"({text},)" if len(value) == 1 else f"({text})"
    try:
        return repr(value)
    except (ValueError, RecursionError) as exc:
        return f"<{t.__name__} that cannot be displayed: {exc}>"


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


def _open(url: str):
    from cloudckpt.runtime import shared_store

    return shared_store(url, None)  # closed at exit


def _has_manifest(store) -> bool:
    from cloudckpt.runtime import run_coroutine

    try:
        run_coroutine(store.head(MANIFEST_KEY))
        return True
    except ObjectNotFound:
        return False


def _resolve_checkpoint(url: str, step: int | None) -> str:
    """The checkpoint URL meant by ``url`` / ``--step`` (newest complete of a run by default)."""
    from cloudckpt.manager import CheckpointManager, join_url, step_dir

    if step is not None:
        return join_url(url, step_dir(step))
    if _has_manifest(_open(url)):
        return url
    latest = CheckpointManager(url).latest()
    if latest is None:
        raise CheckpointNotFound(f"no complete checkpoint at {url} (nor a run with one)")
    print(f"using the newest complete checkpoint: step {latest.step} ({latest.url})",
          file=sys.stderr)
    return latest.url


# -- commands -----------------------------------------------------------------------------------


def cmd_ls(args) -> int:
    from cloudckpt.manager import CheckpointManager

    mgr = CheckpointManager(args.url)
    infos = mgr.list()
    with _progress(sum(i.complete for i in infos), "reading manifests") as bar:
        infos = mgr.list(details=True, progress=bar.update) if infos else infos
    if not infos:
        print(f"no checkpoints under {args.url}", file=sys.stderr)
        return EXIT_OK
    rows = [(i.step, _fmt_time(i.created_at), _human_bytes(i.total_bytes),
             "-" if i.objects is None else i.objects,
             "-" if i.world_size is None else i.world_size, "yes" if i.complete else "NO")
            for i in infos]
    _table(("step", "time", "size", "objects", "world_size", "complete"), rows)
    return EXIT_OK


def _value_summary(value: Any, limit: int = 60) -> str:
    text = _safe_repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _metadata_text(metadata: dict) -> str:
    try:
        return json.dumps(metadata, default=_safe_repr, sort_keys=True)
    except (TypeError, ValueError, RecursionError):  # keys json cannot hold, huge ints
        return _value_summary(metadata, 200)


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
        manifest = cloudckpt.read_manifest(url, allow_pickle=True)
    else:
        manifest, pickled = decode_manifest_without_pickle(_manifest_bytes(url))
    created = getattr(manifest, "created_at", None)
    when = _fmt_epoch(created) if created else "-"
    print(f"checkpoint  {url}")
    print(f"created     {when}   world size {manifest.world_size}   "
          f"cloudckpt {manifest.cloudckpt_version}")
    print(f"data        {plural(len(manifest.objects), 'object')}, "
          f"{_human_bytes(manifest.total_bytes())}")
    if manifest.metadata:
        print(f"metadata    {_metadata_text(manifest.metadata)}")
    print(f"\ntensors ({len(manifest.tensors)})")
    rows = []
    for name, rec in sorted(manifest.tensors.items()):
        rows.append((name, rec.dtype, str(tuple(rec.shape)), len(rec.chunks),
                     int(rec.chunks.byte_length.sum())))
    _table(("name", "dtype", "shape", "chunks", "bytes"), rows)
    print(f"\nvalues ({len(manifest.values)})")
    rows = [(name, "pickled", "(not unpickled; use --allow-pickle)") if name in pickled
            else (name, type(v).__name__, _value_summary(v))
            for name, v in sorted(manifest.values.items())]
    _table(("name", "type", "value"), rows)
    return EXIT_OK


def cmd_verify(args) -> int:
    import cloudckpt

    url = _resolve_checkpoint(args.url, args.step)
    total = None
    if sys.stderr.isatty():
        from cloudckpt.manager import decode_manifest_without_pickle

        total = decode_manifest_without_pickle(_manifest_bytes(url))[0].total_bytes()
    with _progress(total, "verifying", unit="B") as bar:
        report = cloudckpt.verify(url, progress=bar.update)
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
    from cloudckpt.manager import CheckpointManager

    mgr = CheckpointManager(args.url, keep_last=args.keep_last, keep_every=args.keep_every,
                            abandoned_after=args.abandoned_after)
    with _progress(None, "deleting") as bar:
        removed = mgr.prune_plans(dry_run=args.dry_run, progress=bar.update)
    verb = "would remove" if args.dry_run else "removed"
    if not removed:
        print("nothing to remove")
    for info, plan in removed:
        state = "complete" if info.complete else "abandoned"
        counts = f"{plural(len(plan.objects), 'object')}, {plural(len(plan.uploads), 'upload')}"
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
    from cloudckpt.manager import CheckpointManager, join_url, step_dir
    from cloudckpt.run_cleanup import delete_checkpoint, plan_checkpoint
    from cloudckpt.runtime import run_coroutine

    located = (args.url, args.step) if args.step is not None else _step_of_url(args.url)
    if located is not None:
        mgr, step = CheckpointManager(located[0]), located[1]
        url, base = join_url(mgr.url, step_dir(step)), mgr.url
        plan = mgr.plan_delete(step)  # refuses a step folder that leads out of the run

        def delete(progress) -> int:
            return mgr.delete(step, progress=progress)
    else:
        url = base = args.url
        store, plan = _open(url), None

        def delete(progress) -> int:
            return run_coroutine(delete_checkpoint(store, "", progress=progress))
    # a run is refused; a step of a run that owns something is a checkpoint whatever it holds
    if (plan.empty if plan is not None else not _has_manifest(store)):
        others = CheckpointManager(url).list()
        if others:
            raise UsageError(f"{url} is a run with {plural(len(others), 'checkpoint')}, not a "
                             "checkpoint; give one checkpoint URL or --step N")
    if plan is None:
        plan = run_coroutine(plan_checkpoint(store, ""))
    if plan.empty and plan.left:
        raise UsageError(f"{url} is neither a checkpoint nor a run ({plural(plan.left, 'key')} "
                         "there, none part of a checkpoint); nothing removed")
    if plan.empty:
        print(f"nothing to remove at {url}", file=sys.stderr)
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
    print(f"removed {url} ({state}{plural(removed, 'object')}, "
          f"{plural(len(plan.uploads), 'upload')})")
    _left_note(url, plan, "left")
    return EXIT_OK


def cmd_export(args) -> int:
    """Write one consolidated file; see :mod:`cloudckpt.export` for how OUT is written (a fresh,
    exclusively created temporary file renamed onto OUT; nothing left behind on failure)."""
    from cloudckpt.export import export, export_kind

    out = args.out
    if export_kind(out) is None:
        raise UsageError(f"OUT must end with .safetensors or .pt, got {out!r}")
    url = _resolve_checkpoint(args.url, args.step)
    skipped = export(url, out, allow_pickle=args.allow_pickle)
    if skipped:
        print(f"warning: {plural(len(skipped), 'non-tensor value')} not representable in "
              f"JSON {'was' if len(skipped) == 1 else 'were'} "
              f"left out: {', '.join(skipped[:5])}", file=sys.stderr)
    print(f"exported {url} -> {out}")
    return EXIT_OK


# -- entry point --------------------------------------------------------------------------------


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cloudckpt", description="Inspect and manage cloudckpt "
                                "checkpoints in S3-compatible object stores or local paths.")
    p.add_argument("--timeout", type=_positive_seconds, default=None, metavar="SECONDS",
                   help="give up on an endpoint that does not answer after about SECONDS "
                        "(default: about 60; StorageOptions.with_timeout)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn, help_: str, *, run_only: bool = False):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("url", metavar="RUN_URL" if run_only else "URL")
        if not run_only:
            sp.add_argument("--step", type=_non_negative_int, default=None,
                            help="a step of the run at URL")
        sp.set_defaults(fn=fn)
        return sp

    add("ls", cmd_ls, "list the checkpoints of a run", run_only=True)
    sp = add("show", cmd_show, "show a checkpoint's tensors and values")
    sp.add_argument("--allow-pickle", action="store_true", help="decode pickled values")
    add("verify", cmd_verify, "read every object of a checkpoint and check every checksum")
    sp = add("prune", cmd_prune, "apply a retention policy to a run", run_only=True)
    sp.add_argument("--keep-last", type=_non_negative_int, required=True, metavar="N")
    sp.add_argument("--keep-every", type=_positive_int, default=None, metavar="K")
    sp.add_argument("--abandoned-after", type=float, default=3600.0, metavar="SECONDS",
                    help="age after which an incomplete checkpoint is abandoned (default 3600)")
    sp.add_argument("--dry-run", action="store_true", help="say what would be removed")
    sp = add("rm", cmd_rm, "delete one checkpoint (manifest first, then its objects)")
    sp.add_argument("--dry-run", action="store_true",
                    help="list every object and upload that would be removed")
    sp = add("export", cmd_export, "write a checkpoint as one .safetensors or .pt file")
    sp.add_argument("out", metavar="OUT")
    sp.add_argument("--allow-pickle", action="store_true", help="decode pickled values")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns (and, as a console script, exits with) the status."""
    args = build_parser().parse_args(argv)
    debug = bool(os.environ.get("CLOUDCKPT_DEBUG"))
    try:
        from cloudckpt.storage import parse_store_url

        parse_store_url(args.url)  # a malformed URL is a usage error before anything runs
        if args.timeout is not None:
            from cloudckpt.runtime import set_default_storage
            from cloudckpt.storage import StorageOptions

            set_default_storage(StorageOptions().with_timeout(args.timeout))
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
        print(f"cloudckpt {args.command}: {kind}: {exc}", file=sys.stderr)
        return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
