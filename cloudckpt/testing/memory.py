"""Peak resident memory of this process over a block of code (tests and benchmarks).

``with PeakRSS() as m: work()`` then ``m.growth``: the peak RSS during the block less the RSS
when it began, in bytes. On Linux the kernel's high-water mark is reset when the block begins
(``/proc/self/clear_refs``) and read when it ends, so every peak counts however short; where
that is not possible a thread samples the RSS every millisecond (short peaks may be missed).
"""

from __future__ import annotations

import re
import threading
import time

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def current_rss() -> int:
    """This process's resident memory in bytes (0 where it cannot be read)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else 0


def peak_rss() -> int:
    """This process's peak resident memory in bytes (the kernel's high-water mark ``VmHWM``, since
    the process started or the last :func:`reset_high_water_mark`); ``ru_maxrss`` where /proc is
    not readable."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_high_water_mark() -> bool:
    """Reset the kernel's peak RSS to the current RSS. False when the kernel refuses (then
    :func:`peak_rss` is the lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Measures the peak RSS growth of a ``with`` block (see module doc)."""

    def __init__(self) -> None:
        self.start = self.peak = self.growth = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._exact = False

    def __enter__(self) -> PeakRSS:
        self.start = current_rss()
        self._exact = reset_high_water_mark() and _status_kib("VmHWM") is not None
        if not self._exact:
            self.peak = self.start
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self._exact:
            self.peak = (_status_kib("VmHWM") or 0) * 1024
        else:
            self._stop.set()
            if self._sampler is not None:
                self._sampler.join()
            self.peak = max(self.peak, current_rss())
        self.growth = max(0, self.peak - self.start)
