"""A safetensors checkpoint as a cloudckpt manifest, so the whole load pipeline reads it. Pure.

A sharded checkpoint comes with an index, ``model.safetensors.index.json``: ``{"weight_map":
{tensor: file}, ...}`` (:func:`parse_index`: untrusted bytes, every file a safe relative key).
Each file's header is parsed by :func:`cloudckpt.hf.header.parse_header`, the one safetensors
parser; :func:`locate_tensors` puts the files' tensors together (a name in two files, or an
index naming a tensor its file lacks, is refused). Every failure is a
:class:`~cloudckpt.errors.SafetensorsError` whose ``path`` names the file and the entry.

What the coordinator read (:mod:`cloudckpt.hf.source`) travels between ranks as a *header
bundle* (msgpack: the index's bytes, each file's key, size and header bytes, length prefix
included, and the checksum the store holds of the whole file, if any); every rank turns the same
bundle into the same :class:`~cloudckpt.manifest.Manifest` (:func:`manifest_of_bundle`) and the
same expected whole-file checksums (:func:`expected_files`), in which

- each file is one data object (its key relative to the checkpoint folder);
- each tensor is one chunk covering the whole tensor, at ``8 + header length + start`` of its
  file;
- there are no checksums (``Manifest(checksums=False)``: safetensors stores none), so its reads
  are not verified by the manifest (only, where the store holds one, by the whole file's
  checksum: :mod:`cloudckpt.hf.whole`); such a manifest can never be stored (the codec refuses
  it).

Tensor names are the state dict's: the checkpoint's names through ``key_map``
(:func:`map_names`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import msgpack

from cloudckpt.errors import ConfigError, DuplicateKeyError, SafetensorsError
from cloudckpt.hf.header import Header, TensorEntry, load_json, parse_header
from cloudckpt.hf.whole import ExpectedFile
from cloudckpt.manifest.model import Manifest
from cloudckpt.manifest.validation import validate_object_key
from cloudckpt.version import __version__

#: a dict (listed names renamed, others kept) or a callable (name -> new name, None drops it).
KeyMap = Mapping[str, str] | Callable[[str], str | None] | None

BUNDLE_FORMAT = "cloudckpt.safetensors_headers"
#: the largest index file accepted.
MAX_INDEX_BYTES = 64 << 20


def _where(key: str, entry: str | None = None) -> str:
    """The error ``path``: the file's key and the entry (JSON-quoted, shortened)."""
    return f"{key}: {json.dumps(entry[:80])}" if entry is not None else key


