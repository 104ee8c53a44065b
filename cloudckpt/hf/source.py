"""Reading a safetensors checkpoint's description from a store: which files, and their headers.

No torch, no collective. :func:`read_header_bundle` is what a load's coordinator runs (inside
the ``load manifest`` phase, so a failure fails every rank together): one listing of the
folder, the index when there is one, then for every file its 8-byte length prefix and its
header (two small ranged reads, files concurrently) and the checksum the store holds of the
whole file, if any (:meth:`~cloudckpt.storage.base.ObjectStore.whole_checksum`: one HEAD per
file on S3, kept when its size is the listing's; :mod:`cloudckpt.hf.whole` checks it). Data
bytes are never read here.

Which files (the folder's top level only):

- ``model.safetensors.index.json`` when present, else the one ``*.safetensors.index.json``:
  the files its ``weight_map`` names (each must be there); other ``.safetensors`` files are
  ignored (a repository may hold a second copy of the weights under other names);
- without an index, every ``*.safetensors`` file;
- several indexes and none named ``model.safetensors.index.json``: refused (ambiguous);
- no file at all: :class:`~cloudckpt.errors.CheckpointNotFound`.
"""

from __future__ import annotations

import asyncio

from cloudckpt.errors import CheckpointNotFound, SafetensorsError
from cloudckpt.hf.catalog import MAX_INDEX_BYTES, encode_bundle, parse_index
from cloudckpt.hf.header import MAX_HEADER_BYTES, PREFIX_BYTES, header_length
from cloudckpt.storage.base import ObjectInfo, ReadRange
from cloudckpt.wording import plural

SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_INDEX = "model" + INDEX_SUFFIX
#: most header bytes one load reads, all files together (each one is bounded too).
MAX_TOTAL_HEADER_BYTES = 4 * MAX_HEADER_BYTES
#: header reads in flight at once.
_CONCURRENT_FILES = 16


async def list_top_level(store) -> dict[str, int]:
    """Key -> size of the objects at the top level of ``store`` (one delimited listing)."""
    return {
        item.key: item.size
        async for item in store.list("", delimiter="/")
        if isinstance(item, ObjectInfo)
    }


def choose_index(keys) -> str | None:
    """The index to use among ``keys`` (module doc), None when there is none."""
    indexes = sorted(k for k in keys if k.endswith(INDEX_SUFFIX))
    if DEFAULT_INDEX in indexes:
        return DEFAULT_INDEX
    if len(indexes) > 1:
        raise SafetensorsError(
            f"several indexes ({', '.join(indexes)}) and none is "
            f"{DEFAULT_INDEX}: point the load at a folder with one"
        )
    return indexes[0] if indexes else None


async def read_prefix(store, key: str, size: int) -> int:
    """The header length of file ``key`` (``size`` bytes), from its 8-byte prefix, checked
    against the file's size (:func:`~cloudckpt.hf.header.header_length`)."""
    (prefix,) = (
        await store.read_ranges(key, [ReadRange(0, PREFIX_BYTES)])
        if size >= PREFIX_BYTES
        else (b"",)
    )
    return header_length(bytes(prefix), file_size=size, key=key)


async def read_header_bundle(store, where: str) -> bytes:
    """The header bundle (:func:`cloudckpt.hf.catalog.encode_bundle`) of the safetensors
    checkpoint at the root of ``store`` (``where``: its URL, for messages). Every prefix is
    read and the header lengths summed (at most :data:`MAX_TOTAL_HEADER_BYTES`) before any
    header is."""
    sizes = await list_top_level(store)
    index_key = choose_index(sizes)
    index = None
    if index_key is not None:
        raw = await store.get(index_key, max_bytes=MAX_INDEX_BYTES)
        weight_map = parse_index(raw, key=index_key)
        keys = sorted(set(weight_map.values()))
        missing = [k for k in keys if k not in sizes]
        if missing:
            raise SafetensorsError(
                f"the index names {plural(len(missing), 'file')} that "
                f"{'is' if len(missing) == 1 else 'are'} not in {where}: "
                f"{', '.join(missing[:5])}",
                path=index_key,
            )
        index = (index_key, raw)
    else:
        keys = sorted(k for k in sizes if k.endswith(SUFFIX))
    if not keys:
        hint = (
            " (files that are symlinks, as in a Hugging Face cache snapshot, are not "
            "followed: copy the files, or download with --local-dir)"
            if store.local_root is not None
            else ""
        )
        raise CheckpointNotFound(f"no *{SUFFIX} files at {where}{hint}")
    slots = asyncio.Semaphore(_CONCURRENT_FILES)

    async def bounded(fn, *args):
        async with slots:
            return await fn(*args)

    lengths = await _all(bounded(read_prefix, store, k, sizes[k]) for k in keys)
    if sum(lengths) > MAX_TOTAL_HEADER_BYTES:
        raise SafetensorsError(
            f"the {len(keys)} headers declare {sum(lengths)} bytes, more "
            f"than the {MAX_TOTAL_HEADER_BYTES} a load reads",
            path=where,
        )
    found = await _all(
        [
            *(
                bounded(store.read_ranges, k, [ReadRange(PREFIX_BYTES, n)])
                for k, n in zip(keys, lengths)
            ),
            *(bounded(store.whole_checksum, k) for k in keys),
        ]
    )
    bodies, sums = found[: len(keys)], found[len(keys) :]
    return encode_bundle(
        [
            (
                k,
                sizes[k],
                b"".join((n.to_bytes(PREFIX_BYTES, "little"), b[0])),
                (c.kind, c.value) if c is not None and c.size == sizes[k] else None,
            )
            for k, n, b, c in zip(keys, lengths, bodies, sums)
        ],
        index,
    )


async def _all(coros) -> list:
    """Run ``coros`` concurrently; on the first failure cancel the others (and wait for them),
    then raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
