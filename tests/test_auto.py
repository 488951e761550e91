"""offload_fraction="auto": the first steps are measured at the probe fraction, the cost model
picks a fraction, the state moves there without loss, and the pick is measured."""

import contextlib
import re
import time
import warnings

import pytest
import torch

from offloadopt import HybridAdamW
from offloadopt.harness.gpt import GPT, GPTConfig
from offloadopt.place import auto, costmodel

CFG = GPTConfig(n_layer=3, n_head=2, n_embd=64, vocab_size=128, block_size=32)
# probe (the first step unmeasured), baseline at fraction 0 (the step after the move and the
# settling ones unmeasured), then the choice's and each correction's verify and steady state
_MOVED = 1 + auto.SETTLE_STEPS + auto.MEASURED_STEPS
STEPS = (1 + auto.MEASURED_STEPS + _MOVED
         + (1 + auto.CORRECTIONS) * (_MOVED + auto.STEADY_AFTER + auto.MEASURED_STEPS) + 2)  # fmt: skip


def model():
    torch.manual_seed(0)
    return GPT(CFG)


def batches(steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        seq = torch.randint(0, CFG.vocab_size, (4, CFG.block_size + 1), generator=g)
        yield seq[:, :-1], seq[:, 1:]


def train(m, opt, steps=STEPS, before_step=None):
    for x, y in batches(steps):
        m(x, y)[1].backward()
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, dict(overlap="backward", grads_final=True)])
def test_auto_moves_the_state_and_trains_bitwise_as_torch(kw):
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto", **kw)  # fmt: skip
    assert opt.offload_fraction == auto.PROBE_FRACTION and opt.placement_choice is None
    got = train(m, opt)
    ref_m = model()
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True)
    want = train(ref_m, ref)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    choice = opt.placement_choice
    assert choice["set_by"] == "auto" and choice["fraction"] == opt.offload_fraction
    assert choice["measured_step_ms"] > 0 and choice["probe_measured_step_ms"] > 0
    assert choice["measured_step_ms_at_0"] > 0  # the baseline: fraction 0 measured, not predicted
    assert not opt.debug.auto.active
    # The state moved: the placement is the chosen fraction's, and the state is torch's.
    assert {p.offloaded for p in opt.placement} <= {True, False}
    ref_state = ref.state_dict()["state"]
    for i, entry in opt.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], ref_state[i][key]), (i, key)


def test_the_choice_is_the_largest_fraction_the_model_predicts_within_the_tolerance():
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, offload_fraction="auto",
                      auto_tolerance=0.5)  # fmt: skip
    train(m, opt)
    choice = opt.placement_choice
    meas = costmodel.Measurements(**choice["measurements"])
    zero = costmodel.predict(meas, 0.0, "step").step_ms
    aim = 1 + 0.5 * auto.CHOICE_MARGIN  # the choice aims inside the tolerance
    assert choice["predicted_step_ms"] <= aim * zero + 1e-9
    # The model's choice; a measured period above the limit (this machine's timing noise)
    # moved it down since, and corrections[0] keeps it (a flake in a loaded CI run).
    chosen = choice["corrections"][0]["fraction"] if choice["corrections"] else choice["fraction"]
    above = [f / 100 for f in range(101) if f / 100 > chosen]
    assert all(costmodel.predict(meas, f, "step").step_ms > aim * zero for f in above)
    # The probe's own period is kept beside its prediction from the same measurements.
    at_probe = costmodel.predict(meas, choice["probe_fraction"], "step").step_ms
    assert choice["probe_predicted_step_ms"] == pytest.approx(at_probe)


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a long GPU-like backward the worker can hide behind."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    sleep_s = 0.08

    @staticmethod
    def backward(ctx, g):
        time.sleep(
            _SlowBackward.sleep_s
        )  # releases the GIL, as a GPU's backward leaves the host free
        return g


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))

    def forward(self, x):
        x = _SlowBackward.apply(x)  # its backward runs last: after every layer's grad
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["step", "backward"])
def test_work_that_hides_behind_backward_is_offloaded_and_work_that_shows_is_not(mode):
    """A worker that takes 4 ms per bucket (6 buckets at fraction 1): behind an 80 ms backward
    in backward mode it hides, so auto offloads everything; in step mode each bucket adds to
    the step (5% of it is 4 ms), so auto keeps the state on the device."""
    # One OpenMP thread each: on 2 cores the training thread's "device" update (torch's CPU
    # kernel standing in for the GPU's) otherwise waits up to 10 ms for the worker's threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    net = _Net()
    kw = dict(overlap="backward", grads_final=True) if mode == "backward" else {}
    opt = HybridAdamW(net.parameters(), lr=1e-3, min_offload_numel=1, cpu_threads=1,
                      bucket_nbytes=64 * 65 * 4, offload_fraction="auto", **kw)  # fmt: skip
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.004)
    try:
        for _ in range(STEPS):
            net(torch.randn(8, 64, requires_grad=True)).backward()  # the slow backward runs
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    choice = opt.placement_choice
    if mode == "backward":
        assert choice["fraction"] >= 0.9, choice
    else:
        assert choice["fraction"] <= 0.1, choice
    assert choice["measured_step_ms"] < 1.3 * choice["probe_measured_step_ms"] or mode == "backward"


