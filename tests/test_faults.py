"""Fault suites, the fast slice (tests/long/faults.py runs the same cases in a loop over seeds
for minutes): signals at random points of step(), backward with the optimizer's grad hooks,
load_state_dict(), set_offload_fraction() and synchronize(); a user's grad hook that raises;
a worker kernel failing on the Nth bucket; long runs with re-placement and checkpoint cycles
watching RSS, threads and fds; optimizers created and dropped. Each case compares weights and
state bitwise with torch.optim.AdamW(fused=True) (fp32, CPU). The cases live in tests/long/
(fault_*.py; that folder is on pytest's pythonpath: pyproject.toml)."""

import faulthandler
import signal
import time

import faults
import pytest
import torch
from fault_failures import hook_error, worker_error
from fault_lifetimes import endurance, flat, lifetimes
from fault_probe import (
    Alarm,
    Probe,
    Reference,
    alarm_handler,
    check,
    grads_of,
    hybrid,
    interrupted,
    same,
    train,
)
from fault_signals import signal_backward, signal_fraction, signal_load, signal_record, signal_step

# The Probe's loss is sums over its params (no module forward to watch) in wait="module" cases
pytestmark = pytest.mark.filterwarnings("ignore:wait='module' with no model given")
MODES = ["step", "backward", "delayed"]


@pytest.fixture(autouse=True)
def _timer_left_off_and_one_thread():
    # The training thread on one torch thread: on a busy 2-core host its two-thread kernels
    # wait for the worker's core (the reference's AdamW took 16 ms a step instead of 0.1 ms).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # Nothing may hang: a case stuck past 240 s prints every thread's stack and exits.
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    torch.set_num_threads(threads)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


@pytest.mark.parametrize("mode", MODES)
def test_a_signal_at_a_random_point_of_step_leaves_it_whole_or_not_begun(mode):
    for seed, fraction in [(0, 0.5), (1, 1.0)]:
        assert signal_step(seed, mode, fraction, iters=6)


@pytest.mark.parametrize("mode", MODES)
def test_a_recording_handler_runs_once_per_signal_and_the_step_is_whole(mode):
    assert signal_record(0, mode, 0.5) == "once"


def test_a_signal_in_backward_with_grad_hooks_is_refused_or_taken_whole():
    for seed, fraction in [(0, 0.5), (1, 1.0), (2, 0.5)]:
        assert signal_backward(seed, fraction, iters=5)


@pytest.mark.parametrize("mode", MODES)
def test_a_signal_in_load_state_dict_leaves_one_state_or_the_other(mode):
    assert signal_load(0, mode, 0.5)


@pytest.mark.parametrize("mode", MODES)
def test_a_signal_in_set_offload_fraction_leaves_one_placement_or_the_other(mode):
    assert signal_fraction(0, mode)


def test_a_signal_in_synchronize_arrives_after_the_delayed_update_is_published():
    """Found by the fault suite: a SIGALRM handler that raised while opt.synchronize() waited
    for a delayed update left the update's masters and moments applied and its weights not,
    and the optimizer did not refuse (state_dict() then paired them)."""
    model = Probe(0)
    opt, ref = hybrid(model, 1.0, "delayed"), Reference(model)
    train(model, opt, ref, range(2))
    opt.debug.pipeline.worker_hook = lambda b: time.sleep(0.02)  # the wait is long enough to hit
    opt.zero_grad()
    model(2).backward()
    opt.step()
    ref.step(grads_of(model, 2))
    with alarm_handler():
        assert interrupted(opt.synchronize, 0.01)  # raised, after the publication
    assert same(model, ref)
    opt.debug.pipeline.worker_hook = None
    check(model, opt, ref, "after the interrupted synchronize")
    train(model, opt, ref, range(3, 5))
    opt.close()


@pytest.mark.parametrize(("when", "kind"), [("before", "post"), ("after", "post"),
                                            ("before", "tensor"), ("after", "tensor")])  # fmt: skip
def test_an_exception_in_a_users_grad_hook_is_refused_clearly_and_recovers(when, kind):
    assert hook_error(3, 0.5, when, kind) in ("stepped", "refused-load", "refused-discard")
    assert hook_error(4, 1.0, when, kind)


@pytest.mark.parametrize("mode", ["module", "step-module"])
def test_with_wait_module_signals_and_a_failing_bucket_are_handled_alike(mode):
    # step() returns before the copies back land: the next step() or synchronize() ends it
    assert signal_step(0, mode, 1.0, iters=6)
    assert worker_error(0, mode, 1.0, 2, "discard") == "discard"
    assert worker_error(1, mode, 0.5, 1, "load") == "load"


@pytest.mark.parametrize("recover", ["load", "discard"])
@pytest.mark.parametrize("mode", MODES)
def test_a_worker_kernel_failing_on_the_nth_bucket_raises_and_recovers(mode, recover):
    for nth in (1, 2):
        assert worker_error(nth, mode, 1.0, nth, recover) == recover


def test_a_failed_delayed_step_publishes_the_buckets_that_completed():
    """Found by the fault suite: with overlap="delayed", when a later bucket failed the
    buckets whose update had completed never copied their weights in; after
    discard_failed_step() those params trained on from masters their weights did not show,
    and a checkpoint paired the old fp32 weights with the new moments."""
    for fraction, nth in ((1.0, 2), (0.5, 2), (1.0, 3)):
        assert worker_error(0, "delayed", fraction, nth, "discard") == "discard"


@pytest.mark.parametrize("mode", MODES)
def test_200_steps_with_replacement_and_checkpoints_keep_rss_threads_and_fds_flat(mode):
    assert endurance(0, mode, steps=200, every=20) == "10samples"


