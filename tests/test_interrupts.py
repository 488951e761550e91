"""offloadopt/interrupts.py: the signals that arrive inside ``signals_deferred`` each reach
their handler at its end, in order, whatever a handler before them raises."""

import os
import signal

import pytest

from offloadopt import cli
from offloadopt.interrupts import signals_deferred


@pytest.fixture
def handlers():
    """Sets handlers for the test (``handlers(sig, fn)``); the previous ones come back after."""
    before = {}

    def install(sig: int, fn) -> None:
        before.setdefault(sig, signal.getsignal(sig))
        signal.signal(sig, fn)

    yield install
    for sig, fn in before.items():
        signal.signal(sig, fn)


def test_every_signal_recorded_reaches_its_handler_after_one_that_raises(handlers):
    """Three Ctrl-Cs and a SIGUSR1 inside the block: SIGINT's handler ran once and the rest
    were dropped. Now each runs, in order; the last exception raised leaves, the ones before
    it as its context."""
    calls = []

    def interrupt(signum, frame):
        calls.append(signum)
        raise KeyboardInterrupt(len(calls))

    handlers(signal.SIGINT, interrupt)
    handlers(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    with pytest.raises(KeyboardInterrupt) as info:
        with signals_deferred():
            for sig in (signal.SIGINT, signal.SIGINT, signal.SIGINT, signal.SIGUSR1):
                signal.raise_signal(sig)
            assert calls == []  # recorded, not handled, inside the block
    assert calls == [signal.SIGINT] * 3 + [signal.SIGUSR1]
    assert info.value.args == (3,) and info.value.__context__.args == (2,)
    assert info.value.__context__.__context__.args == (1,)
    assert signal.getsignal(signal.SIGINT) is interrupt  # put back


def test_three_ctrl_cs_in_one_region_are_the_clis_third(handlers, monkeypatch):
    """The CLI counts the calls of its SIGINT handler: the first two raise KeyboardInterrupt,
    the third exits, status 130. Three inside one deferred region (one step) counted as one."""
    exits = []

    class Exited(BaseException):
        pass

    def exit_(status):
        exits.append(status)
        raise Exited

    interrupts = cli._Interrupts()
    handlers(signal.SIGINT, interrupts)
    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises((Exited, KeyboardInterrupt)) as info:  # a KeyboardInterrupt: a failure
        with signals_deferred():
            for _ in range(3):
                signal.raise_signal(signal.SIGINT)
    assert (interrupts.count, exits) == (3, [130])
    assert info.type is Exited and isinstance(info.value.__context__, KeyboardInterrupt)


def test_a_handler_raising_as_it_is_put_back_leaves_the_recorded_signals_delivered(
    handlers, monkeypatch
):
    """A signal that arrives while the handlers are put back, whose handler raises: the
    signals recorded before it reach their handlers too (they were dropped)."""
    calls, real = [], signal.signal

    class Alarm(Exception):
        pass

    def alarm(signum, frame):
        calls.append(signum)
        raise Alarm

    def put_back(sig, handler):
        out = real(sig, handler)
        if sig == signal.SIGALRM and handler is alarm and signal.SIGALRM not in calls:
            signal.raise_signal(signal.SIGALRM)  # its handler, just put back, raises
        return out

    handlers(signal.SIGALRM, alarm)
    handlers(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    with pytest.raises(Alarm):
        with signals_deferred():
            signal.raise_signal(signal.SIGUSR1)
            monkeypatch.setattr(signal, "signal", put_back)
    monkeypatch.undo()
    assert calls == [signal.SIGALRM, signal.SIGUSR1]
    assert signal.getsignal(signal.SIGALRM) is alarm
