"""Reading chosen tensors, or boxes of them, from a checkpoint without loading the rest.

:class:`TensorReader` is for one process that wants part of a checkpoint in memory at a time
(an export that streams the checkpoint out, a tool that inspects one tensor). No collective; it
works with or without ``torch.distributed``.

Contract:
- The manifest is read once (or given, already decoded) and the stored objects' extents are
  checked before anything is read, as :func:`cloudckpt.load_full` does.
- :meth:`TensorReader.read_into` fills caller-owned tensors with boxes of stored tensors (every
  block crc-verified, dtype converted to the destination's); memory beyond the destinations is
  bounded by ``LoadOptions.max_read_bytes``. A failure may leave destinations half filled.
- Missing names raise :class:`~cloudckpt.errors.MissingKeysError`, a box outside the tensor
  :class:`~cloudckpt.errors.PlanningError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from cloudckpt.api.load import check_object_extents
from cloudckpt.dataplane.destinations import fetch_into
from cloudckpt.errors import MissingKeysError
from cloudckpt.manifest.codec import decode_manifest
from cloudckpt.options import LoadOptions
from cloudckpt.planning.load.plan import plan_local_load
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.statedict.dtypes import torch_dtype
from cloudckpt.stored import read_manifest_bytes, reading_view


class TensorReader:
    """Reads parts of the checkpoint at ``url``. ``manifest``: the checkpoint's manifest when the
    caller has decoded it already (for instance without its pickled values); otherwise it is
    read here (``allow_pickle`` as for :func:`cloudckpt.read_manifest`)."""

    def __init__(
        self,
        url: str,
        *,
        manifest=None,
        storage=None,
        allow_pickle: bool = False,
        options: LoadOptions | None = None,
    ):
        self.url = url
        self.options = options or LoadOptions()
        store = shared_store(url, storage)
        if manifest is None:
            raw = read_manifest_bytes(url, store=store)
            manifest = decode_manifest(raw, allow_pickle=allow_pickle)
        # an incremental checkpoint's objects may live in sibling folders: read as load does
        self._store, self.manifest = reading_view(url, storage, manifest, store=store)
        run_coroutine(check_object_extents(self._store, self.manifest))

    def read_into(self, pieces: Sequence[tuple[str, Sequence[int], torch.Tensor]]) -> int:
        """Fill each ``(name, offsets, dest)``: ``dest`` (a CPU tensor) receives the box of the
        stored tensor ``name`` that starts at ``offsets`` and has ``dest``'s shape. Returns the
        bytes fetched."""
        requests, dests = [], []
        for name, offsets, dest in pieces:
            record = self._record(name)
            requests.append(
                PieceSpec(
                    name=name,
                    dtype=str(dest.dtype).removeprefix("torch."),
                    global_shape=tuple(record.shape),
                    offsets=tuple(offsets),
                    sizes=tuple(dest.shape),
                    broadcastable=False,
                )
            )
            dests.append(dest)
        plan = plan_local_load(self.manifest, requests, rank=0)
        return run_coroutine(
            fetch_into(self._store, self.manifest, plan.reads, dests, self.options.max_read_bytes)
        )

    def read_boxes(
        self, boxes: Sequence[tuple[str, Sequence[int], Sequence[int]]]
    ) -> list[torch.Tensor]:
        """Fresh CPU tensors of the stored dtype, one per ``(name, offsets, sizes)`` box."""
        dests = [
            torch.empty(tuple(sizes), dtype=torch_dtype(self._record(name).dtype))
            for name, _, sizes in boxes
        ]
        self.read_into([(name, offsets, dest) for (name, offsets, _), dest in zip(boxes, dests)])
        return dests

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, whole, as new CPU tensors of their stored dtype."""
        out = {}
        for name in names:
            record = self._record(name)
            out[name] = torch.empty(tuple(record.shape), dtype=torch_dtype(record.dtype))
        self.read_into([(name, (0,) * t.dim(), t) for name, t in out.items()])
        return out

    def _record(self, name: str):
        if name not in self.manifest.tensors:
            raise MissingKeysError(f"{self.url} holds no tensor named {name!r}", keys=(name,))
        return self.manifest.tensors[name]