def accumulate(net, opt, micro_steps, x):
    """One optimizer step of ``micro_steps`` forward and backward passes, the non-final ones
    inside ``opt.accumulating()``."""
    for micro in range(micro_steps):
        with opt.accumulating() if micro < micro_steps - 1 else contextlib.nullcontext():
            net(x).backward()
    opt.step()
    opt.zero_grad()


def test_auto_counts_the_micro_steps_of_accumulation_for_the_cost_model(monkeypatch):
    """Issue 47: auto's windows span whole optimizer steps (all their micro-steps), and the cost
    model is told how many micro-steps that is (backward mode's updates hide behind the last
    one only). Before, a step of 3 micro-steps was costed as one forward+backward."""
    monkeypatch.setattr(_SlowBackward, "sleep_s", 0.0)
    net = _Net()
    opt = HybridAdamW(net.parameters(), lr=1e-3, min_offload_numel=1, bucket_nbytes=64 * 65 * 4,
                      offload_fraction="auto", overlap="backward", grads_final=True)  # fmt: skip
    for _ in range(1 + auto.MEASURED_STEPS):  # the probe: its first step, then the measured ones
        accumulate(net, opt, 3, torch.randn(8, 64))
    choice = opt.placement_choice
    assert choice["measurements"]["micro_steps"] == 3, choice["measurements"]
    m = costmodel.Measurements(**choice["measurements"])
    sweep = {f: costmodel.predict(m, f, "backward").step_ms for f in choice["predicted_sweep_ms"]}
    assert choice["predicted_sweep_ms"] == sweep and m.micro_steps == 3