def parse_index(raw: bytes, *, key: str) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> file key) of an index file ``key``; every file key is
    a safe relative key (no ``..``, not absolute: see
    :func:`~cloudckpt.manifest.validate_object_key`)."""
    if len(raw) > MAX_INDEX_BYTES:
        raise SafetensorsError(
            f"{len(raw)} bytes is more than the {MAX_INDEX_BYTES} an index may have", path=key
        )
    doc = load_json(raw, path=key)
    weight_map = doc.get("weight_map") if type(doc) is dict else None
    if type(weight_map) is not dict:
        raise SafetensorsError('an index must be an object with a "weight_map" object', path=key)
    for name, file in weight_map.items():
        why = validate_object_key(file) if type(file) is str else "a file name must be a string"
        if why:
            raise SafetensorsError(why, path=_where(key, name))
    return weight_map


def locate_tensors(
    files: Mapping[str, Header], weight_map: Mapping[str, str] | None = None
) -> dict[str, tuple[int, TensorEntry]]:
    """Every tensor of ``files`` (file key -> its header): name -> (position of its file,
    tensor), in file then data order. A name in two files is refused; with an index, every name
    it maps must be in the header of the file it names."""
    keys = list(files)
    found: dict[str, tuple[int, TensorEntry]] = {}
    for i, (key, header) in enumerate(files.items()):
        for t in header.tensors:
            if t.name in found:
                other = keys[found[t.name][0]]
                raise SafetensorsError(
                    f"tensor {json.dumps(t.name)} is in two files, {other} and {key}",
                    path=_where(key, t.name),
                )
            found[t.name] = (i, t)
    for name, file in (weight_map or {}).items():
        place = found.get(name)
        if place is None or keys[place[0]] != file:
            raise SafetensorsError(
                f"the index puts {json.dumps(name)} in {file}, whose header does not have it",
                path=_where(file, name),
            )
    return found


def encode_bundle(files: Sequence[tuple], index: tuple[str, bytes] | None) -> bytes:
    """The bundle of ``files`` (``(key, size, header bytes[, whole-file checksum])``, the
    checksum ``(kind, value)`` of :class:`~cloudckpt.storage.base.WholeChecksum` or None) and
    the ``index`` read, if any (``(key, bytes)``)."""
    return msgpack.packb(
        {
            "format": BUNDLE_FORMAT,
            "index": list(index) if index else None,
            "files": [
                [f[0], f[1], bytes(f[2]), list(f[3]) if len(f) > 3 and f[3] else None]
                for f in files
            ],
        },
        use_bin_type=True,
    )


def _decode_bundle(raw: bytes):
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        if type(doc) is not dict or doc.get("format") != BUNDLE_FORMAT:
            raise ValueError("not a header bundle")
        index = doc["index"]
        if index is not None:
            key, body = index
            if type(key) is not str or type(body) is not bytes:
                raise ValueError("bad index entry")
            index = (key, body)
        files = []
        for key, size, header, whole in doc["files"]:
            if type(key) is not str or type(size) is not int or type(header) is not bytes:
                raise ValueError("bad file entry")
            if whole is not None and not (
                type(whole) is list
                and len(whole) == 2
                and (
                    whole[0] == "crc32c"
                    and type(whole[1]) is int
                    or whole[0] == "md5"
                    and type(whole[1]) is bytes
                )
            ):
                raise ValueError("bad whole-file checksum")
            files.append((key, size, header, whole and tuple(whole)))
        if len({f[0] for f in files}) != len(files):
            raise ValueError("a file is listed twice")
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise SafetensorsError(f"malformed safetensors header bundle: {exc}") from exc
    return files, index


def parse_bundle(raw: bytes) -> tuple[dict[str, Header], dict[str, str] | None]:
    """The parsed files (key -> header, in the bundle's order) and the index's ``weight_map``
    (None without an index). Raises :class:`SafetensorsError` for anything malformed (see
    :func:`parse_index`, :func:`cloudckpt.hf.header.parse_header`)."""
    entries, index = _decode_bundle(raw)
    weight_map = parse_index(index[1], key=index[0]) if index is not None else None
    return {k: parse_header(h, file_size=s, key=k) for k, s, h, _ in entries}, weight_map


def expected_files(raw: bytes) -> dict[str, ExpectedFile]:
    """File key -> the whole-file checksum to check its bytes against
    (:mod:`cloudckpt.hf.whole`), for the files of the bundle that have one."""
    entries, _ = _decode_bundle(raw)
    return {k: ExpectedFile.of(c[0], c[1], s, h) for k, s, h, c in entries if c is not None}


def map_names(names: Sequence[str], key_map: KeyMap) -> list[str | None]:
    """Each checkpoint name as the state dict names it: ``key_map[name]`` for a dict (names
    not in it unchanged), ``key_map(name)`` for a callable (``None``: not loaded). Two names
    mapped to one raise :class:`DuplicateKeyError`; a callable returning neither a string nor
    None raises :class:`ConfigError`."""
    if key_map is None:
        out: list[str | None] = list(names)
    elif isinstance(key_map, Mapping):
        out = [key_map.get(n, n) for n in names]
    elif callable(key_map):
        out = [key_map(n) for n in names]
    else:
        raise ConfigError(f"key_map must be a dict or a callable, not {type(key_map).__name__}")
    seen: dict[str, str] = {}
    for name, new in zip(names, out):
        if new is None:
            continue
        if type(new) is not str:
            raise ConfigError(
                f"key_map gave {new!r:.60} for {json.dumps(name)}: a string or None was expected"
            )
        if new in seen:
            raise DuplicateKeyError(
                f"key_map maps both {json.dumps(seen[new])} and "
                f"{json.dumps(name)} to {json.dumps(new)}"
            )
        seen[new] = name
    return out


def build_manifest(
    files: Mapping[str, Header], weight_map: Mapping[str, str] | None, key_map: KeyMap = None
) -> Manifest:
    """The in-memory manifest (module doc) of ``files`` (file key -> header); tensors in file
    then data order, named through ``key_map``."""
    found = locate_tensors(files, weight_map)
    headers = list(files.values())
    new_names = map_names(list(found), key_map)
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    sizes: list[int] = []
    objs: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    for new, (i, t) in zip(new_names, found.values()):
        if new is None:
            continue
        names.append(new)
        dtypes.append(t.torch_dtype)
        shapes.append(t.shape)
        sizes.extend(t.shape)
        objs.append(i)
        offsets.append(headers[i].data_start + t.start)
        lengths.append(t.nbytes)

    return Manifest(
        world_size=1,
        created_at=0.0,
        cloudckpt_version=__version__,
        metadata={"format": "safetensors"},
        checksum_block_size=0,
        checksums=False,
        objects=list(files),
        tensor_names=names,
        tensor_dtypes=dtypes,
        tensor_shapes=shapes,
        chunk_counts=[1] * len(names),
        chunk_offsets=[0] * len(sizes),
        chunk_sizes=sizes,
        chunk_object_index=objs,
        chunk_byte_offset=offsets,
        chunk_byte_length=lengths,
        chunk_crcs=[],
        value_blobs={},
    )


def manifest_of_bundle(raw: bytes, key_map: KeyMap = None) -> Manifest:
    """:func:`build_manifest` of a header bundle's files (what every rank runs)."""
    files, weight_map = parse_bundle(raw)
    return build_manifest(files, weight_map, key_map)
