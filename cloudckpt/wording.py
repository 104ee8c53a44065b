"""Small helpers for the words of user-facing messages. Pure; imports nothing of cloudckpt, so any
layer may use it (like ``errors.py``)."""

from __future__ import annotations

from collections.abc import Iterable


def plural(n: int, word: str, many: str | None = None) -> str:
    """``"1 object"``, ``"2 objects"``, ``"0 objects"``; ``many`` overrides the plural form
    (``plural(n, "entry", "entries")``)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``"rank 1"`` or ``"ranks 0, 2"``."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def seconds(value: float) -> str:
    """A duration for a message: ``"0.25 s"``, ``"12.3 s"``, ``"301 s"``."""
    if value < 1:
        return f"{value:.2f} s"
    if value < 100:
        return f"{value:.1f} s"
    return f"{value:.0f} s"


#: Phase names (protocol steps, also used by tests to place kill points) -> the words users read
#: in errors. Unknown names are shown as they are.
PHASE_WORDS = {
    "save planning": "saving",
    "save global planning": "saving",
    "save plan share": "saving",
    "async save staging": "saving (copying to host memory)",
    "save base": "saving (reading the base checkpoint)",
    "save upload": "saving (writing data)",
    "save commit": "saving (writing the manifest)",
    "load manifest": "loading (reading the manifest)",
    "load planning": "loading",
    "load": "loading (reading data)",
    "load restore": "loading (restoring values)",
}


def phase_words(what: str) -> str:
    """What a user reads for the protocol step ``what`` (see :data:`PHASE_WORDS`)."""
    return PHASE_WORDS.get(what, what)
