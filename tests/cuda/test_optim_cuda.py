"""HybridAdamW on the GPU: pinned invariant, races, parity, memory. Run on the GPU host."""

import io
import time

import pytest
import torch

from offloadopt import HybridAdamW

FRACTIONS = (0.0, 0.5, 1.0)
# Max |HybridAdamW (torch's CPU fused kernel) - torch.optim.AdamW(fused=True) on CUDA| after 20
# steps of 4 x (4096 x 1024) fp32 params ~ N(0, 1), lr 1e-3, the same seeded grads: 9.54e-6 at
# fractions 0.5 and 1 (H200 host, torch 2.11, 2026-11-30; the two kernels round differently;
# deterministic, so the same every run). test_parity_with_torch_fused_adamw_on_the_gpu prints it.
GPU_VS_CPU_KERNEL_ATOL = 1e-5


class Lockstep:
    """The oracle for races: the same CPU kernel on fp32 masters, run synchronously (grads to the
    host and weights back with blocking copies), so any race in HybridAdamW shows as a
    difference at all."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        self.params = list(params)
        self.masters = [p.detach().float().cpu() for p in self.params]
        self.exp_avgs = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sqs = [torch.zeros_like(m) for m in self.masters]
        self.steps = [torch.zeros(()) for _ in self.masters]
        self.hp = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self):
        grads = [p.grad.float().cpu() for p in self.params]  # blocking D2H
        torch._foreach_add_(self.steps, 1)
        torch._fused_adamw_(self.masters, grads, self.exp_avgs, self.exp_avg_sqs, [], self.steps,
                            amsgrad=False, maximize=False, **self.hp)  # fmt: skip
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m.to(p.device).to(p.dtype))  # blocking H2D, cast on the GPU as HybridAdamW does

    def zero_grad(self):
        for p in self.params:
            p.grad = None


class DelayedLockstep(Lockstep):
    """The delayed update's oracle (tests/oracle.py's DelayedReference, on the GPU's params):
    the same synchronous CPU kernel, the new weights copied in at the next step."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.pending = []

    @torch.no_grad()
    def step(self):
        grads = [p.grad.float().cpu() for p in self.params]  # blocking D2H
        for p, w in self.pending:
            p.copy_(w)
        torch._foreach_add_(self.steps, 1)
        torch._fused_adamw_(self.masters, grads, self.exp_avgs, self.exp_avg_sqs, [], self.steps,
                            amsgrad=False, maximize=False, **self.hp)  # fmt: skip
        self.pending = [(p, m.to(p.device).to(p.dtype)) for p, m in zip(self.params, self.masters, strict=True)]  # fmt: skip


