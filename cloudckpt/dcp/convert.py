"""``cloudckpt.convert``: a cloudckpt checkpoint to a DCP checkpoint and back, streaming.

```python
cloudckpt.convert("s3://bucket/run/step-100", "s3://bucket/dcp/step-100", to="dcp")
cloudckpt.convert("s3://bucket/dcp/step-7", "/data/ckpt/step-7", to="cloudckpt",
                  allow_pickle=True)   # DCP's .metadata is a pickle: see below
```

Either side may be on S3 or local (any URL cloudckpt takes). Nothing is held whole in memory
but DCP's bytes items (values, and the tuples of tensors DCP stores whole): tensors move stored
chunk by stored chunk, in batches of about ``options.object_size`` bytes (read, verified,
written, released), so memory stays near one batch plus the read buffers.

Either way the nesting is what DCP keeps (:mod:`cloudckpt.dcp.nesting`): converting and
loading whole gives what DCP's own ``dcp_to_torch_save`` gives, containers and their kinds
(tuple, list, dict) included.

- ``to="dcp"``: the DCP checkpoint has DCP's layout as :class:`cloudckpt.dcp.StorageWriter`
  writes it (``__0_<n>.distcp``, ``.metadata.checksums``, then ``.metadata`` in create mode),
  split into items as DCP's planner splits the state dict ``load_full`` returns: each stored
  chunk of a tensor item becomes a DCP chunk; a value, and a tuple holding tensors (which DCP
  stores whole), a bytes item holding ``torch.save(value)`` (the tuple's tensors read whole);
  ``planner_data`` the paths (DCP's fully qualified names are the dotted paths): the very
  items ``dcp.save`` writes for that state dict. ``dcp.load`` with DCP's default planner,
  ``FileSystemReader`` (after a copy) and :class:`cloudckpt.dcp.StorageReader` load it.
  Pickled cloudckpt values need ``allow_pickle=True`` to be read, as for ``cloudckpt.load``.
  Named in :attr:`ConvertResult.changed`, as DCP's own save changes them: empty dicts (not
  stored), int keys and ``OrderedDict`` kinds of the mappings DCP walks (they come back ``str``
  keys and ``dict``).
- ``to="cloudckpt"``: a normal committed checkpoint (data objects, then the manifest in create
  mode) that ``cloudckpt.load``, ``load_full`` and ``verify`` accept, holding what
  ``cloudckpt.save`` would write for the state dict ``dcp_to_torch_save`` rebuilds: each DCP
  chunk is a stored chunk (crc32c per block), tensors inside DCP values (a tuple of tensors)
  are tensors of their own. The nesting comes from DCP's ``planner_data`` (flat names without
  it, or where its paths contradict each other: named in ``changed``, as are holes of a list,
  where DCP dropped an empty dict, rebuilt as ``None``). DCP's ``.metadata`` is a pickle:
  reading it needs ``allow_pickle=True`` (``--trust``), which says you trust the checkpoint's
  writer. cloudckpt unpickles it with its restricted unpickler even then
  (:mod:`cloudckpt.dcp.metadata`). Non-tensor values are read with
  ``torch.load(weights_only=True)`` only, and kept when msgpack holds them. The nesting is
  planned (values read) before anything is written: two leaves of one dotted name
  (``DuplicateKeyError``) fail with nothing written.

Skipped, and named in :attr:`ConvertResult.skipped` (nothing else is dropped): DCP values that
torch's weights_only unpickler refuses, that msgpack cannot hold (an object of a class) or
that hold a tensor of a dtype cloudckpt does not store, DCP tensors of such a dtype, and
cloudckpt leaves outside the checkpoint's nesting (``load_full`` does not return them either).
The destination must not hold a committed checkpoint (``CheckpointExists``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cloudckpt.dcp.from_dcp import to_cloudckpt
from cloudckpt.dcp.options import DCPOptions
from cloudckpt.dcp.to_dcp import to_dcp
from cloudckpt.errors import ConfigError, PickleNotAllowed

TARGETS = ("dcp", "cloudckpt")
TRUST_MESSAGE = (
    "reading a DCP checkpoint means unpickling its .metadata, and a pickle can run any code it "
    "names; cloudckpt uses a restricted unpickler, but convert a DCP checkpoint only when you "
    "trust who wrote it: pass allow_pickle=True (command line: --trust)"
)


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion did: tensors, stored chunks and values written, tensor bytes moved,
    what was left out (``"name: why"``), what the destination's format keeps differently
    (``changed``, ``"name: what"``: see the module doc) and how long it took."""

    src: str
    dst: str
    to: str
    tensors: int
    chunks: int
    values: int
    bytes: int
    skipped: tuple[str, ...]
    seconds: float
    changed: tuple[str, ...] = ()


def convert(
    src: str,
    dst: str,
    *,
    to: str,
    allow_pickle: bool = False,
    storage=None,
    options: DCPOptions | None = None,
) -> ConvertResult:
    """Convert the checkpoint at ``src`` into a new one at ``dst`` of format ``to`` (``"dcp"``:
    ``src`` is a cloudckpt checkpoint; ``"cloudckpt"``: ``src`` is a DCP checkpoint). See the
    module doc. ``storage``: :class:`cloudckpt.storage.StorageOptions` for both sides;
    ``options``: :class:`DCPOptions` (``object_size`` is the batch size)."""
    if to not in TARGETS:
        raise ConfigError(f"to must be 'dcp' or 'cloudckpt', got {to!r}")
    options = options or DCPOptions()
    started = time.perf_counter()
    if to == "dcp":
        counts = to_dcp(str(src), str(dst), allow_pickle, storage, options)
    else:
        if not allow_pickle:
            raise PickleNotAllowed(TRUST_MESSAGE)
        counts = to_cloudckpt(str(src), str(dst), storage, options)
    return ConvertResult(
        src=str(src), dst=str(dst), to=to, seconds=time.perf_counter() - started, **counts
    )


__all__ = ["ConvertResult", "TARGETS", "TRUST_MESSAGE", "convert"]
