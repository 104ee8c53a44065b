"""``cloudckpt.load_safetensors``: fill a state dict from a Hugging Face safetensors checkpoint.

The checkpoint is described as an in-memory cloudckpt manifest (:mod:`cloudckpt.hf.catalog`)
and read by cloudckpt's own load (:func:`cloudckpt.api.load.load_from`): the same phases,
planning, coalesced ranged reads, read-once broadcasts, resharding and fail-together errors
as :func:`cloudckpt.load`. Only the manifest differs: the coordinator reads the folder's
listing, index and headers (:mod:`cloudckpt.hf.source`) and broadcasts them; every rank parses
the same bytes into the same manifest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cloudckpt.api.load import load_from
from cloudckpt.hf.catalog import KeyMap, expected_files, manifest_of_bundle
from cloudckpt.hf.source import read_header_bundle
from cloudckpt.hf.whole import VerifyingStore
from cloudckpt.manifest.model import Manifest
from cloudckpt.options import LoadOptions, LoadResult
from cloudckpt.runtime.loop import run_coroutine


@dataclass(frozen=True)
class SafetensorsSource:
    """The :class:`~cloudckpt.api.load.ManifestSource` of a safetensors folder."""

    url: str
    storage: Any = None
    key_map: KeyMap = None

    def read(self, store) -> bytes:
        return run_coroutine(read_header_bundle(store, self.url))

    def decode(self, raw: bytes) -> Manifest:
        return manifest_of_bundle(raw, self.key_map)

    def check(self, manifest: Manifest, store) -> None:
        """Nothing more to check: every tensor's bytes were checked to lie inside its file,
        whose size the listing gave."""

    def data_store(self, store, raw: bytes):
        """``store``, checking the files whose store holds a whole-file checksum as they are
        read whole (:mod:`cloudckpt.hf.whole`)."""
        expected = expected_files(raw)
        return VerifyingStore(store, expected) if expected else store


def load_safetensors(
    state_dict: Mapping[str, Any],
    src: str,
    *,
    key_map: KeyMap = None,
    process_group=None,
    storage=None,
    strict: bool = True,
    options: LoadOptions | None = None,
) -> LoadResult:
    """Fill ``state_dict`` in place from the safetensors checkpoint at ``src``. Collective.

    ``src``: a local folder or an ``s3://`` prefix holding ``*.safetensors`` files, with or
    without ``model.safetensors.index.json`` (see :mod:`cloudckpt.hf.source` for which files
    are read). Every rank calls this with its own state dict: plain tensors, DTensors (FSDP2,
    tensor parallel), :class:`cloudckpt.GlobalPiece`, any world size. Each rank reads only the
    byte ranges of the slices it holds; a region several ranks need is read once and broadcast
    (``LoadOptions.broadcast``, as for :func:`cloudckpt.load`).

    ``key_map`` turns the checkpoint's names into the state dict's: a dict renames the names
    it lists (others are kept), a callable maps every name (``None``: not loaded). It must give
    the same answer on every rank.

    - A tensor of the state dict that the checkpoint lacks raises :class:`MissingKeysError` on
      every rank (``strict=False``: left as it is); checkpoint tensors the state dict does not
      ask for are listed in ``LoadResult.unexpected_keys``.
    - dtype: a stored dtype other than the destination's is cast like ``Tensor.to`` (as
      ``from_pretrained(torch_dtype=...)`` does); a shape other than the stored one raises
      :class:`ShapeMismatchError`.
    - Safetensors stores no checksums. Where the store holds one of a whole file (S3's
      full-object CRC32C, the MD5 ETag of a single-part upload) and this load reads all of that
      file's data on one rank, the file is checked: a mismatch raises :class:`ChecksumError` on
      every rank (:mod:`cloudckpt.hf.whole`). Other bytes read are not verified (a cloudckpt
      checkpoint's always are). A malformed or hostile header or index raises
      :class:`SafetensorsError` on every rank before any data is read; no files raises
      :class:`CheckpointNotFound`.
    """
    return load_from(
        state_dict,
        SafetensorsSource(src, storage, key_map),
        process_group=process_group,
        strict=strict,
        options=options,
    )
