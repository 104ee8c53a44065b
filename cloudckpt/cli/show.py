"""``cloudckpt show``: a checkpoint's header, tensors, values and, for an incremental checkpoint,
its base and the objects of other checkpoints it uses; as text, or as the ``--json`` document
of :mod:`cloudckpt.cli.documents`. Pickled values are not unpickled without ``--allow-pickle``."""

from __future__ import annotations

import itertools
import json
from datetime import datetime
from typing import Any

from cloudckpt.cli import documents
from cloudckpt.cli.format import human_bytes, local_time, referenced_objects, table
from cloudckpt.cli.options import EXIT_OK
from cloudckpt.cli.store import CommandStorage
from cloudckpt.cli.urls import resolve_checkpoint
from cloudckpt.wording import plural


def cmd_show(args: Any, storage: CommandStorage) -> int:
    from cloudckpt.api.load import read_manifest
    from cloudckpt.stored import decode_manifest_without_pickle, read_manifest_bytes

    url = resolve_checkpoint(storage, args.url, args.step, "show")
    pickled: tuple[str, ...] = ()
    if args.allow_pickle:
        manifest = read_manifest(url, allow_pickle=True, storage=storage.options)
    else:
        manifest, pickled = decode_manifest_without_pickle(
            read_manifest_bytes(url, store=storage.open(url))
        )
    if args.json:
        documents.emit(documents.show_document(url, manifest, pickled))
    else:
        print_show(url, manifest, pickled)
    return EXIT_OK


def _fmt_epoch(seconds: float) -> str:
    """A manifest's creation time (unix seconds), or the number itself when it is no time."""
    try:
        return local_time(datetime.fromtimestamp(seconds).astimezone())
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
        parts = (
            [f"{_safe_repr(k, depth + 1)}: {_safe_repr(v, depth + 1)}" for k, v in items]
            if t is dict
            else [_safe_repr(v, depth + 1) for v in items]
        )
        if len(value) > 20:
            parts.append("...")
        text = ", ".join(parts)
        return (
            f"[{text}]"
            if t is list
            else f"{{{text}}}"
            if t is dict
            else f"({text},)"
            if len(value) == 1
            else f"({text})"
        )
    try:
        return repr(value)
    except (ValueError, RecursionError) as exc:
        return f"<{t.__name__} that cannot be displayed: {exc}>"


def _value_summary(value: Any, limit: int = 60) -> str:
    text = _safe_repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _metadata_text(metadata: dict) -> str:
    try:
        return json.dumps(metadata, default=_safe_repr, sort_keys=True)
    except (TypeError, ValueError, RecursionError):  # keys json cannot hold, huge ints
        return _value_summary(metadata, 200)


def print_show(url: str, manifest: Any, pickled: tuple[str, ...]) -> None:
    """The text of ``cloudckpt show`` for ``manifest`` (``pickled``: the names of values not
    unpickled)."""
    created = getattr(manifest, "created_at", None)
    when = _fmt_epoch(created) if created else "-"
    print(f"checkpoint  {url}")
    print(
        f"created     {when}   world size {manifest.world_size}   "
        f"cloudckpt {manifest.cloudckpt_version}"
    )
    print(
        f"data        {plural(len(manifest.objects), 'object')}, "
        f"{human_bytes(manifest.total_bytes())}"
    )
    if getattr(manifest, "base", ""):
        print(f"base        {manifest.base} (saved incrementally against it)")
    if manifest.metadata:
        print(f"metadata    {_metadata_text(manifest.metadata)}")
    print(f"\ntensors ({len(manifest.tensors)})")
    rows: list[tuple[Any, ...]] = []
    for name, rec in sorted(manifest.tensors.items()):
        rows.append(
            (
                name,
                rec.dtype,
                str(tuple(rec.shape)),
                len(rec.chunks),
                int(rec.chunks.byte_length.sum()),
            )
        )
    table(("name", "dtype", "shape", "chunks", "bytes"), rows)
    print(f"\nvalues ({len(manifest.values)})")
    rows = [
        (name, "pickled", "(not unpickled; use --allow-pickle)")
        if name in pickled
        else (name, type(v).__name__, _value_summary(v))
        for name, v in sorted(manifest.values.items())
    ]
    table(("name", "type", "value"), rows)
    shared = referenced_objects(manifest) if getattr(manifest, "references", False) else []
    if shared:
        print(
            f"\nobjects of other checkpoints it uses ({len(shared)}, "
            f"{human_bytes(sum(n for _, _, n in shared))})"
        )
        table(("folder", "object", "bytes used"), shared)
