"""Signals deferred while the optimizer's state changes: :func:`signals_deferred`, and
:func:`no_grad_whole`, torch's ``no_grad`` entered and left with signals deferred."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["signals_deferred", "no_grad_whole"]

try:  # the C function signal.getsignal wraps, without its enum conversion of each handler
    from _signal import getsignal as _getsignal
except ImportError:  # pragma: no cover - not CPython
    _getsignal = signal.getsignal

# Fixed per platform; as plain ints (signal.valid_signals() makes an enum of each one, and
# with getsignal's conversions that cost ~0.5 ms per step on a busy 2-core host).
_SIGNALS = tuple(int(s) for s in signal.valid_signals())


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Signals with a Python handler (Ctrl-C's SIGINT, a preemption handler's SIGTERM or
    SIGUSR1, a timer's SIGALRM: every signal whose handler is a Python callable) that arrive
    inside the block reach their handler when it ends, so an exception raised there cannot
    leave a step half done (tests/test_state_contract.py, tests/test_delayed.py; a fresh user's
    finding: a SIGALRM handler that raised inside a delayed step left some weights published
    and others not, silently). Main thread only: Python runs signal handlers there alone.

    The handlers are swapped one signal at a time, so a signal may reach its own handler
    while the swap is under way: the handlers swapped so far are then put back before its
    exception leaves (found by tests/long/faults.py: a SIGALRM handler that raised there left
    Ctrl-C recorded into a list forever), and putting them back goes on past such an
    exception.

    Every signal recorded reaches its handler, in the order they came (:func:`_deliver`):
    three Ctrl-Cs inside the block are three calls of SIGINT's handler (the CLI's third exits,
    ``cli._Interrupts``), and a SIGUSR1 after a Ctrl-C still reaches its own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, Any]] = []

    def record(signum: int, frame: Any) -> None:
        pending.append((signum, frame))

    previous: dict[int, Any] = {}
    try:
        for sig in _SIGNALS:
            try:
                handler = _getsignal(sig)
            except (OSError, ValueError):  # a number this platform lists but cannot query
                continue
            if callable(handler):
                previous[sig] = handler  # first: put back whatever happens next
                signal.signal(sig, record)
        yield
    finally:
        try:
            _put_back(previous)
        finally:  # a handler that raised as it was put back: the recorded signals came first
            _deliver(pending, previous)


def _deliver(pending: list[tuple[int, Any]], handlers: dict[int, Any]) -> None:
    """Call the handler of each recorded signal, in order; one that raises does not stop the
    rest (the first raising handler used to drop every signal after it: three Ctrl-Cs counted
    as one, a SIGUSR1 after a Ctrl-C was lost). The exception that leaves is the last one
    raised, with the one before it as its ``__context__``: what CPython does with signals
    pending together, whose handlers after one that raised run next, as its exception leaves
    (``_PyErr_CheckSignalsTstate``), so that a later handler's exception replaces it."""
    error: BaseException | None = None
    for signum, frame in pending:
        try:
            handlers[signum](signum, frame)  # KeyboardInterrupt for SIGINT: raised from here
        except BaseException as e:  # noqa: BLE001 - raised below, once every handler ran
            if error is not None and e is not error and e.__context__ is None:
                e.__context__ = error
            error = e
    if error is not None:
        raise error


def _put_back(previous: dict[int, Any]) -> None:
    """Restore every handler in ``previous``; a restored handler that raises meanwhile (its
    signal arrived) does not stop the others being restored, and is raised after them."""
    todo, error = list(previous.items()), None
    while todo:
        try:
            while todo:
                sig, handler = todo[0]
                signal.signal(sig, handler)
                todo.pop(0)
        except BaseException as e:  # noqa: BLE001 - raised below, once all are back
            error = error or e
    if error is not None:
        raise error


def no_grad_whole(fn: Callable) -> Callable:
    """``torch.no_grad()`` as a decorator, entered and left with signals deferred: a signal
    whose handler raises between torch's ``no_grad`` setting grad mode off and its ``with``
    block starting (or between the block's end and grad mode coming back) left grad mode off
    for good, and the next backward failed with "does not require grad" (found by
    tests/long/faults.py)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with signals_deferred(), torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper
