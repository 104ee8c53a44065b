"""Byte views of tensors: the one place that turns tensor memory into buffers and back.

- :func:`is_byte_viewable` says whether a tensor's memory *is* its values in row-major order: a
  dense CPU tensor that torch calls contiguous (size-1 dimensions may have any stride, 0-d and
  empty tensors count) with no lazy conjugate / negative bit. Only such a tensor is read or
  written as bytes; any other one goes through a copy (sources) or ``copy_`` (destinations).
- :func:`flat_bytes` / :func:`byte_view` give a flat ``uint8`` tensor / memoryview of such a
  tensor's memory with no copy (any dtype, bfloat16 and bool included), whatever the strides of
  its size-1 dimensions.
- :func:`host_contiguous` returns the tensor itself when it is byte-viewable, otherwise a
  contiguous CPU copy of its values (device tensors, strided views, conjugate views).
- :func:`tensor_from_bytes` views a byte buffer as a tensor of a dtype and shape (no copy).
"""

from __future__ import annotations

import math
import threading

import torch


def is_byte_viewable(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds exactly its values in row-major order (see module doc)."""
    return (
        t.is_cpu  # the same as t.device.type == "cpu", without making a device object
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def host_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` if it is byte-viewable; a contiguous CPU copy of its values otherwise."""
    if is_byte_viewable(t):
        return t
    return t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` tensor over a byte-viewable tensor's memory (no copy).

    Raises ``ValueError`` for any other tensor: call :func:`host_contiguous` first.
    """
    if not is_byte_viewable(t):
        raise ValueError("a byte view needs a contiguous CPU tensor without conjugate/negative bit")
    # a contiguous tensor's size-1 dimensions may carry any stride: re-stride it as the flat run
    # it is, so the dtype view below never sees a stride other than 1
    flat = t.detach().as_strided((t.numel(),), (1,))
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat uint8 memoryview of a byte-viewable tensor's bytes (no copy).

    Raises ``ValueError`` for any other tensor: call :func:`host_contiguous` first.
    """
    if not is_byte_viewable(t):
        raise ValueError("a byte view needs a contiguous CPU tensor without conjugate/negative bit")
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype in _NUMPY_DTYPES:
        # the tensor's own numpy array (a third of the cost of re-striding it as bytes first:
        # a load makes one view per destination); a buffer's C-contiguity, like torch's, does
        # not look at the strides of size-1 dimensions
        return t.detach().numpy().data.cast("B")
    return flat_bytes(t).numpy().data.cast("B")


#: dtypes whose tensors ``Tensor.numpy()`` takes as they are (bfloat16 and float8 it does not)
_NUMPY_DTYPES = frozenset(
    (
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    )
)


def tensor_from_bytes(buf, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``buf`` (a writable buffer of exactly the size)."""
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if isinstance(buf, torch.Tensor):
        raw = flat_bytes(buf)
    else:
        mv = memoryview(buf).cast("B")
        if len(mv) == 0:
            return torch.empty(shape, dtype=dtype)
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
