"""What a run looks like in a store: where each step's checkpoint lives, and how one listing of the
run root reads. Pure: no I/O, no torch (like Orbax's step-path helpers).

```
<run>/step-<step:012d>/manifest.msgpack          a complete checkpoint (see cloudckpt.layout)
<run>/step-<step:012d>/data/...                  its data objects (or an unfinished save's)
<run>/step-<step:012d>/pins/<attempt>.<folder>     pins of incremental saves that reference it
```

A step with pins and no manifest is *retained*: deleted, but some of its objects stay because
other checkpoints reference them (see :mod:`cloudckpt.run_refs`). It is not a checkpoint.

A step is an ``int >= 0``; its prefix has at least 12 digits, zero-padded, and exactly the digits
:func:`step_dir` writes (``step-0000000000001/`` is not step 1). Anything else under a run root
belongs to someone else and is ignored by listings and never deleted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Iterable

from cloudckpt.layout import DATA_PREFIX, MANIFEST_KEY, PINS_PREFIX

__all__ = ["LIST_DELIMITER", "StepState", "add_uploads", "classify_listing", "join_url",
           "parse_step_dir", "split_folder", "step_dir"]

#: The delimiter of the one listing of a run root: it yields each step's manifest as a key and
#: each step's ``data/`` folder as one common prefix, whatever the number of data objects.
LIST_DELIMITER = "/" + DATA_PREFIX          # "/data/"
_STEP_RE = re.compile(r"^step-(\d{12,})/$")


def step_dir(step: int) -> str:
    """Key prefix of step ``step`` inside a run: ``step-<step:012d>/``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step is an int >= 0, got {step!r}")
    return f"step-{step:012d}/"


def parse_step_dir(prefix: str) -> int | None:
    """The step of a canonical ``step-<digits>/`` prefix, or ``None`` for anything else."""
    m = _STEP_RE.match(prefix)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir(step) == prefix else None


def join_url(base: str, relative: str) -> str:
    """``base`` (a run or checkpoint URL, or a path) joined with a relative key prefix."""
    return base.rstrip("/") + "/" + relative.strip("/")


def split_folder(url: str) -> tuple[str, str] | None:
    """``(run URL, folder)`` of a checkpoint URL: the URL of the folder above it and its own
    last path segment (incremental checkpoints reference objects of *sibling* folders, under
    the run URL). ``None`` when there is no folder above it (a bucket root, a filesystem root,
    a bare relative name) or the last segment is not a folder name a manifest may use. Local
    paths are made absolute and normalised, so two spellings of one run compare equal."""
    from cloudckpt.manifest.lineage import folder_problem
    from cloudckpt.storage.urls import parse_store_url

    parsed = parse_store_url(url)
    if parsed.kind == "s3":
        parts = parsed.prefix.strip("/").split("/") if parsed.prefix else []
        if not parts:
            return None
        run = parsed.bucket_url + "".join("/" + p for p in parts[:-1])
    else:
        path = os.path.normpath(os.path.abspath(parsed.path))
        run, last = os.path.split(path)
        if not last or run == path:
            return None
        parts = [last]
        run = ("file://" + run) if url.startswith("file:") else run
    return None if folder_problem(parts[-1]) else (run, parts[-1])


@dataclass
class StepState:
    """What the listings of a run root say about one step."""

    manifest: Any = None        # ObjectInfo of the manifest when complete
    has_data: bool = False      # a data/ common prefix was listed
    uploads: tuple = ()         # UploadInfo of unfinished multipart uploads (prune only)
    pins: int = 0               # pins listed (other checkpoints reference it)

    @property
    def retained(self) -> bool:
        """Deleted, kept for what other checkpoints reference: no manifest, some pins."""
        return self.manifest is None and self.pins > 0


def classify_listing(items: Iterable[Any]) -> dict[int, StepState]:
    """Group the entries of a ``delimiter="/data/"`` listing of a run root by step.

    Entries are ``ObjectInfo`` (``.key``) or ``CommonPrefix`` (``.prefix``); anything that is not
    ``step-<012d>/manifest.msgpack``, ``step-<012d>/data/`` or ``step-<012d>/pins/<name>`` is
    ignored.
    """
    steps: dict[int, StepState] = {}
    for item in items:
        prefix = getattr(item, "prefix", None)
        if prefix is not None:
            head, sep, rest = prefix.rpartition(LIST_DELIMITER)
            step = parse_step_dir(head + "/") if sep and not rest else None
            if step is not None:
                steps.setdefault(step, StepState()).has_data = True
            continue
        key = item.key
        head, sep, name = key.rpartition("/")
        if name == MANIFEST_KEY:
            step = parse_step_dir(head + sep)
            if step is not None:
                steps.setdefault(step, StepState()).manifest = item
        elif name and head.endswith("/" + PINS_PREFIX.rstrip("/")):
            step = parse_step_dir(head[:-len(PINS_PREFIX) + 1])
            if step is not None:
                steps.setdefault(step, StepState()).pins += 1
    return steps


def add_uploads(steps: dict[int, StepState], uploads: Iterable[Any]) -> dict[int, StepState]:
    """Attach each unfinished upload (``.key`` relative to the run root) to its step in
    ``steps`` (adding the step when it has nothing else); uploads outside any step are ignored.
    Returns ``steps``."""
    for upload in uploads:
        step = parse_step_dir(upload.key.split("/", 1)[0] + "/")
        if step is not None:
            state = steps.setdefault(step, StepState())
            state.uploads = state.uploads + (upload,)
    return steps