@pytest.mark.slow
def test_with_accumulation_work_that_hides_behind_a_whole_step_but_not_one_micro_step_shows(
    monkeypatch,
):
    """4 micro-steps of an 30 ms backward each; the worker takes 10 ms per bucket, 60 ms at
    fraction 1. In backward mode the updates start in the last micro-step's backward: 30 ms of
    the 60 hide and the rest shows (at fraction 1 the step grows by about a fifth), so auto
    keeps part of the state on the device. Costed as if the whole step's 120 ms hid the work,
    it chose fraction 1 and its corrections ended at 0.9, over its limit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as test_work_that_hides_behind_backward_...: one thread each
    monkeypatch.setattr(_SlowBackward, "sleep_s", 0.03)
    net = _Net()
    opt = HybridAdamW(net.parameters(), lr=1e-3, min_offload_numel=1, cpu_threads=1,
                      bucket_nbytes=64 * 65 * 4, offload_fraction="auto", overlap="backward",
                      grads_final=True)  # fmt: skip
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.01)
    try:
        for _ in range(STEPS):
            accumulate(net, opt, 4, torch.randn(8, 64, requires_grad=True))
    finally:
        torch.set_num_threads(threads)
    choice = opt.placement_choice
    assert choice["measurements"]["micro_steps"] == 4
    assert choice["fraction"] <= 0.75, choice


def test_with_a_budget_auto_keeps_the_budgets_choice_and_measures_it():
    m = model()
    n = sum(p.numel() for p in m.parameters())
    budget = 8 * n + 4 * 2**14 + 4 * n  # weights and grads, staging, half the state
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto", max_gpu_memory=budget, activation_bytes=0)  # fmt: skip
    train(m, opt)
    choice = opt.placement_choice
    assert 0.45 <= choice["fraction"] <= 0.55 and choice["predicted_gpu_bytes"] <= budget
    assert choice["set_by"] == "auto" and choice["probe_fraction"] == choice["fraction"]
    assert choice["measured_step_ms"] > 0 and opt.offload_fraction == choice["fraction"]


def test_the_callers_own_fraction_ends_auto():
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, offload_fraction="auto")
    train(m, opt, steps=2)
    opt.set_offload_fraction(0.25)
    train(m, opt, steps=STEPS)
    assert opt.offload_fraction == 0.25 and not opt.debug.auto.active
    assert "set_offload_fraction" in opt.debug.auto.choice["cancelled"]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(offload_fraction="automatic"), "Invalid offload_fraction: 'automatic'"),
        (dict(offload_fraction="auto", auto_tolerance=-0.1), "Invalid auto_tolerance: -0.1"),
        (dict(offload_fraction="auto", auto_tolerance=float("nan")), "Invalid auto_tolerance"),
        (dict(offload_fraction=0.5, auto_tolerance=0.1), "without offload_fraction='auto'"),
        (dict(offload_fraction=0.5, max_gpu_memory="1GB"), "offload_fraction='auto'"),
        (dict(offload_fraction="auto", overlap="delayed"), "which params train on weights one"),
        (dict(activation_bytes="1MB"), "without max_gpu_memory does nothing"),
        (dict(max_host_memory="1GB"), "without max_gpu_memory does nothing"),
    ],
)
def test_bad_auto_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        HybridAdamW(model().parameters(), **kw)


def test_auto_is_refused_with_several_ranks(monkeypatch):
    import offloadopt.optim

    monkeypatch.setattr(offloadopt.optim, "world_size", lambda: 2)
    with pytest.raises(ValueError, match="'auto' with 2 ranks"):
        HybridAdamW(model().parameters(), offload_fraction="auto")


def test_measurements_come_from_the_step_figures():
    stats = dict(cpu_update_ms=30.0, d2h_ms=10.0, d2h_nbytes=4e8, h2d_ms=8.0, h2d_nbytes=4e8,
                 worker_ms=60.0, d2h_wait_ms=20.0, buckets=5)  # fmt: skip
    m = auto.measurements(fwd_bwd_ms=100.0, device_update_ms=5.0, stats=stats,
                          device_numel=10**8, offloaded_numel=10**8, bucket_nbytes=2**26)  # fmt: skip
    assert m.params == 2 * 10**8 and m.fwd_bwd_ms == 100.0
    assert m.cpu_ns_per_param == pytest.approx(0.3) and m.device_ns_per_param == pytest.approx(0.05)
    assert m.d2h_gbps == pytest.approx(40.0) and m.h2d_gbps == pytest.approx(50.0)
    assert m.bucket_overhead_ms == pytest.approx((60 - 20 - 30) / 5)
    # The worker's waits for buckets backward had not announced yet are idle, not overhead.
    fed_late = auto.measurements(fwd_bwd_ms=100.0, device_update_ms=5.0,
                                 stats=dict(stats, worker_ms=70.0, feed_wait_ms=10.0),
                                 device_numel=10**8, offloaded_numel=10**8, bucket_nbytes=2**26)  # fmt: skip
    assert fed_late.bucket_overhead_ms == pytest.approx((70 - 20 - 10 - 30) / 5)
    with pytest.raises(ValueError, match="no param is offloaded"):
        auto.measurements(fwd_bwd_ms=1.0, device_update_ms=0.0, stats=stats, device_numel=10,
                          offloaded_numel=0, bucket_nbytes=2**26)  # fmt: skip


def test_backward_mode_without_grads_final_costs_as_step_mode():
    assert auto.cost_mode("backward", False, None) == "step"
    assert auto.cost_mode("backward", True, None) == "backward"
    assert auto.cost_mode("backward", False, 1.0) == "backward"
    assert auto.cost_mode("delayed", False, None) == "delayed"


def test_the_probe_holds_backward_modes_updates_for_step_then_lets_them_start():
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto", auto_tolerance=10.0, overlap="backward",
                      grads_final=True)  # fmt: skip
    fed = []
    train(m, opt, before_step=lambda: fed.append(len(opt.debug.step.fed) if opt.debug.step else 0))
    probe = 1 + auto.MEASURED_STEPS  # the first step, unmeasured, and the measured ones
    base = probe + 1 + auto.SETTLE_STEPS + auto.MEASURED_STEPS  # fraction 0's: nothing to feed
    assert fed[:base] == [0] * base and all(n > 0 for n in fed[base:]), fed
    assert opt.offload_fraction > 0  # a tolerance of 1000% offloads


def test_with_release_grads_the_probe_does_not_hold_the_grads():
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto", overlap="backward", grads_final=True,
                      release_grads=True)  # fmt: skip
    fed = []
    train(m, opt, before_step=lambda: fed.append(len(opt.debug.step.fed) if opt.debug.step else 0))
    assert fed[1] > 0, fed  # the second backward (placed since construction) fed its buckets


@pytest.mark.slow
def test_a_verified_step_over_the_limit_moves_the_fraction_down(monkeypatch):
    """A model that promised too much (here: told to pick fraction 1 whatever it predicts)
    is corrected by the measured period: the state moves down, bitwise as ever. (Fraction 0's
    baseline is left out, so the limit is its prediction: a baseline measured on a loaded core
    could make the limit loose enough for fraction 1.)"""
    monkeypatch.setattr(auto.AutoFraction, "_baseline", lambda self, f: self._want(f, "verify"))
    monkeypatch.setattr(auto.costmodel, "largest_hidden",
                        lambda m, tol, mode: costmodel.predict(m, 1.0, mode))  # fmt: skip
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**12,
                      offload_fraction="auto")  # fmt: skip
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.002)  # each bucket costs 2 ms
    got = train(m, opt)
    choice = opt.placement_choice
    first = choice["corrections"][0]
    # What moves it down is the measured step above the limit (the prediction may be right:
    # the worker's 2 ms a bucket are measured in the probe; a loaded CI core once measured
    # 386 ms against a prediction of 390, above the limit all the same)
    limit = (1 + opt.debug.auto.tolerance) * choice["predicted_step_ms_at_0"]
    assert choice["measured_step_ms_at_0"] is None  # the limit is fraction 0's prediction
    assert first["fraction"] == 1.0 and first["measured_step_ms"] > limit
    assert choice["fraction"] < 1.0 and not opt.debug.auto.active and "within_tolerance" in choice
    ref_m = model()
    want = train(ref_m, torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True))
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.slow
def test_a_choice_left_above_the_limit_warns_with_what_was_kept(monkeypatch):
    """A fresh user's finding: on a noisy host auto ended at a fraction whose measured step was
    above its own limit (within_tolerance False) and said nothing. Now a warning names the
    fraction kept, the measured step and the limit. (Forced here: the model picks fraction 1
    whatever it predicts, each bucket costs 2 ms, and no correction is allowed; no baseline,
    as in the test above.)"""

    def baseline(self, f):  # fraction 0 "measured" at half its prediction: the limit's base
        self.choice["measured_step_ms_at_0"] = 0.5 * self.choice["predicted_step_ms_at_0"]
        return self._want(f, "verify")

    monkeypatch.setattr(auto.AutoFraction, "_baseline", baseline)
    monkeypatch.setattr(auto.costmodel, "largest_hidden",
                        lambda m, tol, mode: costmodel.predict(m, 1.0, mode))  # fmt: skip
    monkeypatch.setattr(auto, "CORRECTIONS", 0)
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**12,
                      offload_fraction="auto")  # fmt: skip
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.002)
    with pytest.warns(UserWarning, match=r"'auto' kept fraction 1: its step measured .* above the limit") as caught:  # fmt: skip
        train(m, opt)
    assert opt.placement_choice["within_tolerance"] is False
    assert [w.filename for w in caught if "auto" in str(w.message)] == [__file__]
    # the limit and the figure it is made from agree (the warning gave the prediction beside
    # a limit made from the measured fraction 0: "limit 1.2 ms (1.05 x ... predicted 1.3 ms)")
    text = next(str(w.message) for w in caught if "auto" in str(w.message))
    limit, factor, zero = re.search(r"limit ([\d.]+) ms \(([\d.]+) x fraction 0's ([\d.]+) ms\)",
                                    text).groups()  # fmt: skip
    # each figure is printed to 0.1 ms: the limit's rounding and fraction 0's (times the
    # factor) add up to 0.05 * (1 + factor); CI once saw 4.8 against 1.05 x 4.5
    slack = 0.05 * (1 + float(factor)) + 1e-9
    assert abs(float(limit) - float(factor) * float(zero)) <= slack, text
    assert float(zero) == round(opt.placement_choice["measured_step_ms_at_0"], 1), text


def test_the_probe_times_the_device_update_alone_then_overlaps_it_again(monkeypatch):
    """In the probe the device-resident update is launched before any bucket is fed (on a
    GPU the D2H then waits for it on its stream), so its time is fraction 0's; afterwards
    phase 2 starts first again."""
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto", auto_tolerance=10.0)  # fmt: skip
    calls = []
    feed, update = opt.debug.feeder.feed, opt.debug.updater.device_update
    monkeypatch.setattr(
        opt.debug.feeder, "feed", lambda *a, **k: (calls.append("feed"), feed(*a, **k))[1]
    )
    monkeypatch.setattr(opt.debug.updater, "device_update",
                        lambda *a, **k: (calls.append("device"), update(*a, **k))[1])  # fmt: skip
    orders = []

    def mark():
        orders.append(tuple(dict.fromkeys(calls)))
        calls.clear()

    train(m, opt, before_step=mark)
    mark()
    orders = orders[1:]  # each entry: the step before it
    probe = 1 + auto.MEASURED_STEPS
    assert all(o == ("device", "feed") for o in orders[:probe]), orders
    assert all(o[0] == "feed" for o in orders[probe:]), orders  # then device, if any is left


@pytest.mark.slow
def test_a_refused_set_offload_fraction_changes_nothing():
    """Refused (a backward announced grads), the caller's call must leave auto and its
    choice as they were."""
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto", overlap="backward", grads_final=True,
                      release_grads=True)  # fmt: skip
    x, y = next(batches(1))
    for when in ("probe", "after"):
        if when == "after":
            train(m, opt)
        before = opt.placement_choice
        m(x, y)[1].backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused: nothing replaced, nothing to say
            with pytest.raises(RuntimeError, match="between steps only"):
                opt.set_offload_fraction(0.2)
        assert opt.placement_choice == before and opt.debug.auto.choice.get("cancelled") is None
        assert opt.debug.auto.active == (when == "probe")
        opt.step()
        opt.zero_grad()


def test_steps_without_grads_are_no_samples():
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto")  # fmt: skip
    for i, (x, y) in enumerate(batches(STEPS)):
        m(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
        if i < 3:
            opt.step()  # no grads: it updates nothing
    x, y = next(batches(1))
    took = []
    for _ in range(3):
        t = time.perf_counter()
        m(x, y)[1].backward()
        took.append((time.perf_counter() - t) * 1e3)
    m.zero_grad()
    meas = opt.placement_choice["measurements"]
    # an empty step's window (from the step before, a few microseconds) is not forward+backward
    assert meas["cpu_ns_per_param"] > 0 and meas["fwd_bwd_ms"] > 0.3 * sorted(took)[1]


@pytest.mark.parametrize("where", ["baseline", "choice"])
def test_ctrl_c_at_the_end_of_autos_move_leaves_a_true_choice(monkeypatch, where):
    import os
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(auto.costmodel, "largest_hidden",
                        lambda m, tol, mode: costmodel.predict(m, 0.9, mode))  # fmt: skip
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto")  # fmt: skip
    real = type(opt.debug.placer).place

    def place_then_interrupt(placer, groups):
        real(placer, groups)
        to_zero = placer.fraction == 0.0  # the baseline's move, or the choice's
        if placer.auto.moving and to_zero == (where == "baseline"):
            os.kill(os.getpid(), signal.SIGINT)  # reaches its handler once the move is done

    monkeypatch.setattr(type(opt.debug.placer), "place", place_then_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            train(m, opt)
    finally:
        signal.signal(signal.SIGINT, before)
    want = 0.0 if where == "baseline" else 0.9
    assert opt.offload_fraction == want and opt.placement_choice["fraction"] == want
    assert opt.debug.auto.phase == ("baseline" if where == "baseline" else "verify")


@pytest.mark.slow
def test_nothing_to_offload_is_said_in_the_choice():
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=10**9, offload_fraction="auto")
    train(m, opt)
    assert "no param is offloaded" in opt.placement_choice["kept"] and not opt.debug.auto.active


def test_wait_module_without_a_watched_model_warns_once():
    import warnings

    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, offload_fraction=1.0,
                      overlap="backward", grads_final=True, wait="module")  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for x, y in batches(2):
            m(x, y)[1].backward()
            opt.step()
            opt.synchronize()  # what the warning asks for: the worker may still write weights
            opt.zero_grad()
    said = [w for w in seen if "no model given to opt.watch" in str(w.message)]
    assert len(said) == 1


def test_a_group_that_forces_its_placement_is_refused_with_auto():
    m = model()
    groups = [{"params": list(m.parameters())[:2], "offload": True},
              {"params": list(m.parameters())[2:]}]  # fmt: skip
    with pytest.raises(ValueError, match="'offload': True and offload_fraction='auto'"):
        HybridAdamW(groups, offload_fraction="auto")
    opt = HybridAdamW(list(m.parameters())[2:], offload_fraction="auto")
    with pytest.raises(ValueError, match="'offload': False and offload_fraction='auto'"):
        opt.add_param_group({"params": list(m.parameters())[:2], "offload": False})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("steps", [auto.MEASURED_STEPS, auto.MEASURED_STEPS + 2,
                                   1 + auto.MEASURED_STEPS + _MOVED + 1], ids=["probe", "baseline", "verify"])  # fmt: skip
def test_a_run_closed_before_the_choice_says_which_fraction_it_left(steps):
    """A new user's finding: offload_fraction='auto' over 3 steps reported 0.5, the probe's
    start, unmeasured, and said nothing (placement_choice None). Closed in the probe (or while
    fraction 0 is timed, not its choice), it now says so; closed after the choice, nothing."""
    from offloadopt.harness.train import TrainConfig
    from offloadopt.harness.train import train as train_job

    m = model()
    # auto_tolerance 10: a choice above 0, so fraction 0 is timed as a baseline
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto", auto_tolerance=10.0)  # fmt: skip
    train(m, opt, steps=steps)
    phase, before = opt.debug.auto.phase, opt.placement_choice
    if phase == "verify":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.close()
        assert opt.placement_choice == before and "kept" not in before
        return
    assert phase == {auto.MEASURED_STEPS: "probe"}.get(steps, "baseline")
    want = ("the probe's starting 0.5, unmeasured (a choice takes 4 steps" if phase == "probe"
            else "0, timed as the baseline, not the choice")  # fmt: skip
    with pytest.warns(UserWarning, match=r"^offload_fraction='auto' chose no fraction: the "
                      rf"optimizer was closed and the fraction in force is {re.escape(want)}"):  # fmt: skip
        opt.close()
    choice = opt.placement_choice
    assert choice["unmeasured"] is True and choice["fraction"] == opt.offload_fraction
    assert choice["set_by"] == "auto" and want in choice["kept"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.close()  # said once
    if phase == "probe":  # the main job refuses a run this short before it starts
        with pytest.raises(ValueError, match=rf"^--offload-fraction auto with --steps {steps}: "):
            train_job(TrainConfig(steps=steps, batch_size=2, seq_len=16, eval_batches=1,
                                  progress=False, offload_fraction="auto"))  # fmt: skip


def test_a_fraction_set_while_auto_measures_ends_it_and_says_so():
    """A fresh user's finding: set_offload_fraction() during auto's probe ended it with no
    word, and placement_choice stayed None."""
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto")  # fmt: skip
    train(m, opt, steps=2)
    assert opt.debug.auto.active and opt.placement_choice is None
    with pytest.warns(UserWarning, match="replaces offload_fraction='auto' before its choice"):
        opt.set_offload_fraction(0.25)
    assert not opt.debug.auto.active and opt.offload_fraction == 0.25
    assert opt.placement_choice["set_by"] == "set_offload_fraction"
    assert opt.placement_choice["fraction"] == 0.25
    train(m, opt, steps=2)
    assert opt.offload_fraction == 0.25  # auto does not come back


def test_where_fraction_0_cannot_be_placed_the_prediction_stands_in(monkeypatch):
    """The baseline moves the state to fraction 0 to measure its step; where that move fails
    (out of GPU memory, say) the old placement stays, the choice says why, and the chosen
    fraction is verified against fraction 0's predicted step, bitwise as ever."""
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto")  # fmt: skip
    real = type(opt.debug.relocate).set_fraction  # every move, auto's too

    def no_zero(self, fraction, by_auto=False):
        if fraction == 0.0:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return real(self, fraction, by_auto)

    monkeypatch.setattr(type(opt.debug.relocate), "set_fraction", no_zero)
    got = train(m, opt)
    choice = opt.placement_choice
    assert "out of memory" in choice["baseline_skipped"] and choice["measured_step_ms_at_0"] is None
    assert choice["measured_step_ms"] > 0 and not opt.debug.auto.active
    ref_m = model()
    want = train(ref_m, torch.optim.AdamW(ref_m.parameters(), lr=1e-2, fused=True))
    for k in want:
        assert torch.equal(got[k], want[k]), k


