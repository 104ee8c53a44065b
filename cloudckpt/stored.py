"""A stored checkpoint read back: the one way to fetch, decode for inspection and read it.

No torch, no collective. Every reader of a stored manifest (``load``, ``verify``, incremental
saves, the manager's listings, clean-up, the command line, the exports) goes through
:func:`fetch_manifest_bytes`, so each gets the same size bound; every reader that inspects a
manifest without trusting its pickled values decodes it with
:func:`decode_manifest_without_pickle`; and every reader of the data opens the checkpoint's
objects through :func:`reading_view`, which knows where an incremental checkpoint's objects are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cloudckpt.errors import (
    CheckpointNotFound,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    PickleNotAllowed,
)
from cloudckpt.layout import MANIFEST_KEY, split_folder
from cloudckpt.manifest.codec import MAX_MANIFEST_BYTES, manifest_from_document, read_document
from cloudckpt.manifest.model import Manifest
from cloudckpt.manifest.values import encode_value, is_pickled
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.storage.base import ObjectStore


async def fetch_manifest_bytes(
    store: ObjectStore, key: str = MANIFEST_KEY, *, max_bytes: int = MAX_MANIFEST_BYTES
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


def read_manifest_bytes(
    url: str, storage: Any = None, *, store: ObjectStore | None = None
) -> bytes:
    """:func:`fetch_manifest_bytes` of the checkpoint at ``url``, from a caller that is not a
    coroutine. ``store``: ``url``'s store when the caller has it open (else the shared store of
    ``url`` and ``storage``). No manifest raises :class:`~cloudckpt.errors.CheckpointNotFound`."""
    if store is None:
        store = shared_store(url, storage)
    return run_coroutine(fetch_checkpoint_manifest(url, store))


async def fetch_checkpoint_manifest(url: str, store: ObjectStore) -> bytes:
    """:func:`read_manifest_bytes` as a coroutine (on cloudckpt's loop, where ``store`` lives):
    the manifest of the checkpoint at ``url``, whose store is ``store``."""
    try:
        return await fetch_manifest_bytes(store, MANIFEST_KEY)
    except ObjectNotFound as exc:
        raise CheckpointNotFound(f"no committed checkpoint at {url} (no manifest: {exc})") from exc


def decode_manifest_without_pickle(raw: bytes) -> tuple[Manifest, tuple[str, ...]]:
    """Decode and validate manifest bytes without ever unpickling: returns the ``Manifest`` (each
    pickled value replaced by ``None``) and the sorted names of the pickled values. The one
    decode for listings and inspection, where the values themselves are not needed. Anything
    malformed (pickle outside the values included) raises ``ManifestError``."""
    document = read_document(raw)
    try:
        return manifest_from_document(document, allow_pickle=False), ()
    except PickleNotAllowed as exc:
        refused = exc
    values = document.fields.get("values")
    if type(values) is not dict:
        raise refused
    values, pickled = dict(values), []
    for name, blob in values.items():
        if type(name) is str and type(blob) is bytes and is_pickled(blob, key=name):
            values[name] = encode_value(None, key=name, allow_pickle=False)
            pickled.append(name)
    if not pickled:  # the pickle is elsewhere (metadata, structure): refused as it is
        raise refused
    fields = {**document.fields, "values": values}
    manifest = manifest_from_document(replace(document, fields=fields), allow_pickle=False)
    return manifest, tuple(sorted(pickled))


def reading_view(
    url: str,
    storage: Any,
    manifest: Manifest,
    *,
    store: ObjectStore | None = None,
) -> tuple[ObjectStore, Manifest]:
    """``(store, manifest)`` to read the checkpoint at ``url`` with.

    Without references: the checkpoint's own store (``store`` when the caller has it open) and
    ``manifest`` itself. When it references sibling folders: the run root's store (the folder
    above ``url``) and ``manifest`` with every key made relative to it (``<folder>/<key>``; each
    home is one validated path segment, so no key leaves the run root); ``ManifestError`` when
    ``url`` has no folder above it to hold the siblings. Stores not given are cloudckpt's
    shared stores (``shared_store(url, storage)``)."""
    if not manifest.references:
        return (store if store is not None else shared_store(url, storage)), manifest
    located = split_folder(url)
    if located is None:
        raise ManifestError(
            f"the checkpoint at {url} refers to objects of sibling checkpoints, "
            "but there is no folder above it to hold them",
            path="homes",
        )
    run_url, folder = located
    keys = [f"{home or folder}/{key}" for home, key in zip(manifest.object_homes, manifest.objects)]
    return shared_store(run_url, storage), manifest.with_object_keys(keys)