def big_cheap_model(dtype=torch.bfloat16, seed=0):
    """C03: 4 layers of 4096 x 4096: a cheap forward (batch 1) and big copies."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda().to(dtype)


def train(model, opt, steps=20, before_step=None):
    x = torch.randn(1, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    outs = []
    for _ in range(steps):
        out = model(x.to(next(model.parameters()).dtype))  # issued right after the last step()
        outs.append(out.detach().float().clone())
        out.float().pow(2).mean().backward()
        if before_step is not None:
            before_step(model)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return outs


def assert_same_outputs(outs, ref_outs):
    for i, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        torch.testing.assert_close(o, r, rtol=0, atol=0, msg=lambda m, i=i: f"step {i}: {m}")


def sleep_on(kind_wanted, cycles=20_000_000):
    def hook(kind):
        if kind in kind_wanted:
            torch.cuda._sleep(cycles)  # ~10 ms: the copies on this side stream start late

    return hook


@pytest.mark.parametrize(
    "hook",
    [None, ("d2h",), ("h2d",), ("d2h", "h2d"), ("worker",)],
    ids=["plain", "slow-d2h", "slow-h2d", "slow-both", "slow-worker"],
)
def test_c03_next_forward_never_reads_weights_before_their_h2d(hook):
    ref_model = big_cheap_model()
    ref_outs = train(ref_model, Lockstep(ref_model.parameters()))
    model = big_cheap_model()
    # flush_denormal=False: the lockstep oracle runs its kernel on the training thread, without
    # flush-to-zero; the same setting on both sides (normal-range data either way).
    opt = HybridAdamW(
        model.parameters(), offload_fraction=1.0, bucket_nbytes=16 * 2**20, flush_denormal=False
    )
    assert len(opt.buckets) > 2  # several buckets: the pipeline really overlaps
    for transfer in opt.debug.pipeline.transfers.values():
        transfer.side_stream_hook = sleep_on(hook) if hook else None
    if hook and "worker" in hook:
        opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(
            0.01
        )  # the CPU update comes late
    assert_same_outputs(train(model, opt), ref_outs)


def test_replaced_staging_is_unpinned_at_once_and_not_counted():
    model = big_cheap_model()
    opt = HybridAdamW(model[0].parameters(), offload_fraction=1.0, bucket_nbytes=2**30)
    old = opt.debug.pipeline.transfers[torch.device("cuda", torch.cuda.current_device())]
    old_slots = old.host_slots()
    opt.add_param_group({"params": list(model[1:].parameters())})  # larger buckets: new staging
    new = opt.debug.pipeline.transfers[old.device]
    assert new is not old and new.nbytes > old.nbytes
    assert not any(t.is_pinned() for t in old_slots)
    crossing = sum(t.numel() * t.element_size() for _, t in opt.crossing_host_tensors())
    assert opt.pinned_nbytes == crossing
    train(model, opt, steps=2)


def test_grads_edited_on_a_busy_compute_stream_reach_the_update():
    def scale(model):
        torch.cuda._sleep(20_000_000)  # the compute stream is still busy when step() starts
        for p in model.parameters():
            p.grad.mul_(0.5)  # in place, after backward

    ref_model = big_cheap_model()
    ref_outs = train(ref_model, Lockstep(ref_model.parameters()), steps=5, before_step=scale)
    model = big_cheap_model()
    opt = HybridAdamW(
        model.parameters(), offload_fraction=1.0, bucket_nbytes=16 * 2**20, flush_denormal=False
    )
    assert_same_outputs(train(model, opt, steps=5, before_step=scale), ref_outs)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_parity_with_torch_fused_adamw_on_the_gpu(fraction):
    """Same seeded grads every step (no training feedback, which would amplify any rounding
    difference): what is left is the CPU kernel against the CUDA one."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(4096, 1024, generator=gen) for _ in range(4)]
    ref_params = [torch.nn.Parameter(t.cuda()) for t in init]
    params = [torch.nn.Parameter(t.cuda()) for t in init]
    ref = torch.optim.AdamW(ref_params, lr=1e-3, fused=True)
    opt = HybridAdamW(params, lr=1e-3, offload_fraction=fraction)
    assert sum(opt.is_offloaded(p) for p in params) == {0.0: 0, 0.5: 2, 1.0: 4}[fraction]
    for _ in range(20):
        grads = [torch.randn(t.shape, generator=gen).cuda() for t in init]
        for p, q, g in zip(ref_params, params, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    err = max((p - q).abs().max().item() for p, q in zip(params, ref_params, strict=True))
    print(f"fraction {fraction}: max |hybrid - torch fused on GPU| = {err:.3g}")
    if fraction == 0.0:
        assert err == 0.0  # the same CUDA kernel on the same inputs
    assert err <= GPU_VS_CPU_KERNEL_ATOL


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_c01_every_crossing_host_buffer_is_pinned_and_no_pageable_copy(fraction):
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=fraction, bucket_nbytes=16 * 2**20)
    crossing = opt.crossing_host_tensors()
    assert (len(crossing) > 0) == (fraction > 0)
    assert all(t.is_pinned() for _, t in crossing)
    train(model, opt, steps=2)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        train(model, opt, steps=1)
    names = [e.name for e in prof.events() if e.name.startswith("Memcpy")]
    assert not [n for n in names if "Pageable" in n], names
    if fraction > 0:
        assert any("Pinned -> Device" in n for n in names) and any(
            "Device -> Pinned" in n for n in names
        )


def test_pin_memory_false_warns_and_takes_the_pageable_path():
    model = big_cheap_model()
    with pytest.warns(UserWarning, match="pin_memory=False"):
        opt = HybridAdamW(model.parameters(), offload_fraction=1.0, pin_memory=False)
    train(model, opt, steps=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        train(model, opt, steps=1)
    assert any("Pageable -> Device" in e.name for e in prof.events())


def test_c02_pinning_survives_a_load_from_torch_load():
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0)
    train(model, opt, steps=2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)  # pageable tensors
    ptrs = [t.data_ptr() for _, t in opt.crossing_host_tensors()]
    state_ptrs = {
        k: (s["master"].data_ptr(), s["exp_avg"].data_ptr()) for k, s in opt.state.items()
    }
    opt.load_state_dict(sd)
    assert [t.data_ptr() for _, t in opt.crossing_host_tensors()] == ptrs
    assert all(t.is_pinned() for _, t in opt.crossing_host_tensors())
    assert {
        k: (s["master"].data_ptr(), s["exp_avg"].data_ptr()) for k, s in opt.state.items()
    } == state_ptrs
    for i, p in enumerate(model.parameters()):
        torch.testing.assert_close(opt.state[p]["master"], sd["state"][i]["master"], rtol=0, atol=0)
        assert opt.state[p]["master"].is_pinned() and not opt.state[p]["exp_avg"].is_cuda