class _FakeClock:
    """auto's clock (offloadopt/place/auto.py's ``_Clock``, the timer seam) on a time the test
    advances: each step's period is what the test says, whatever the host does."""

    now = 0.0  # seconds

    def __init__(self, device):
        pass

    def mark(self):
        return _FakeClock.now

    def ms(self, a, b):
        return (b - a) * 1e3


def timed_train(m, opt, steps, period_ms):
    """``steps`` steps, each taking ``period_ms(fraction, since)`` on the fake clock: ``since``
    counts the steps at the fraction since auto last moved there (0: the step after the move)."""
    since, last = 0, opt.offload_fraction
    for x, y in batches(steps):
        m(x, y)[1].backward()
        _FakeClock.now += period_ms(opt.offload_fraction, since) / 1e3
        opt.step()
        opt.zero_grad()
        since, last = (
            (0, opt.offload_fraction) if opt.offload_fraction != last else (since + 1, last)
        )


def settled_auto(monkeypatch, state_dtype):
    monkeypatch.setattr(auto, "_Clock", _FakeClock)
    monkeypatch.setattr(auto.costmodel, "largest_hidden",
                        lambda m, tol, mode: costmodel.predict(m, 0.9, mode))  # fmt: skip
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto", state_dtype=state_dtype)  # fmt: skip
    return m, opt


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_the_steps_right_after_a_move_are_not_the_steady_state_it_measures(
    monkeypatch, state_dtype
):
    """Issue 46: auto's own measurement said 123.2 ms against fraction 0's 120.5, and the steady
    state after it was 135.6. Here the three steps after a move to an offloaded fraction are
    80 ms slower (pinned frees, new blocks), then every fraction steps 100 ms: the choice is
    timed in its steady state, as fraction 0's baseline is (the same settled steps), and
    stands without a correction. (Before, the unsettled steps measured 180 ms and moved it
    down.)"""
    m, opt = settled_auto(monkeypatch, state_dtype)
    timed_train(m, opt, 32, lambda f, since: 100.0 + (80.0 if f > 0 and since < 3 else 0.0))
    choice = opt.placement_choice
    assert choice["fraction"] == 0.9 and choice["corrections"] == [], choice
    assert choice["measured_step_ms_at_0"] == pytest.approx(100.0)
    assert choice["measured_step_ms"] == pytest.approx(100.0)
    assert choice["steady_step_ms"] == pytest.approx(100.0) and choice["host_moved"] is False
    assert choice["within_tolerance"] and not opt.debug.auto.active


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_a_steady_state_that_drifts_after_the_choice_is_said(monkeypatch, state_dtype):
    """The chosen fraction steps 100 ms when verified, then 150 ms (the host moved: another
    process, the page cache). auto measures it once more STEADY_AFTER steps on and, with no
    correction left, says so: a warning and placement_choice["host_moved"]. (Before, it
    ended at the verification, within its tolerance, and said nothing.)"""
    monkeypatch.setattr(auto, "CORRECTIONS", 0)
    m, opt = settled_auto(monkeypatch, state_dtype)
    with pytest.warns(UserWarning, match=r"'auto' kept fraction 0.9, but the host moved: its step measured 100.0 ms when chosen and 150.0 ms"):  # fmt: skip
        timed_train(m, opt, 32, lambda f, since: 150.0 if f > 0 and since >= 8 else 100.0)
    choice = opt.placement_choice
    assert choice["measured_step_ms"] == pytest.approx(100.0)
    assert choice["steady_step_ms"] == pytest.approx(150.0) and choice["host_moved"] is True
    assert choice["within_tolerance"] is False and not opt.debug.auto.active


def test_a_choice_of_fraction_0_is_not_warned_about_as_above_its_own_limit(monkeypatch):
    """A fresh user's finding (2 shared cores): auto chose fraction 0 from its prediction, the
    step there measured above 1.05 x fraction 0's predicted step, and it warned "kept fraction
    0 ... above the limit ... give offload_fraction a number": fraction 0 compared with itself,
    with no faster fraction to give. The limit is relative to fraction 0, so fraction 0 is
    within it whatever it measures."""
    monkeypatch.setattr(auto, "_Clock", _FakeClock)
    monkeypatch.setattr(auto.costmodel, "largest_hidden",
                        lambda m, tol, mode: costmodel.predict(m, 0.0, mode))  # fmt: skip
    m = model()
    opt = HybridAdamW(m.parameters(), lr=1e-2, min_offload_numel=1, bucket_nbytes=2**14,
                      offload_fraction="auto")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timed_train(m, opt, 32, lambda f, since: 1000.0 if f == 0 else 100.0)
    choice = opt.placement_choice
    assert choice["fraction"] == 0.0 and choice["measured_step_ms"] == pytest.approx(1000.0)
    assert choice["within_tolerance"] is True and not opt.debug.auto.active
