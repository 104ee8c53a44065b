"""numpy's huge-page advice, off while the coordinator plans and commits a save (issue 27).

numpy advises ``MADV_HUGEPAGE`` for every array of 4 MiB or more. On a kernel with
transparent huge pages in ``madvise`` mode and ``defrag`` = ``madvise`` (a common default),
the first touch of such memory makes the faulting thread compact memory for 2 MiB pages
itself. Planning a very large save allocates many fresh large arrays once: measured at 16,384
ranks, the coordinator's first plan took 1.4 s of user CPU and 5.3 s of *system* CPU, 1.8 s +
0.9 s without the advice (benchmarks/README.md, planning.py). The arrays are short-lived and
read once or twice, so huge pages buy them nothing.

Contract of :func:`without_huge_page_advice`:
- Inside the block numpy gives no huge-page advice; numpy's own setting (its
  ``NUMPY_MADVISE_HUGEPAGE`` environment variable, or a caller's) is restored when the last
  block running in the process ends. Blocks may overlap in several threads (a counter under a
  lock): the advice stays off until every one has ended.
- The setting is process-wide while a block runs: another thread's large arrays allocated
  meanwhile get no advice either. That changes how fast their memory is first touched, never a
  value.
- A numpy without the switch (a private function since numpy 1.20): the block does nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["without_huge_page_advice"]

_LOCK = threading.Lock()


class _Advice:
    """How many blocks run now, and numpy's setting before the first of them."""

    depth = 0
    before = True


def _switch() -> Callable[[bool], bool] | None:
    """numpy's ``_set_madvise_hugepage(enabled) -> previous``, or None."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        try:
            from numpy.core import multiarray  # type: ignore[no-redef]
        except ImportError:
            return None
    return getattr(multiarray, "_set_madvise_hugepage", None)


@contextlib.contextmanager
def without_huge_page_advice() -> Iterator[None]:
    """Run the block with numpy's huge-page advice off (see the module's contract)."""
    switch = _switch()
    if switch is None:
        yield
        return
    with _LOCK:
        if _Advice.depth == 0:
            _Advice.before = bool(switch(False))
        _Advice.depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _Advice.depth -= 1
            if _Advice.depth == 0:
                switch(_Advice.before)