def test_c12_added_group_is_pinned():
    model = big_cheap_model()
    opt = HybridAdamW(model[:2].parameters(), offload_fraction=1.0)
    opt.add_param_group({"params": list(model[2:].parameters()), "lr": 1e-2})
    assert all(t.is_pinned() for _, t in opt.crossing_host_tensors())
    assert all(opt.is_offloaded(p) for p in model[2:].parameters())
    train(model, opt, steps=2)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_gpu_memory_is_flat_across_steps(fraction):
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=fraction)
    train(model, opt, steps=3)
    allocated = torch.cuda.memory_allocated()
    train(model, opt, steps=10)
    assert torch.cuda.memory_allocated() == allocated


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_c04_c05_accumulation_and_clipping_on_the_gpu(fraction):
    w = torch.nn.Parameter(torch.zeros(2, device="cuda"))
    opt = HybridAdamW([w], offload_fraction=fraction, min_offload_numel=1)
    (w * torch.tensor([3.0, 0.0], device="cuda")).sum().backward()
    (w * torch.tensor([0.0, 4.0], device="cuda")).sum().backward()
    assert torch.nn.utils.clip_grad_norm_([w], 1.0).item() == 5.0
    ref_w = torch.nn.Parameter(torch.zeros(2))
    ref_w.grad = w.grad.cpu()
    ref = torch.optim.AdamW([ref_w], fused=True)
    opt.step()
    ref.step()
    torch.testing.assert_close(
        w.grad.cpu(), torch.tensor([0.5999999, 0.7999998]), rtol=0, atol=1e-7
    )
    # Offloaded: the very same CPU kernel, bitwise. On the device: the CUDA kernel may round
    # the moment update differently in the last place.
    atol = 0 if fraction > 0 else 1e-7
    torch.testing.assert_close(
        opt.state[w]["exp_avg"].cpu(), ref.state[ref_w]["exp_avg"], rtol=0, atol=atol
    )
    torch.testing.assert_close(w.detach().cpu(), ref_w.detach(), rtol=0, atol=atol)


def test_stats_report_bytes_and_times():
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0)
    train(model, opt, steps=2)
    s = opt.stats
    n = sum(p.numel() for p in model.parameters())
    assert s["d2h_nbytes"] == s["h2d_nbytes"] == 4 * n
    assert s["cpu_update_ms"] > 0 and s["h2d_ms"] > 0 and s["d2h_ms"] > 0
    assert opt.pinned_nbytes >= 4 * n


def test_the_copies_events_stay_few_when_stats_is_never_read():
    """A review's finding: each bucket's copies kept two CUDA timing events per direction
    until ``opt.stats`` was read; 60 steps of 32 buckets without a read held 7,680. The
    completed ones are now folded into sums as they come (tests/test_transfer.py)."""
    from offloadopt.link.times import FOLD_AT

    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, bucket_nbytes=8 * 2**20)
    train(model, opt, steps=60)
    tr = next(iter(opt.debug.pipeline.transfers.values()))
    buckets = len(opt.buckets)
    assert buckets >= 8
    assert len(tr.timing) <= FOLD_AT + 2 * buckets, len(tr.timing)
    s = opt.stats  # the sums of every copy since the first step
    assert tr.collect_link()["d2h_ms"] == (0.0, 0)  # read: nothing left
    assert s["d2h_ms"] > 0 and s["h2d_ms"] > 0
    opt.close()


OVERLAP_MODES = {
    "backward": dict(overlap="backward", grads_final=True),
    "backward-module": dict(overlap="backward", grads_final=True, wait="module"),
    "backward-release": dict(overlap="backward", grads_final=True, release_grads=True),
    "delayed": dict(overlap="delayed"),
}


@pytest.mark.parametrize("mode", list(OVERLAP_MODES))
@pytest.mark.parametrize(
    "hook", [None, ("d2h", "h2d"), ("worker",)], ids=["plain", "slow-copies", "slow-worker"]
)
def test_overlap_modes_never_read_weights_before_their_h2d(mode, hook):
    """Backward mode starts D2H, updates and H2D during backward; the next forward (issued at
    once) must still see exactly the lockstep oracle's weights."""
    ref_model = big_cheap_model()
    oracle = DelayedLockstep if mode == "delayed" else Lockstep
    ref_outs = train(ref_model, oracle(ref_model.parameters()))
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, bucket_nbytes=16 * 2**20,
                      flush_denormal=False, **OVERLAP_MODES[mode])  # fmt: skip
    if opt.wait == "module":
        opt.watch(model)
    for transfer in opt.debug.pipeline.transfers.values():
        transfer.side_stream_hook = sleep_on(hook) if hook and "worker" not in hook else None
    if hook and "worker" in hook:
        opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.01)
    assert_same_outputs(train(model, opt), ref_outs)
    opt.synchronize()


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_clipping_in_backward_mode_equals_step_mode_bitwise_on_the_gpu(fraction):
    outs = {}
    for mode in ("step", "backward"):
        model = big_cheap_model()
        opt = HybridAdamW(model.parameters(), offload_fraction=fraction, max_grad_norm=0.5,
                          overlap=mode, wait="module" if mode == "backward" else "step")  # fmt: skip
        if opt.wait == "module":
            opt.watch(model)
        outs[mode] = train(model, opt, steps=6)
        opt.synchronize()
        assert opt.last_grad_norm is not None
    assert_same_outputs(outs["backward"], outs["step"])


