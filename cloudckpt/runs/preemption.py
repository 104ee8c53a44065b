"""Save-and-exit on SIGTERM (spot interruption, Kubernetes eviction), and resume on start.

Usage, identical on every rank::

    mgr = cloudckpt.CheckpointManager("s3://bucket/run", keep_last=3)
    with cloudckpt.PreemptionHandler(mgr) as preempt:     # collective: every rank, same order
        start = preempt.resume(state_dict)                # newest complete step, or None
        for step in range((start or 0) + 1, total_steps + 1):
            train_one_step()
            preempt.checkpoint_if_preempted(step, state_dict)   # may raise Preempted

Contract:

- The signal handler only sets a flag; nothing is saved inside the handler.
- :meth:`should_stop` is called by every rank at the same step boundaries. Every ``check_every``
  steps it does one exchange of the flag on cloudckpt's control channel (on a gloo group of its
  own, apart from the training's and from the saves'), so a signal that reached one rank only
  is seen by all of them, at the same step.
  Between checks it returns ``False`` without communicating. Once it returned ``True`` it keeps
  returning ``True``.
- :meth:`save_and_exit` saves that step synchronously through the manager on every rank
  (skipped when the step is already complete, e.g. saved by the regular schedule) and raises
  :class:`Preempted`, a ``SystemExit`` whose code is ``exit_code`` (default 143, the status of a
  process ended by SIGTERM, so orchestrators see a preemption rather than a finished job).
- Both exchanges fail together: an error on one rank (rank 0 failing to list the run, say) is
  raised as the same :class:`~cloudckpt.errors.CheckpointError` on every rank at once, instead of
  leaving the others waiting for the timeout.
- Without ``torch.distributed`` initialised (or in a world of one) everything is local.
- Handlers are installed by :meth:`install` (or ``with``) from the main thread and the previous
  ones are restored by :meth:`uninstall`.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from typing import Any

from cloudckpt.runs.manager import CheckpointManager

__all__ = ["PreemptionHandler", "Preempted"]

log = logging.getLogger(__name__)


class Preempted(SystemExit):
    """Raised by :meth:`PreemptionHandler.save_and_exit` after the checkpoint is saved.

    ``code`` is the exit status; ``step`` and ``url`` say what was saved; ``signum`` is the signal
    this rank received (``None`` when another rank received it)."""

    def __init__(self, code: int, *, step: int, url: str, signum: int | None):
        super().__init__(code)
        self.step = step
        self.url = url
        self.signum = signum

    def __str__(self) -> str:
        return f"preempted: checkpoint of step {self.step} saved to {self.url}; exit {self.code}"


class PreemptionHandler:
    """Turns a termination signal on any rank into one agreed save and a clean exit.

    Constructing it is collective in a distributed job (it opens the control channel over the
    ranks of ``manager.process_group``, or of ``process_group`` when given); ``timeout`` bounds
    its exchanges. ``check_every`` (>= 1) sets how many steps pass between agreements.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        check_every: int = 1,
        signals: Iterable[int] = (signal.SIGTERM,),
        exit_code: int = 143,
        process_group=None,
        timeout: float = 600.0,
    ):
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {check_every!r}")
        self.manager = manager
        self.check_every = check_every
        self.signals = tuple(signals)
        self.exit_code = int(exit_code)
        self.timeout = float(timeout)
        self._flag = threading.Event()
        self._signum: int | None = None
        self._agreed = False
        self._previous: dict[int, Any] = {}
        from cloudckpt.transport import ControlChannel

        # a lane of its own: the checks run in the training loop while an async save's
        # background phases use the protocol lane
        self._channel = ControlChannel(
            process_group if process_group is not None else manager.process_group,
            timeout=self.timeout,
            lane="preemption",
        )

    # -- signals --------------------------------------------------------------------------------

    def install(self) -> PreemptionHandler:
        """Install the signal handlers (main thread only); returns ``self``."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must be called from the main thread")
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were in place before :meth:`install`."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc_info) -> None:
        self.uninstall()

    def _on_signal(self, signum, frame) -> None:  # async-signal context: set a flag, nothing else
        if self._signum is None:
            self._signum = signum
        self._flag.set()

    def request(self) -> None:
        """Ask for a stop as a signal would (e.g. from a watchdog thread or a test)."""
        self._flag.set()

    @property
    def requested(self) -> bool:
        """Whether this rank received a signal (or :meth:`request`); no communication."""
        return self._flag.is_set()

    # -- step boundaries ------------------------------------------------------------------------

    def resume(self, state_dict) -> int | str | None:
        """Load the newest complete checkpoint into ``state_dict`` (collective): its step (see
        ``CheckpointManager.load``), or None when the run has none."""
        return self.manager.load(state_dict)

    def should_stop(self, step: int) -> bool:
        """Whether every rank must save ``step`` and exit (call on every rank, every step)."""
        if self._agreed:
            return True
        if step % self.check_every != 0:
            return False
        local = self._flag.is_set()
        if self._channel.size == 1:
            agreed = local
        else:
            from cloudckpt.api.reports import StopVote

            with self._channel.phase(f"preemption check at step {step}", StopVote) as check:
                check.report = StopVote(stop=local)
            agreed = any(vote.stop for vote in check.reports)
        if agreed:
            self._agreed = True
            who = (
                f"signal {self._signum} on this rank"
                if self._signum is not None
                else ("a stop request on this rank" if local else "a signal on another rank")
            )
            log.warning("cloudckpt: stopping at step %d after %s", step, who)
        return agreed

    def save_and_exit(self, step: int, state_dict) -> None:
        """Save ``step`` through the manager on every rank, then raise :class:`Preempted`.

        The save is skipped when ``step`` is already complete (every rank takes the same
        decision: rank 0's view is the one used)."""
        self.manager.wait()
        exists = self._coordinator_says_exists(step)
        url = self.manager.step_url(step)
        if not exists:
            self.manager.save(step, state_dict)
        log.warning(
            "cloudckpt: preempted at step %d; checkpoint %s at %s; exiting with status %d",
            step,
            "already present" if exists else "saved",
            url,
            self.exit_code,
        )
        raise Preempted(self.exit_code, step=step, url=url, signum=self._signum)

    def checkpoint_if_preempted(self, step: int, state_dict) -> None:
        """``save_and_exit(step, state_dict)`` when :meth:`should_stop` says so; else nothing."""
        if self.should_stop(step):
            self.save_and_exit(step, state_dict)

    def _coordinator_says_exists(self, step: int) -> bool:
        if self._channel.size == 1:  # one process: the listing's own error, unwrapped
            return self._step_saved(step)
        from cloudckpt.api.reports import StepSaved

        with self._channel.phase(
            f"preemption: checking whether step {step} is saved", StepSaved
        ) as check:
            if self._channel.is_coordinator:
                check.report = StepSaved(saved=self._step_saved(step))
        return check.reports[0].saved

    def _step_saved(self, step: int) -> bool:
        return any(i.step == step and i.complete for i in self.manager.list())
