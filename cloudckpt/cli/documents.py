"""The ``--json`` documents of the ``cloudckpt`` command (``ls``, ``show``, ``verify``, ``prune``).

Contract: with ``--json`` a command writes exactly one JSON document to stdout (and nothing else
there); errors stay one line on stderr with the usual exit status, and stdout is then empty.
The keys below are stable: new keys may be added, none is renamed or removed.

- ``ls``: a list, one object per checkpoint in step order (then commit time):
  ``{"step", "name", "url", "complete", "created_at", "total_bytes", "objects", "world_size"}``
  (``name``: the checkpoint's folder, ``step-000000000100`` or a trainer's name such as ``last``,
  whose ``step`` may be null).
  ``created_at`` is ISO 8601 with its UTC offset, or null (incomplete checkpoints); the three
  counts come from the manifest, null for an incomplete checkpoint. A run with none: ``[]``.
  With ``--details`` also ``"own_bytes", "shared_bytes", "base_step", "retained", "held_by"``:
  retained folders (deleted, kept for pins) are listed then, and ``held_by`` is a list of
  strings, one for each pin in the folder.
- ``show``: ``{"url", "created_at", "world_size", "cloudckpt_version", "objects", "total_bytes",
  "metadata", "tensors", "values"}``; ``tensors`` is a list of ``{"name", "dtype", "shape",
  "chunks", "bytes"}``, ``values`` a list of ``{"name", "type", "value"}`` (``type`` "pickled" and
  ``value`` null for a pickled value not decoded; see ``--allow-pickle``), both sorted by name.
- ``verify``: ``{"url", "ok", "objects_checked", "bytes_checked", "problems", "notes"}``
  (``problems`` and ``notes`` are lists of strings). Exit status 1 when not ``ok``, as without
  ``--json``.
- ``prune``: ``{"dry_run", "removed"}``; ``removed`` is a list of ``{"step", "name", "url",
  "complete", "objects", "uploads", "left"}`` where ``objects`` lists the URLs of the objects
  removed (or that would be), ``uploads`` the unfinished uploads as ``{"key", "upload_id"}``
  (key: a URL) and ``left`` counts the keys under the checkpoint that are not part of it and stay.

Values that JSON cannot represent (bytes, tensors of a value, ints beyond 64 bits, non-finite
floats, objects, non-string keys of a mapping) are rendered as their ``repr`` string; metadata
and values are otherwise their JSON selves (tuples become lists).
"""

from __future__ import annotations

import json
import math
import sys
from datetime import datetime, timezone
from typing import Any

from cloudckpt.cli.format import referenced_objects

_MAX_DEPTH = 32
_INT_LIMIT = 1 << 63


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a hostile value's repr may raise anything
        return f"<{type(value).__name__} that cannot be displayed: {type(exc).__name__}>"
    return text if len(text) <= 10_000 else text[:9_997] + "..."


def jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON data: JSON's own types kept, tuples as lists, anything else (and
    anything nested deeper than 32 levels) as its ``repr`` string."""
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if -_INT_LIMIT <= value < _INT_LIMIT else _safe_repr_int(value)
    if t is float:
        return value if math.isfinite(value) else repr(value)
    if depth >= _MAX_DEPTH:
        return _safe_repr(value)
    if t in (list, tuple):
        return [jsonable(v, depth + 1) for v in value]
    if t is dict:
        if all(type(k) is str for k in value):
            return {k: jsonable(v, depth + 1) for k, v in value.items()}
        return _safe_repr(value)
    return _safe_repr(value)


def _safe_repr_int(value: int) -> str:
    bits = value.bit_length()
    return repr(value) if bits <= 256 else f"<int of {bits} bits>"


def iso_time(value: datetime | float | None) -> str | None:
    """ISO 8601 with the UTC offset; a manifest's unix seconds too; None (or no valid time)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    try:
        return datetime.fromtimestamp(value, tz=timezone.utc).isoformat()
    except (OverflowError, OSError, ValueError, TypeError):
        return None


def emit(document: Any) -> None:
    """Write ``document`` to stdout as one JSON document (sorted keys, one trailing newline)."""
    sys.stdout.write(json.dumps(document, sort_keys=True, allow_nan=False) + "\n")


def ls_document(infos, details: bool = False) -> list[dict]:
    """``details``: also each checkpoint's own and shared bytes, its base step, whether it is
    a retained folder and what holds it (``ls --details``)."""
    extra = (
        (
            lambda i: {
                "own_bytes": i.own_bytes,
                "shared_bytes": i.shared_bytes,
                "base_step": i.base_step,
                "retained": bool(i.retained),
                "held_by": list(i.held_by),
            }
        )
        if details
        else (lambda i: {})
    )
    return [
        {
            "step": i.step,
            "name": i.name,
            "url": i.url,
            "complete": bool(i.complete),
            "created_at": iso_time(i.created_at),
            "total_bytes": i.total_bytes,
            "objects": i.objects,
            "world_size": i.world_size,
            "damaged": i.damaged,
            **extra(i),
        }
        for i in infos
    ]


def show_document(url: str, manifest, pickled) -> dict:
    tensors = []
    for name, rec in sorted(manifest.tensors.items()):
        tensors.append(
            {
                "name": name,
                "dtype": str(rec.dtype),
                "shape": [int(d) for d in rec.shape],
                "chunks": len(rec.chunks),
                "bytes": _chunk_bytes(rec.chunks),
            }
        )
    values = [
        {"name": name, "type": "pickled", "value": None}
        if name in pickled
        else {"name": name, "type": type(v).__name__, "value": jsonable(v)}
        for name, v in sorted(manifest.values.items())
    ]
    return {
        "url": url,
        "created_at": iso_time(getattr(manifest, "created_at", None) or None),
        "world_size": jsonable(manifest.world_size),
        "cloudckpt_version": jsonable(manifest.cloudckpt_version),
        "objects": len(manifest.objects),
        "total_bytes": int(manifest.total_bytes()),
        "metadata": jsonable(manifest.metadata or {}),
        "tensors": tensors,
        "values": values,
        **_references(manifest),
    }


def _references(manifest) -> dict:
    """An incremental checkpoint's base and the objects of other checkpoints it uses."""
    if not getattr(manifest, "base", "") and not getattr(manifest, "references", False):
        return {}
    return {
        "base": manifest.base or None,
        "references": [
            {"folder": f, "object": k, "bytes": n} for f, k, n in referenced_objects(manifest)
        ],
    }


def _chunk_bytes(chunks) -> int:
    column = getattr(chunks, "byte_length", None)  # a columnar chunk table
    if column is not None:
        return int(column.sum())
    return sum(int(c.byte_length) for c in chunks)


def verify_document(url: str, report) -> dict:
    return {
        "url": url,
        "ok": bool(report.ok),
        "objects_checked": report.objects_checked,
        "bytes_checked": report.bytes_checked,
        "problems": [str(p) for p in report.problems],
        "notes": [str(n) for n in getattr(report, "notes", ())],
    }


def prune_document(run_url: str, removed, dry_run: bool) -> dict:
    base = run_url.rstrip("/")
    return {
        "dry_run": bool(dry_run),
        "removed": [
            {
                "step": info.step,
                "name": info.name,
                "url": info.url,
                "complete": bool(info.complete),
                "objects": [f"{base}/{key}" for key in plan.objects],
                "uploads": [
                    {"key": f"{base}/{u.key}", "upload_id": u.upload_id} for u in plan.uploads
                ],
                "left": plan.left,
            }
            for info, plan in removed
        ],
    }