@pytest.mark.parametrize("mode", list(OVERLAP_MODES))
def test_no_pageable_copy_in_the_overlap_modes(mode):
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, **OVERLAP_MODES[mode])
    if opt.wait == "module":
        opt.watch(model)
    train(model, opt, steps=2)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        train(model, opt, steps=1)
        opt.synchronize()
    names = [e.name for e in prof.events() if e.name.startswith("Memcpy")]
    assert not [n for n in names if "Pageable" in n], names
    assert any("Device -> Pinned" in n for n in names)


def test_release_grads_frees_the_offloaded_grads_on_the_gpu():
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, **OVERLAP_MODES["backward-release"])
    train(model, opt, steps=2)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    assert all(p.grad is None for p in model.parameters())


def test_delayed_frees_the_taken_grads_and_a_watched_state_dict_sees_the_new_weights():
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, overlap="delayed")
    opt.watch(model)
    train(model, opt, steps=3)
    assert all(p.grad is None for p in model.parameters())  # taken by the update
    weights = model.state_dict()  # copies the update in flight in first
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        assert torch.equal(sd["state"][i]["master"].to(p.dtype), weights[list(weights)[i]].cpu())
    opt.close()


@pytest.mark.parametrize("how", ["watch", "synchronize"])
@pytest.mark.parametrize(
    "hook", [("d2h", "h2d"), ("worker",)], ids=["slow-copies", "slow-worker"]
)  # fmt: skip
def test_a_read_between_backward_and_step_waits_for_the_started_updates_on_the_gpu(how, hook):
    """Declared backward mode: the updates start during backward and write the params until
    step(). An evaluation forward between backward and step() of a watched model (or after
    opt.synchronize()) reads whole new weights: every param is offloaded here, so they are the
    lockstep oracle's weights after its step (tests/test_overlap.py has the CPU side)."""
    x = torch.randn(1, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    ref_model = big_cheap_model()
    ref = Lockstep(ref_model.parameters())
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, bucket_nbytes=16 * 2**20,
                      flush_denormal=False, **OVERLAP_MODES["backward"])  # fmt: skip
    if how == "watch":
        opt.watch(model)
    for transfer in opt.debug.pipeline.transfers.values():
        transfer.side_stream_hook = sleep_on(hook) if "worker" not in hook else None
    if "worker" in hook:
        opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.01)
    got, want = [], []
    for _ in range(6):
        for m, o in ((ref_model, ref), (model, opt)):
            m(x.bfloat16()).float().pow(2).mean().backward()
            if o is opt:
                if how == "synchronize":
                    opt.synchronize()
                with torch.no_grad():
                    got.append(model(x.bfloat16()).float())  # issued at once, no host sync
            o.step()
            o.zero_grad()
        with torch.no_grad():
            want.append(ref_model(x.bfloat16()).float())
    assert_same_outputs(got, want)
    opt.close()


def test_a_grad_zeroed_in_place_after_a_module_wait_step_is_an_error_on_the_gpu():
    """wait="module": step() returns before the D2H copies have read the grads; zeroing them
    in place then is an error naming the params (tests/test_overlap.py has the CPU side),
    while opt.zero_grad(set_to_none=False), which waits first, trains as the oracle does."""
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, bucket_nbytes=16 * 2**20,
                      wait="module")  # fmt: skip
    opt.watch(model)
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.01)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    opt.step()
    model.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match="changed in place after step"):
        model(x)
    opt.discard_failed_step()
    opt.close()
    ref_model = big_cheap_model()
    ref_outs = train(ref_model, Lockstep(ref_model.parameters()), steps=4)
    model = big_cheap_model()
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, bucket_nbytes=16 * 2**20,
                      wait="module", flush_denormal=False)  # fmt: skip
    opt.watch(model)
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.01)
    opt.zero_grad = lambda set_to_none=True, z=opt.zero_grad: z(set_to_none=False)  # in place
    assert_same_outputs(train(model, opt, steps=4), ref_outs)
    opt.close()
