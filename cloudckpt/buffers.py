"""Byte views of tensors: the one place that turns tensor memory into buffers and back.

- :func:`byte_view` returns a flat ``uint8`` memoryview of a CPU, contiguous tensor's memory with
  no copy (any dtype, bfloat16 and bool included; 0-d and empty tensors too).
- :func:`host_contiguous` returns the tensor itself when it already is a CPU contiguous tensor,
  otherwise a contiguous CPU copy (device tensors, non-contiguous views).
- :func:`tensor_from_bytes` views a byte buffer as a tensor of a dtype and shape (no copy).
"""

from __future__ import annotations

import math
import threading

import torch


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is a dense, contiguous CPU tensor; a contiguous CPU copy otherwise."""
    if t.device.type == "cpu" and t.is_contiguous() and t.layout == torch.strided:
        return t
    return t.detach().to("cpu").contiguous()


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat uint8 memoryview of a CPU contiguous tensor's bytes (no copy).

    Raises ``ValueError`` for non-contiguous or device tensors: call :func:`host_contiguous` first.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def tensor_from_bytes(buf, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``buf`` (a writable buffer of exactly the size)."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    mv = memoryview(buf).cast("B") if not isinstance(buf, torch.Tensor) else None
    if isinstance(buf, torch.Tensor):
        raw = buf.reshape(-1).view(torch.uint8)
    elif len(mv) == 0:
        return torch.empty(shape, dtype=dtype)
    else:
        raw = torch.frombuffer(mv, dtype=torch.uint8)
    if raw.numel() != n * itemsize:
        raise ValueError(f"buffer of {raw.numel()} bytes cannot hold {shape} of {dtype}")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape)


class BufferPool:
    """Reusable flat ``uint8`` CPU buffers of one size, for data passing through on its way to a
    destination (fetched windows, broadcast batches).

    A fresh large allocation costs a page fault per 4 KiB the first time it is written (about as
    much CPU as the copy itself); a pool hands the same, already touched, memory out again.
    ``take()`` returns a free buffer or allocates one; ``give()`` returns it. Thread-safe. The
    pool does not bound how many buffers exist: callers bound what they hold at once. Buffers
    are freed with the pool.
    """

    def __init__(self, size: int):
        self.size = int(size)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0

    def take(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.allocated += 1
        return torch.empty(self.size, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