@pytest.mark.slow
def test_200_optimizers_dropped_are_collected_and_leave_nothing_behind():
    assert lifetimes(0, 200).startswith("200collected")


def test_the_flatness_check_fails_on_growth():
    base = {"rss_nbytes": 2**30, "threads": 5, "fds": 9, "py_threads": 2}
    assert flat([base, dict(base, rss_nbytes=2**30 + 2**20)]) == []
    assert flat([base, dict(base, threads=6)]) == []  # one OpenMP thread leaving late
    assert flat([base, dict(base, threads=7)]) == ["threads 5 -> 7"]
    assert flat([base, dict(base, py_threads=3)]) == ["py_threads 2 -> 3"]
    assert flat([base, dict(base, fds=10)]) == ["fds 9 -> 10"]
    assert flat([base, dict(base, rss_nbytes=2**30 + 33 * 2**20)]) == ["RSS grew 33.0 MiB"]


def test_the_cases_catch_a_half_applied_step(monkeypatch):
    """The suite's comparison fires: a step that silently skips its last bucket."""
    model = Probe(0)
    opt, ref = hybrid(model, 1.0, "step"), Reference(model)
    update, calls = opt.debug.updater.update_bucket, []

    def skip_one(work, grads):
        calls.append(1)
        if len(calls) != 3:
            update(work, grads)

    opt.debug.updater.update_bucket = skip_one
    with pytest.raises(AssertionError, match="differ from the reference"):
        train(model, opt, ref, range(1))
    opt.close()


def test_the_long_run_prints_counts_and_fails_on_bad_arguments(capsys):
    threads = torch.get_num_threads()
    assert faults.main(["--minutes", "0.001", "--cases", "signal_record"]) == 0
    torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "signal_record" in out and "total" in out
    assert faults.main(["--minutes", "1", "--cases", "nope"]) == 2


def test_a_signal_while_the_handlers_are_swapped_leaves_every_handler_as_it_was(monkeypatch):
    """Found by the fault suite: a SIGALRM whose handler raised while step() swapped the
    handlers (SIGINT's already swapped, SIGALRM's not yet) left SIGINT's replaced for good:
    every later Ctrl-C was recorded into a list nobody read."""
    model = Probe(0)
    opt = hybrid(model, 0.5, "step")
    model(0).backward()
    real, fired = signal.signal, []

    def swap(sig, handler):
        out = real(sig, handler)
        if sig == signal.SIGINT and not fired:
            fired.append(sig)
            signal.raise_signal(signal.SIGALRM)  # its handler, not swapped yet, raises next
        return out

    before = real(signal.SIGINT, signal.default_int_handler)
    try:
        with alarm_handler():
            monkeypatch.setattr(signal, "signal", swap)
            with pytest.raises(Alarm):
                opt.step()
            monkeypatch.setattr(signal, "signal", real)
        assert fired and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        real(signal.SIGINT, before)
    opt.step()  # nothing of it had begun
    assert opt.state[next(model.parameters())]["step"].item() == 1
    opt.close()


def test_a_signal_as_step_turns_grad_mode_off_leaves_grad_mode_on(monkeypatch):
    """Found by the fault suite: a SIGALRM whose handler raised right after torch's no_grad
    (step()'s decorator) had turned grad mode off, before its block began, left grad mode
    off for good: the next backward failed with "does not require grad"."""
    model = Probe(0)
    opt = hybrid(model, 0.5, "step")
    model(0).backward()
    enter, fired = torch.autograd.grad_mode.no_grad.__enter__, []

    def interrupted_enter(self):
        enter(self)
        if not fired:
            fired.append(1)
            signal.raise_signal(signal.SIGALRM)  # the handler raises at the next bytecode

    with alarm_handler():
        monkeypatch.setattr(torch.autograd.grad_mode.no_grad, "__enter__", interrupted_enter)
        with pytest.raises(Alarm):
            opt.step()
        monkeypatch.undo()
    assert fired and torch.is_grad_enabled()
    opt.zero_grad()
    model(1).backward()
    opt.step()
    opt.close()


@pytest.mark.parametrize("mode", ["backward", "delayed"])
def test_an_optimizer_dropped_without_close_leaves_no_hook_on_the_model(mode):
    """Its grad hooks and module waits go with it: before, each dropped optimizer left one
    post-accumulate-grad hook per param, and watch()'s forward and state-dict pre-hooks, on
    the model (doing nothing, piling up: a fresh user's finding)."""
    from offloadopt import HybridAdamW

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def counts():
        grads = sum(len(p._post_accumulate_grad_hooks or {}) for p in net.parameters())
        forward = sum(len(m._forward_pre_hooks) for m in net.modules())
        saves = sum(len(m._state_dict_pre_hooks) for m in net.modules())
        return grads, forward, saves

    before = counts()
    kw = dict(grads_final=True, wait="module") if mode == "backward" else {}
    for _ in range(3):
        opt = HybridAdamW(net.parameters(), min_offload_numel=1, overlap=mode, **kw)
        opt.watch(net)
        assert counts() != before  # hooked while it lives
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        del opt  # no close(): dropped
    assert counts() == before


def test_a_signal_in_backward_with_speculative_updates_is_refused_or_taken_whole():
    """speculate=True (a max_grad_norm the norm never reaches, so the reference's unclipped
    AdamW is the run's): a SIGALRM anywhere in backward is refused or taken whole, and a
    discard after it rolls the speculative updates back (the reference takes that state)."""
    for seed, fraction in [(1, 1.0), (2, 0.5), (3, 1.0)]:  # here: discard, load and stepped
        assert signal_backward(seed, fraction, iters=5, grads_final=False,
                                      max_grad_norm=1e9, speculate=True)  # fmt: skip
