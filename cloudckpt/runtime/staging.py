"""Host staging buffers for async save: process state, held by the runtime context
(:meth:`cloudckpt.runtime.context.RuntimeContext.staging_pool`) and reused from save to save.

Contract:
- :meth:`StagingPool.stage` copies every ``(chunk_id, tensor)`` item into host buffers owned by
  the pool and returns ``(chunk_id, host_tensor)`` items that the upload can read while training
  goes on mutating the originals.
- Buffers are reused from one save to the next when the layout (chunk ids, shapes, dtypes) is the
  same: no allocation churn. :attr:`StagingPool.allocations` counts buffer allocations, so reuse
  is observable.
- CUDA sources are copied into pinned host buffers with non-blocking copies on a side stream,
  synchronised once before :meth:`stage` returns.
- ``limit_bytes`` bounds the pool: a layout that needs more raises
  :class:`~cloudckpt.errors.StagingMemoryError` before copying anything.
- A pool stages one save at a time; the caller must not stage again before the previous upload
  finished (async_save enforces one save in flight).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from cloudckpt.errors import StagingMemoryError


class StagingPool:
    """Reusable host copies of the tensors a rank writes."""

    def __init__(self, *, limit_bytes: int | None = None):
        self.limit_bytes = limit_bytes
        self.allocations = 0
        self._layout: tuple | None = None
        self._buffers: list[torch.Tensor] = []
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def stage(self, items: Sequence[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """Copy ``items`` into pool buffers; return the staged ``(chunk_id, tensor)`` items."""
        layout = tuple((cid, tuple(t.shape), t.dtype, t.device.type) for cid, t in items)
        need = sum(t.numel() * t.element_size() for _, t in items)
        if self.limit_bytes is not None and need > self.limit_bytes:
            raise StagingMemoryError(
                f"async save needs {need} bytes of host staging memory on this rank, more than "
                f"the limit of {self.limit_bytes} bytes (raise max_staging_bytes, or save "
                f"synchronously)"
            )
        with self._lock:
            if layout != self._layout:
                self._buffers = [self._allocate(t) for _, t in items]
                self._layout = layout
            cuda = [t for _, t in items if t.device.type == "cuda"]
            stream = torch.cuda.Stream() if cuda else None
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for buf, (_, t) in zip(self._buffers, items):
                        if t.device.type == "cuda":
                            buf.copy_(t, non_blocking=True)
            for buf, (_, t) in zip(self._buffers, items):
                if t.device.type != "cuda":
                    buf.copy_(t)
            if stream is not None:
                stream.synchronize()
            return [(cid, buf) for buf, (cid, _) in zip(self._buffers, items)]

    def _allocate(self, t: torch.Tensor) -> torch.Tensor:
        self.allocations += 1
        pin = t.device.type == "cuda"
        return torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu", pin_memory=pin)

    def release(self) -> None:
        """Drop every buffer (the next stage allocates anew)."""
        with self._lock:
            self._buffers = []
            self._layout = None
