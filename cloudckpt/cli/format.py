"""What the text of ``cloudckpt ls``/``show``/``verify`` and the ``--json`` documents share:
sizes, local times, plain tables, and the objects an incremental checkpoint uses elsewhere."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime
from typing import IO, Any


def human_bytes(n: int | None) -> str:
    """``1.5 MiB`` (binary units, one decimal), ``12 B``; ``-`` for ``None``."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def local_time(value: datetime | None) -> str:
    """``YYYY-MM-DD HH:MM:SS`` in this machine's time zone; ``-`` for ``None``."""
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], out: IO[str] | None = None
) -> None:
    """Print ``rows`` under ``headers`` in left-aligned columns (to stdout by default)."""
    out = out or sys.stdout
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for row in [list(headers)] + cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)


def referenced_objects(manifest: Any) -> list[tuple[str, str, int]]:
    """``(folder, key, bytes used)`` of every object the checkpoint uses in another checkpoint's
    folder (an incremental checkpoint's references), in folder, key order."""
    used = manifest.object_sizes()
    return sorted(
        (home, key, int(used[key]))
        for home, key in zip(manifest.object_homes, manifest.objects)
        if home
    )


def is_step_folder(info: Any) -> bool:
    """Whether a listed checkpoint's folder is the manager's ``step-<012d>`` one."""
    return info.step is not None and info.name == f"step-{info.step:012d}"


def label(info: Any) -> str:
    """How a line names a listed checkpoint: ``step N`` for a ``step-<N>`` folder, else its
    folder's name (:func:`cloudckpt.layout.folder_label`)."""
    from cloudckpt.layout import folder_label

    return folder_label(info.name)
