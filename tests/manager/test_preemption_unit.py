"""PreemptionHandler in one process (no torch.distributed): flag, cadence, save-and-exit."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from cloudckpt.runs.preemption import Preempted, PreemptionHandler


class FakeManager:
    process_group = None

    def __init__(self, complete=()):
        self.complete = set(complete)
        self.saved = []

    def wait(self):
        pass

    def list(self):
        return [SimpleNamespace(step=s, complete=True) for s in sorted(self.complete)]

    def save(self, step, state_dict):
        self.saved.append((step, dict(state_dict)))
        self.complete.add(step)

    def step_url(self, step):
        return f"mem://run/step-{step:012d}"


def test_signal_sets_flag_and_stop_is_agreed_on_cadence():
    mgr = FakeManager()
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionHandler(mgr, check_every=2) as handler:
        assert not handler.should_stop(2)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: only sets the flag
        assert handler.requested
        assert not handler.should_stop(3)  # not a check step
        assert handler.should_stop(4)
        assert handler.should_stop(5)  # sticky once agreed
        with pytest.raises(Preempted) as info:
            handler.checkpoint_if_preempted(5, {"w": 1})
    assert signal.getsignal(signal.SIGTERM) is before
    assert info.value.code == 143 and info.value.step == 5
    assert info.value.signum == signal.SIGTERM
    assert isinstance(info.value, SystemExit)
    assert mgr.saved == [(5, {"w": 1})]


def test_existing_step_is_not_saved_again_and_exit_code_is_configurable():
    mgr = FakeManager(complete={7})
    handler = PreemptionHandler(mgr, exit_code=3)
    handler.request()
    assert handler.should_stop(7)
    with pytest.raises(Preempted) as info:
        handler.save_and_exit(7, {"w": 2})
    assert info.value.code == 3 and info.value.signum is None
    assert mgr.saved == []


def test_no_request_means_no_stop():
    handler = PreemptionHandler(FakeManager())
    assert not any(handler.should_stop(s) for s in range(5))
    handler.checkpoint_if_preempted(5, {})  # returns normally
    with pytest.raises(ValueError):
        PreemptionHandler(FakeManager(), check_every=0)
