"""Per-rank write rates, and the weights the replica assignment spreads replicated bytes by.

Contract:

- A rank's *write rate* is the bytes per second its saves moved to the store: the save records
  each upload of at least :data:`MIN_SAMPLE_BYTES` (bytes written / wall seconds of the rank's
  upload) with :meth:`WriteRates.record`; the rate is a moving mean (each sample weighs
  :data:`SAMPLE_WEIGHT`). A process that has measured nothing has no rate. A rank can be told
  its rate instead (:meth:`WriteRates.tell`, e.g. from a node's known link speed): a told rate
  wins over measurements until :meth:`WriteRates.forget`.
- The rate travels in the rank's local save plan as a *rate class*,
  ``round(CLASS_STEPS * log2(bytes/s))`` (0: unknown), so that a plan, and the plan cache's key,
  change only when a rate moves by a step (``2 ** (1 / CLASS_STEPS)``), not with every jitter.
- :func:`replica_weights`: the rate classes of every rank -> one weight per rank, or ``None``
  (even spread, as before rates existed) unless every rank has a rate and the slowest and
  fastest differ by at least :data:`MIN_SPREAD_STEPS` classes. Then the replica assignment
  gives each holder a share of the replicated bytes in proportion to its weight, so that every
  node finishes writing at about the same time (:mod:`cloudckpt.planning.save.replicas`).
  A class outside ``0..MAX_CLASS`` (a peer's malformed report) also gives ``None``.

Pure arithmetic apart from the process-wide :data:`WRITE_RATES` memo (numbers only, no I/O).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

#: Uploads smaller than this measure latency more than rate: not recorded.
MIN_SAMPLE_BYTES = 4 << 20
#: Weight of a new sample in the moving mean.
SAMPLE_WEIGHT = 0.5
#: Rate classes per doubling of the rate.
CLASS_STEPS = 2
#: Rates are used only when the fastest rank's class exceeds the slowest's by this many steps
#: (a factor of about 2.8: nodes of one kind measure within that of each other, even on a busy
#: machine).
MIN_SPREAD_STEPS = 3
#: Largest rate class a plan may carry (2**40 bytes/s); larger or negative ones are malformed.
MAX_CLASS = 40 * CLASS_STEPS


def rate_class(bytes_per_second: float) -> int:
    """The rate class of a rate (0 for none, at least 1 for any positive rate)."""
    if not bytes_per_second > 0 or not math.isfinite(bytes_per_second):
        return 0
    return min(MAX_CLASS, max(1, round(CLASS_STEPS * math.log2(bytes_per_second))))


def class_rate(cls: int) -> float:
    """The rate (bytes/s) a class stands for."""
    return float(2.0 ** (cls / CLASS_STEPS))


def replica_weights(classes: Sequence[int]) -> list[float] | None:
    """One weight per rank from every rank's rate class, or ``None`` (see module doc)."""
    if (
        not classes
        or not all(type(c) is int and 0 < c <= MAX_CLASS for c in classes)
        or max(classes) - min(classes) < MIN_SPREAD_STEPS
    ):
        return None
    top = max(classes)
    return [class_rate(c - top) for c in classes]  # the fastest weigh 1


class WriteRates:
    """This process's write rate to the store (see module doc); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._measured = 0.0
        self._told = 0.0

    def record(self, nbytes: int, seconds: float) -> None:
        """One upload: ``nbytes`` written in ``seconds`` (ignored under MIN_SAMPLE_BYTES)."""
        if nbytes < MIN_SAMPLE_BYTES or not seconds > 0:
            return
        rate = nbytes / seconds
        with self._lock:
            self._measured = (
                rate
                if self._measured <= 0
                else (1 - SAMPLE_WEIGHT) * self._measured + SAMPLE_WEIGHT * rate
            )

    def tell(self, bytes_per_second: float) -> None:
        """Use this rate (bytes/s) instead of the measured one; ``0`` stops telling."""
        if not bytes_per_second >= 0 or not math.isfinite(bytes_per_second):
            raise ValueError(f"a write rate is a finite number >= 0, got {bytes_per_second!r}")
        with self._lock:
            self._told = float(bytes_per_second)

    def forget(self) -> None:
        """Drop the measured and told rates."""
        with self._lock:
            self._measured = self._told = 0.0

    @property
    def rate(self) -> float:
        """Bytes/s: the told rate, else the measured one (0: none)."""
        with self._lock:
            return self._told or self._measured

    def rate_class(self) -> int:
        return rate_class(self.rate)


#: The process's write rate, read by every save's local plan and fed by every save's upload.
WRITE_RATES = WriteRates()
