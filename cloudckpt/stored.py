"""Reading a checkpoint's stored manifest bytes, their size bounded before anything is read.

No torch, no collective: used by ``load``, ``verify``, the manager's listings and clean-up and
the command line alike, so that every reader of a manifest gets the same bound.
"""

from __future__ import annotations

from cloudckpt.errors import ManifestError, ObjectTooLarge
from cloudckpt.layout import MANIFEST_KEY, split_folder
from cloudckpt.manifest.codec import MAX_MANIFEST_BYTES
from cloudckpt.runtime.loop import shared_store


async def fetch_manifest_bytes(
    store, key: str = MANIFEST_KEY, *, max_bytes: int = MAX_MANIFEST_BYTES
) -> bytes:
    """The stored bytes of the manifest at ``key`` in ``store`` (not decoded, not checked).

    A manifest larger than ``max_bytes`` is refused with a
    :class:`~cloudckpt.errors.ManifestError` before its body is read (a LocalStore checks the
    file's size first; S3 the size in the first answer's headers). No manifest raises
    :class:`~cloudckpt.errors.ObjectNotFound`; so does, on a LocalStore, a manifest that is not
    a regular file (a FIFO, a directory: never opened for a blocking read).
    """
    try:
        return await store.get(key, max_bytes=max_bytes)
    except ObjectTooLarge as exc:
        raise ManifestError(
            f"manifest {key} is {exc.size} bytes, more than the {max_bytes} a "
            f"manifest may have (refused without reading it)"
        ) from exc


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
        raise ManifestError(
            f"the checkpoint at {url} refers to objects of sibling checkpoints, "
            "but there is no folder above it to hold them",
            path="homes",
        )
    run_url, folder = located
    keys = [f"{home or folder}/{key}" for home, key in zip(manifest.object_homes, manifest.objects)]
    return open_store(run_url, storage), manifest.with_object_keys(keys)
