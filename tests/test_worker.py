"""The CPU worker thread: flush-to-zero on its own pool, thread counts, errors, timeouts, lifetime."""

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from oracle import assert_bitwise

import offloadopt.link.worker as worker_mod
from offloadopt import HybridAdamW
from offloadopt.link.worker import WorkerError


def subnormal_case(n=1 << 16, seed=0):
    """Params of normal size, grads near 1e-20 (grad**2 is subnormal), and ``exp_avg`` stuck at
    subnormal values on part of the tensor: the inputs where flush-to-zero changes results."""
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-20
    exp_avg = torch.zeros(n)
    exp_avg[: n // 2] = 1e-39 * torch.rand(n // 2, generator=g)  # subnormal fp32 (< 1.18e-38)
    return param, grad, exp_avg


def fused_reference(param, grad, exp_avg, steps, flush: bool):
    """torch's fused AdamW alone, run ``steps`` times in a thread of its own with flush-to-zero
    on or off and one OpenMP thread (no pool whose mode could differ)."""
    out = {}

    def run():
        torch.set_flush_denormal(flush)
        torch.set_num_threads(1)
        p, m, v, s = param.clone(), exp_avg.clone(), torch.zeros_like(param), torch.zeros(())
        for _ in range(steps):
            s += 1
            torch._fused_adamw_([p], [grad.clone()], [m], [v], [], [s], amsgrad=False, lr=1e-3,
                                beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8, maximize=False)  # fmt: skip
        out.update(p=p, m=m, v=v)

    before = torch.get_num_threads()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    torch.set_num_threads(before)  # set_num_threads also set the default for new threads
    return out


def hybrid_run(param, grad, exp_avg, steps, **kw):
    p = torch.nn.Parameter(param.clone())
    opt = HybridAdamW([p], lr=1e-3, min_offload_numel=1, cpu_threads=2, **kw)
    sd = opt.state_dict()
    sd["state"] = {0: {"step": 0.0, "exp_avg": exp_avg, "exp_avg_sq": torch.zeros_like(param)}}
    opt.load_state_dict(sd)  # the subnormal exp_avg, planted
    assert opt.is_offloaded(p)
    for _ in range(steps):
        p.grad = grad.clone()
        opt.step()
    state = opt.state[p]
    opt.close()
    return {"p": p.detach(), "m": state["exp_avg"], "v": state["exp_avg_sq"]}


def test_flush_denormal_matches_torch_kernel_under_flush_to_zero():
    """The worker's whole pool (2 threads) runs with FTZ/DAZ: the result equals torch's kernel
    run under flush-to-zero, bitwise, and differs from it run without (so the test can fail)."""
    case = subnormal_case()
    got = hybrid_run(*case, steps=3, flush_denormal=True)
    ftz = fused_reference(*case, steps=3, flush=True)
    plain = fused_reference(*case, steps=3, flush=False)
    assert_bitwise([got["p"], got["m"], got["v"]], [ftz["p"], ftz["m"], ftz["v"]], "ftz")
    assert not torch.equal(ftz["v"], plain["v"])  # grad**2 flushed to zero, or kept subnormal


def test_flush_denormal_false_stays_bitwise_torch_on_subnormal_data():
    case = subnormal_case()
    got = hybrid_run(*case, steps=3, flush_denormal=False)
    plain = fused_reference(*case, steps=3, flush=False)
    assert_bitwise([got["p"], got["m"], got["v"]], [plain["p"], plain["m"], plain["v"]], "plain")


def test_training_thread_keeps_its_floating_point_mode_and_thread_count():
    before = torch.get_num_threads()
    p = torch.nn.Parameter(torch.randn(4096))
    opt = HybridAdamW([p], min_offload_numel=1, cpu_threads=1)
    p.grad = torch.randn(4096)
    opt.step()
    assert torch.get_num_threads() == before
    assert torch.tensor([1e-40]).mul(1.0).item() != 0.0  # still subnormal here: no FTZ
    seen = []
    opt.debug.pipeline.worker_hook = lambda b: seen.append(torch.get_num_threads())
    opt.step()
    assert seen == [1] and opt.stats["cpu_threads"] == 1
    opt.close()


def test_default_threads_are_the_affinity_over_local_ranks_minus_a_busy_training_thread(
    monkeypatch,
):
    from offloadopt.link import worker

    monkeypatch.setattr(worker, "usable_cpus", lambda: list(range(16)))
    monkeypatch.setattr(worker, "_siblings", lambda cpu: {cpu})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert worker.default_cpu_threads(training_thread_busy=True) == 3
    assert worker.default_cpu_threads(training_thread_busy=False) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert worker.default_cpu_threads(training_thread_busy=True) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert worker.default_cpu_threads(training_thread_busy=True) == 15
    assert worker.default_cpu_threads(training_thread_busy=False) == 16
    plan = worker.plan_cpus(None, None, training_thread_busy=False)
    assert plan.threads == 16  # step mode: the training thread waits while the worker runs
    assert plan.cpus == list(range(16)) and plan.training == []


def test_the_worker_leaves_the_training_thread_a_core_and_its_siblings(monkeypatch):
    from offloadopt.link import worker

    monkeypatch.setattr(worker, "usable_cpus", lambda: list(range(16)))
    monkeypatch.setattr(
        worker, "_siblings", lambda cpu: {cpu, cpu + 8} if cpu < 8 else {cpu, cpu - 8}
    )
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    plan = worker.plan_cpus(None, None, training_thread_busy=True)
    assert plan.training == [0, 8] and plan.cpus == [c for c in range(16) if c not in (0, 8)]
    assert plan.threads == 14
    assert plan.describe() == "14 threads on CPUs 1-7,9-15 (CPUs 0,8 left to the training thread)"
    # two local ranks: each its slice, less its first core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(worker, "_siblings", lambda cpu: {cpu})
    monkeypatch.setenv("LOCAL_RANK", "1")
    plan = worker.plan_cpus(None, None, training_thread_busy=True)
    assert plan.training == [8] and plan.cpus == list(range(9, 16))
    # chosen by the caller; "any": unpinned, as before
    assert worker.plan_cpus([3, 2, 3], None, training_thread_busy=True).cpus == [2, 3]
    assert worker.plan_cpus([3, 2], 5, training_thread_busy=True).threads == 5
    any_ = worker.plan_cpus("any", None, training_thread_busy=True)
    assert any_.cpus is None and any_.threads == 7  # 16 // 2 ranks - 1


def _threads_on(cpus: str) -> int:
    """Threads of this process whose CPU affinity is exactly ``cpus`` (Linux's list form)."""
    import glob

    n = 0
    for status in glob.glob("/proc/self/task/*/status"):
        try:
            text = open(status).read()
        except OSError:
            continue
        n += any(ln.split()[-1] == cpus for ln in text.splitlines()
                 if ln.startswith("Cpus_allowed_list"))  # fmt: skip
    return n


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
def test_the_worker_and_its_pool_run_on_their_cpus():
    """The worker's thread and the OpenMP threads of its pool (made after it set its affinity)
    run on worker_cpus; the training thread keeps its own affinity."""
    last = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    params = [torch.nn.Parameter(torch.randn(1 << 16))]
    opt = HybridAdamW(params, min_offload_numel=1, worker_cpus=[last], cpu_threads=2)
    params[0].grad = torch.randn(1 << 16)
    seen = []
    opt.debug.pipeline.worker_hook = lambda b: seen.append(os.sched_getaffinity(0))
    opt.step()
    assert seen == [{last}]
    assert _threads_on(str(last)) >= 2  # the worker and its pool's second thread
    assert os.sched_getaffinity(0) == before
    assert opt.stats["worker_cpus"] == str(last) and opt.stats["cpu_threads"] == 2
    opt.close()


def test_numpy_ints_are_taken_for_the_thread_count_and_the_cpus():
    import numpy as np

    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    p = torch.nn.Parameter(torch.randn(64))
    opt = HybridAdamW([p], min_offload_numel=1, cpu_threads=np.int64(1),
                      worker_cpus=[np.int64(cpu)])  # fmt: skip
    p.grad = torch.randn(64)
    opt.step()
    assert opt.stats["cpu_threads"] == 1 and opt.stats["worker_cpus"] == str(cpu)
    opt.close()


def test_the_stats_tell_an_unpinned_worker_from_none():
    p = torch.nn.Parameter(torch.randn(64))
    for fraction, expected in ((1.0, "any"), (0.0, "")):
        opt = HybridAdamW([p], min_offload_numel=1, worker_cpus="any", offload_fraction=fraction)
        p.grad = torch.randn(64)
        opt.step()
        assert opt.stats["worker_cpus"] == expected, fraction
        opt.close()


def test_more_threads_than_the_pinned_cpus_warns_naming_them():
    with pytest.warns(
        UserWarning, match=r"cpu_threads=3 is more than the 1 CPU\(s\) of worker_cpus \(0\)"
    ):
        opt = HybridAdamW([torch.nn.Parameter(torch.randn(64))], min_offload_numel=1,
                          worker_cpus=[0], cpu_threads=3)  # fmt: skip
        opt.close()


@pytest.mark.parametrize("bad", [[], ["0"], [-1], 7, "all", [True], [10**6], "np"])
def test_bad_worker_cpus_are_refused_naming_the_value(bad):
    if bad == "np":  # an array's == "any" is elementwise: it raised numpy's truth-value error
        import numpy as np

        bad = np.array([0, 1])
    with pytest.raises(ValueError, match="Invalid worker_cpus"):
        HybridAdamW([torch.nn.Parameter(torch.randn(64))], worker_cpus=bad)


@pytest.mark.parametrize("bad", [100_000, 2**31])
def test_a_thread_count_no_machine_could_run_is_refused_before_the_worker_starts(bad):
    """cpu_threads=100000 crashed the process (SIGSEGV in libgomp, inside the worker's
    torch.set_num_threads) and 2**31 hung the constructor for 60 s: now a ValueError."""
    most = max(64, 4 * os.cpu_count())
    with pytest.raises(
        ValueError, match=rf"Invalid cpu_threads: {bad} \(expected None or an int in 1\.\.{most}"
    ):
        HybridAdamW([torch.nn.Parameter(torch.randn(64))], min_offload_numel=1, cpu_threads=bad)


def test_a_worker_that_fails_to_start_raises_at_once_naming_the_cause(monkeypatch):
    """Any failure before the worker's loop (its affinity, its thread count) is raised by the
    constructor with its cause, not after the 60 s start timeout as a WaitTimeout."""

    def refuse(pid, cpus):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(worker_mod.os, "sched_setaffinity", refuse)
    with pytest.raises(RuntimeError, match=r"did not start \(2 threads, CPUs \[0\]\): OSError"):
        worker_mod.Worker(2, flush_denormal=False, timeout_s=120, cpus=[0])


def test_omp_num_threads_1_is_said_once_and_few_threads_warn(monkeypatch, caplog):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(worker_mod, "usable_cores", lambda: 16)
    with caplog.at_level(logging.WARNING, logger="offloadopt"):
        opt = HybridAdamW([torch.nn.Parameter(torch.randn(64))], min_offload_numel=1, cpu_threads=8)
    assert "OMP_NUM_THREADS=1" in caplog.text and "8 threads" in caplog.text
    opt.close()
    with pytest.warns(UserWarning, match="1 threads x 1 local ranks, far below the 16 cores"):
        opt = HybridAdamW([torch.nn.Parameter(torch.randn(64))], min_offload_numel=1, cpu_threads=1)
    opt.close()


def test_an_error_in_the_worker_reaches_the_caller_naming_the_bucket_and_the_next_step_works():
    p = torch.nn.Parameter(torch.randn(1000))
    ref = torch.nn.Parameter(p.detach().clone())
    opt = HybridAdamW([p], min_offload_numel=1, bucket_nbytes=4 * 256)
    torch_opt = torch.optim.AdamW([ref], fused=True)
    assert len(opt.buckets) == 4

    def fail(bucket):
        if bucket.index == 2:
            raise RuntimeError("injected")

    opt.debug.pipeline.worker_hook = fail
    p.grad = torch.randn(1000)
    with pytest.raises(
        WorkerError, match=r"BucketError: bucket 2 \(1 params from group0.param0.*injected"
    ):
        opt.step()
    opt.debug.pipeline.worker_hook = None  # every slot came back: the pipeline is not stuck
    opt.load_state_dict(torch_opt.state_dict())
    for _ in range(2):
        ref.grad = p.grad = torch.randn(1000)
        opt.step()
        torch_opt.step()
    opt.close()


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_an_error_queuing_a_copy_reaches_the_caller_and_the_next_step_works(direction):
    """A failure queuing bucket 2's D2H or H2D on the worker ends the step with that error,
    every staging slot comes back, and after a reload training goes on bitwise torch's."""
    p = torch.nn.Parameter(torch.randn(1000))
    ref = torch.nn.Parameter(p.detach().clone())
    opt = HybridAdamW([p], min_offload_numel=1, bucket_nbytes=4 * 256)
    torch_opt = torch.optim.AdamW([ref], fused=True)
    (tr,) = opt.debug.pipeline.transfers.values()
    name = f"start_{direction}"
    original = getattr(tr, name)

    def fail(b, *args, **kwargs):
        if b.index == 2:
            raise RuntimeError(f"injected into the {direction}")
        return original(b, *args, **kwargs)

    setattr(tr, name, fail)
    p.grad = torch.randn(1000)
    with pytest.raises(WorkerError, match=f"injected into the {direction}"):
        opt.step()
    setattr(tr, name, original)
    assert tr.ring._free.qsize() == len(tr.ring.slots)  # every slot came back
    with torch.no_grad():
        p.copy_(ref)  # the buckets before the failure were updated: back to the last good step
    opt.load_state_dict(torch_opt.state_dict())
    for _ in range(2):
        ref.grad = p.grad = torch.randn(1000)
        opt.step()
        torch_opt.step()
    assert_bitwise([p], [ref])
    opt.close()


@pytest.mark.slow
def test_every_wait_has_a_timeout_that_names_what_it_waited_for():
    p = torch.nn.Parameter(torch.randn(1000))
    opt = HybridAdamW([p], min_offload_numel=1, bucket_nbytes=4 * 256, timeout_s=0.2)
    opt.debug.pipeline.worker_hook = lambda b: time.sleep(0.5)
    p.grad = torch.randn(1000)
    t = time.perf_counter()
    with pytest.raises(
        TimeoutError,
        match=r"waited 0.2 s for the worker to finish the offloaded update of this step",
    ):
        opt.step()
    assert time.perf_counter() - t < 2.0
    opt.close()


def test_close_and_context_manager_stop_the_worker():
    p = torch.nn.Parameter(torch.randn(100))
    with HybridAdamW([p], min_offload_numel=1) as opt:
        p.grad = torch.randn(100)
        opt.step()
        worker = opt.debug.pipeline.worker
        threads = [t for t in (worker._thread, worker._update_thread) if t is not None]
        assert all(t.is_alive() for t in threads)
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="is closed .opt.close.. was called"):
        opt.step()
    assert opt.state_dict()["state"][0]["step"] == 1  # the state stays readable


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "del", "exception", "open-step"])
def test_the_process_exits_cleanly_with_a_live_optimizer(how):
    code = textwrap.dedent(f"""
        import torch, offloadopt
        p = torch.nn.Parameter(torch.randn(10000))
        opt = offloadopt.HybridAdamW([p], min_offload_numel=1, overlap="backward", grads_final=True)
        p.grad = torch.randn(10000)
        opt.step()
        if {how!r} == "open-step":  # a backward started a step that never gets its step()
            (p * 2).sum().backward()
        if {how!r} == "del":
            del opt
        if {how!r} == "exception":
            raise SystemExit(3)
        print("done")
    """)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == (3 if how == "exception" else 0), r.stderr
    assert time.perf_counter() - t < 20  # no wait for a worker blocked on an open step
    assert r.stderr == "" or "Traceback" not in r.stderr


