"""Which checkpoints of a run a retention policy keeps: a pure function of the complete ones.

A :class:`RetentionPolicy` is a set of *keep* rules. A complete checkpoint survives when at least
one rule keeps it; everything else is selected for deletion by :func:`select_to_delete`:

- ``keep_last=N``: the N newest complete steps;
- ``keep_every=K``: every step that is a multiple of K (0, K, 2K, ...);
- ``keep_steps={...}``: an explicit set of steps;
- ``keep_if=predicate``: every step for which ``predicate(step)`` is true.

A run's checkpoints may have names a trainer chose (``last``, ``epoch=0-step=10.ckpt``):
:func:`select_names` judges them in the order the caller gives (oldest first); ``keep_last`` counts
from the end of that order, the other rules judge each one's step, and one without a step
(``None``) is kept by ``keep_last`` only.

Two guarantees hold whatever the rules say:

- the newest complete step is never selected;
- a policy with no rule at all is *inactive* and selects nothing (it never means "keep nothing").

Only complete checkpoints are considered here. Incomplete ones (a save in progress, or killed) are
the manager's business: it removes them only once they are older than a grace period.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

__all__ = ["RetentionPolicy", "select_names", "select_to_delete"]


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Keep rules for the complete checkpoints of a run (see the module docstring).

    ``keep_if`` receives a step (an ``int``) and returns whether to keep it; it must be pure and
    cheap, as it is called for every complete step at every prune.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_steps: frozenset[int] = field(default_factory=frozenset)
    keep_if: Callable[[int], bool] | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None:
            if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int):
                raise TypeError(f"keep_last must be an int, got {type(self.keep_last).__name__}")
            if self.keep_last < 0:
                raise ValueError(f"keep_last must be >= 0, got {self.keep_last}")
        if self.keep_every is not None:
            if isinstance(self.keep_every, bool) or not isinstance(self.keep_every, int):
                raise TypeError(f"keep_every must be an int, got {type(self.keep_every).__name__}")
            if self.keep_every < 1:
                raise ValueError(f"keep_every must be >= 1, got {self.keep_every}")
        steps = frozenset(self.keep_steps)
        for step in steps:
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"keep_steps must hold ints >= 0, got {step!r}")
        object.__setattr__(self, "keep_steps", steps)
        if self.keep_if is not None and not callable(self.keep_if):
            raise TypeError("keep_if must be callable (step -> bool)")

    @property
    def active(self) -> bool:
        """True when at least one keep rule is set (an inactive policy never deletes anything)."""
        return (
            self.keep_last is not None
            or self.keep_every is not None
            or bool(self.keep_steps)
            or self.keep_if is not None
        )

    def keeps(self, step: int | None, *, rank_from_newest: int) -> bool:
        """Whether a rule keeps ``step`` (``None``: a checkpoint without a step);
        ``rank_from_newest`` is 0 for the newest complete checkpoint."""
        if self.keep_last is not None and rank_from_newest < self.keep_last:
            return True
        if step is None:
            return False
        if self.keep_every is not None and step % self.keep_every == 0:
            return True
        if step in self.keep_steps:
            return True
        return self.keep_if is not None and bool(self.keep_if(step))


def select_to_delete(steps_complete: Iterable[int], policy: RetentionPolicy) -> set[int]:
    """Return the complete steps ``policy`` does not keep.

    ``steps_complete`` holds the steps of the run's complete checkpoints, in any order (duplicates
    are ignored). The newest one is never in the result, and an inactive policy returns an empty
    set.
    """
    steps = sorted(set(steps_complete))
    return set(select_names([(s, s) for s in steps], policy))


def select_names(ordered: Sequence[tuple[T, int | None]], policy: RetentionPolicy) -> set[T]:
    """Return the names of the complete checkpoints ``policy`` does not keep.

    ``ordered``: ``(name, step)`` of each complete checkpoint, oldest first (``step`` may be
    ``None``). The last one is never in the result, and an inactive policy returns an empty set.
    """
    if not ordered or not policy.active:
        return set()
    doomed = set()
    for rank_from_newest, (name, step) in enumerate(reversed(ordered)):
        if rank_from_newest == 0:
            continue  # the newest complete checkpoint is always kept
        if not policy.keeps(step, rank_from_newest=rank_from_newest):
            doomed.add(name)
    return doomed
