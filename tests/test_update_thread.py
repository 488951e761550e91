"""The worker's update thread (offloadopt/link/worker.py, pipeline.py): each bucket's update runs
there while the worker launches the copies of the buckets around it. It is opt-in
(``OFFLOADOPT_UPDATE_THREAD=link``: where the copies cross to a GPU); ``always`` runs the
same schedule here, without one."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from fault_failures import worker_error
from fault_probe import MODES, Probe, Reference, hybrid, train

from offloadopt import HybridAdamW
from offloadopt.link import worker as worker_mod
from offloadopt.link.worker import CpuPlan, Worker
from offloadopt.place import placer


@pytest.fixture
def always(monkeypatch):
    monkeypatch.setenv("OFFLOADOPT_UPDATE_THREAD", "always")
    # two threads on any CPU in every mode: with a core left to the training thread (backward,
    # delayed), this 2-CPU machine's plan has one thread, and one has none to spare
    monkeypatch.setattr(placer, "plan_cpus", lambda option, threads, **_: CpuPlan(None, 2, []))


def _on_thread():
    return threading.current_thread().name, torch.get_num_threads()


def test_updates_run_on_their_own_thread_with_one_thread_fewer():
    w = Worker(3, flush_denormal=True, overlap=True)
    try:
        seen = w.submit(lambda: None, "probe")  # the worker's own thread and count
        where = []
        job = w.submit(lambda: where.append((_on_thread(), w.run_update(_on_thread, "u"))), "j")
        job.wait(30)
        seen.wait(30)
        (worker_side, update_job) = where[0]
        update_job.result()
        assert worker_side == ("offloadopt-worker", 1)
        assert update_job.value == ("offloadopt-update", 2)
    finally:
        w.close()
    assert not w._thread.is_alive() and not w._update_thread.is_alive()


def test_without_the_update_thread_an_update_runs_on_the_worker_at_once():
    for overlap, threads in ((False, 2), (True, 1)):  # one thread: nothing to spare
        w = Worker(threads, flush_denormal=True, overlap=overlap)
        try:
            assert w._update_thread is None and not w.overlap
            out = []
            w.submit(lambda w=w, out=out: out.append(w.run_update(_on_thread, "u")), "j").wait(30)
            assert out[0].done.is_set()  # ran before run_update returned
            assert out[0].value == ("offloadopt-worker", threads)
        finally:
            w.close()


def test_updates_run_in_order_and_an_error_comes_back_as_raised():
    w = Worker(2, flush_denormal=True, overlap=True)
    order, jobs = [], []

    def fail():
        raise KeyError("injected")

    def hand_on():
        jobs.extend(w.run_update(lambda i=i: order.append(i), f"u{i}") for i in range(20))
        jobs.append(w.run_update(fail, "bad"))

    try:
        w.submit(hand_on, "j").wait(30)
        for job in jobs[:-1]:
            job.result()
        with pytest.raises(KeyError, match="injected"):  # not wrapped
            jobs[-1].result()
        assert order == list(range(20))
    finally:
        w.close()


def test_a_cpu_optimizer_has_no_update_thread_under_link(monkeypatch):
    """Under "link" only where the copies cross to a GPU (the placer says whether they do)."""
    monkeypatch.setenv("OFFLOADOPT_UPDATE_THREAD", "link")
    p = torch.nn.Parameter(torch.randn(100))
    with HybridAdamW([p], min_offload_numel=1) as opt:
        p.grad = torch.randn(100)
        opt.step()
        assert opt.debug.pipeline.worker._update_thread is None


@pytest.mark.parametrize(
    ("env", "cross", "has_thread"),
    [(None, True, False), ("", True, False), ("never", True, False), ("link", True, True),
     ("link", False, False), ("always", False, True)],
)  # fmt: skip
def test_the_environment_chooses_the_update_thread_off_by_default(monkeypatch, env, cross,
                                                                  has_thread):  # fmt: skip
    if env is None:
        monkeypatch.delenv("OFFLOADOPT_UPDATE_THREAD", raising=False)
    else:
        monkeypatch.setenv("OFFLOADOPT_UPDATE_THREAD", env)
    w = worker_mod.start_worker(CpuPlan(None, 2, []), False, lambda key, msg: None, cross)
    try:
        assert w.overlap is has_thread and (w._update_thread is not None) is has_thread
    finally:
        w.close()


def test_a_bad_update_thread_setting_is_refused_by_the_constructor(monkeypatch):
    monkeypatch.setenv("OFFLOADOPT_UPDATE_THREAD", "yes")
    p = torch.nn.Parameter(torch.randn(100))
    with pytest.raises(ValueError, match=r"OFFLOADOPT_UPDATE_THREAD='yes'; expected 'link'"):
        HybridAdamW([p], min_offload_numel=1)


@pytest.mark.parametrize("mode", MODES)
def test_with_the_update_thread_training_is_torchs_bitwise(always, mode):
    model = Probe(0)
    opt, ref = hybrid(model, 1.0, mode), Reference(model)
    names = set()
    train(model, opt, ref, range(1))  # the pipeline exists from the first step
    pipe = opt.debug.pipeline
    assert pipe.worker._update_thread is not None and len(opt.buckets) >= 3
    pipe.worker_hook = lambda bucket: names.add(threading.current_thread().name)
    train(model, opt, ref, range(1, 4))
    assert names == {"offloadopt-update"}
    opt.close()


@pytest.mark.parametrize("recover", ["load", "discard"])
@pytest.mark.parametrize("mode", MODES)
def test_a_failed_update_leaves_each_bucket_updated_and_sent_or_untouched(always, mode, recover):
    """Found by the fault suite with the update thread on: the update handed on behind a failed
    one ran, and after ``discard_failed_step()`` its params kept their old weights beside the
    new master and moments (weights differed from the reference). Now a failed update stops
    the ones behind it, and one that ran anyway has its H2D queued."""
    for nth in (1, 2):
        assert worker_error(nth, mode, 1.0, nth, recover) == recover


def test_an_optimizer_dropped_after_a_failed_step_stops_its_threads(always):
    """Found in review: an idle worker thread held its last job, and a failed job's error holds
    its traceback's frames, so an optimizer dropped after a failed step was never collected and
    its threads (and pinned buffers) stayed."""
    model = Probe(0)
    opt, ref = hybrid(model, 1.0, "step"), Reference(model)
    train(model, opt, ref, range(1))
    w = opt.debug.pipeline.worker
    threads = [w._thread, w._update_thread]
    del w

    def failing(work, grads):
        raise RuntimeError("injected")

    opt.debug.updater.update_bucket = failing
    opt.zero_grad()
    model(1).backward()
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    del opt.debug.updater.update_bucket
    opt.discard_failed_step()
    del opt
    gc.collect()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