def test_a_dataloader_that_forks_workers_still_works():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ref = torch.nn.Linear(64, 64)
    ref.load_state_dict(model.state_dict())
    opt = HybridAdamW(model.parameters(), min_offload_numel=1)
    torch_opt = torch.optim.AdamW(ref.parameters(), fused=True)
    data = torch.utils.data.TensorDataset(torch.randn(32, 64))
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, num_workers=2, multiprocessing_context="fork"
    )
    for _epoch in range(2):
        for (x,) in loader:
            for m, o in ((model, opt), (ref, torch_opt)):
                m(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
    assert_bitwise(list(model.parameters()), list(ref.parameters()), "after forked loaders")
    opt.close()


def test_an_exception_from_any_signal_handler_leaves_nothing_writing_after_it():
    """A handler that raises (a SIGALRM watchdog) while step() waits for the worker: once the
    caller has the exception the worker writes nothing more, so a checkpoint loaded at once
    stays loaded."""
    import copy
    import signal

    params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(8)]
    opt = HybridAdamW(params, min_offload_numel=1, bucket_nbytes=4 * 4096)
    for p in params:
        p.grad = torch.randn(4096)
    opt.step()
    ckpt = copy.deepcopy(opt.state_dict())
    opt.debug.pipeline.worker_hook = lambda b: time.sleep(0.05)

    def watchdog(signum, frame):
        raise TimeoutError("watchdog")

    previous = signal.signal(signal.SIGALRM, watchdog)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.12)
        with pytest.raises(TimeoutError, match="watchdog"):
            opt.step()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    opt.load_state_dict(ckpt)
    time.sleep(0.3)  # a worker still running would write in this window
    sd = opt.state_dict()
    for i, entry in ckpt["state"].items():
        for k, v in entry.items():
            torch.testing.assert_close(sd["state"][i][k], v, rtol=0, atol=0)
    opt.close()
