"""Where a checkpoint's objects are read from: its own root, or its run's when it references
objects of sibling checkpoints (an incremental checkpoint, format version 3).

Every reader (``load``, ``load_full``, ``verify``, and through them export and conversion)
opens its store here, so a referencing checkpoint reads exactly like a full one.
"""

from __future__ import annotations

from cloudckpt.errors import ManifestError
from cloudckpt.run_layout import split_folder
from cloudckpt.runtime import shared_store


def reading_view(url: str, storage, manifest, *, open_store=shared_store):
    """``(store, manifest)`` to read the checkpoint at ``url`` with: the checkpoint's own store
    and ``manifest`` itself, or, when it references sibling folders, the run root's store (the
    folder above ``url``) and ``manifest`` with every key made relative to it
    (``<folder>/<key>``; each home is one validated path segment, so no key leaves the run
    root). ``ManifestError`` when ``url`` has no folder above it to hold the siblings. Stores
    come from ``open_store(url, storage)`` (cloudckpt's shared stores by default)."""
    if not manifest.references:
        return open_store(url, storage), manifest
    located = split_folder(url)
    if located is None:
        raise ManifestError(f"the checkpoint at {url} refers to objects of sibling checkpoints, "
                            "but there is no folder above it to hold them", path="homes")
    run_url, folder = located
    keys = [f"{home or folder}/{key}" for home, key in zip(manifest.object_homes, manifest.objects)]
    return open_store(run_url, storage), manifest.with_object_keys(keys)
