"""A GradScaler on the GPU (offloadopt/step/amp.py): fp16 autocast, fp32 params, a step with an inf
and one with a NaN. Backward mode with the scaler attached equals step mode bitwise with the
side streams and the worker slowed; both follow torch.optim.AdamW(fused=True) with the same
scaler (exact at fraction 0, the CPU kernel's rounding otherwise); the scales match exactly;
no pageable copy. Run on the GPU host."""

import time

import pytest
import torch

from offloadopt import HybridAdamW
from offloadopt.step.amp import found_inf

BAD = {3: float("inf"), 5: float("nan")}  # step -> the value one element of a grad gets
LR = 1e-3
# Max |HybridAdamW - torch.optim.AdamW(fused=True)| after these 8 steps (fp16 autocast, the
# model's own grads, so a rounding difference of the CPU kernel feeds back into the next
# grads): 8.53e-5 at fraction 0.5 and 2.05e-4 at fraction 1, with or without clipping (H200,
# torch 2.11, 2026-12-01); 0 at fraction 0. An element whose grad is near zero moves by up to
# lr per step whichever way its sign falls, so the bound is in units of lr.
FOLLOWS_TORCH_ATOL = 0.5 * LR


def model_of(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda()


def run(model, opt, scaler, steps=8, clip=None, opt_clips=False):
    x = torch.randn(64, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    params = list(model.parameters())
    outs, scales = [], []
    for step in range(steps):
        handle = None
        if step in BAD:
            bad = BAD[step]
            handle = params[2].register_hook(lambda g, bad=bad: g.index_fill(0, torch.tensor([7], device=g.device), bad))  # fmt: skip
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(x)
        outs.append(out.detach().float().clone())
        scaler.scale(out.float().pow(2).mean()).backward()
        if handle is not None:
            handle.remove()
        if clip is not None and not opt_clips:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    getattr(opt, "synchronize", lambda: None)()
    torch.cuda.synchronize()
    return outs, scales, [p.detach().clone() for p in params]


def slow(opt):
    def hook(kind):
        torch.cuda._sleep(20_000_000)  # ~10 ms: every copy on the side streams starts late

    for transfer in opt.debug.pipeline.transfers.values():
        transfer.side_stream_hook = hook
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.01)


@pytest.mark.parametrize("clip", [None, 1e-5])
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_attached_scaler_in_backward_mode_equals_step_mode_and_follows_torch(fraction, clip):
    scaler = lambda: torch.amp.GradScaler("cuda", init_scale=2.0**14, growth_interval=2)  # noqa: E731
    ref_model = model_of()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, fused=True)
    _, ref_scales, ref_params = run(ref_model, ref, scaler(), clip=clip)
    got = {}
    for mode in ("step", "backward"):
        model, s = model_of(), scaler()
        kw = dict(overlap="backward", wait="module", release_grads=True, grad_scaler=s) if mode == "backward" else {}  # fmt: skip
        opt = HybridAdamW(model.parameters(), lr=LR, offload_fraction=fraction,
                          bucket_nbytes=8 * 2**20, flush_denormal=False, max_grad_norm=clip,
                          **kw)  # fmt: skip
        if mode == "backward":
            opt.watch(model)
            if fraction > 0:
                slow(opt)
        got[mode] = run(model, opt, s, clip=clip, opt_clips=True)
        assert got[mode][1] == ref_scales, (mode, got[mode][1], ref_scales)
        steps = {int(opt.state[p]["step"]) for p in model.parameters()}
        assert steps == {8 - len(BAD)}, steps
        if clip is not None:
            assert clip < opt.last_grad_norm.item() < float("inf"), "the clip bites"
    for a, b in zip(got["backward"][0] + got["backward"][2], got["step"][0] + got["step"][2], strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    err = max((a - b).abs().max().item() for a, b in zip(got["step"][2], ref_params, strict=True))
    print(f"scaler, clip {clip}, fraction {fraction}: max |hybrid - torch fused| = {err:.3g}, "
          f"scales {ref_scales}")  # fmt: skip
    if fraction == 0.0:
        assert err == 0.0  # the same CUDA kernel, unscaled and clipped in torch's order
    assert err <= FOLLOWS_TORCH_ATOL


def test_found_inf_sees_a_nan_and_an_inf_on_the_gpu():
    device = torch.device("cuda")
    ok = [torch.ones(1000, device=device), torch.ones(10, device=device, dtype=torch.bfloat16)]
    assert found_inf(ok, device).item() == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        grads = [t.clone() for t in ok]
        grads[0][999] = bad
        assert found_inf(grads, device).item() == 1.0, bad


def test_no_pageable_copy_with_an_attached_scaler():
    model, s = model_of(), torch.amp.GradScaler("cuda")
    opt = HybridAdamW(model.parameters(), offload_fraction=1.0, overlap="backward",
                      wait="module", grad_scaler=s)  # fmt: skip
    opt.watch(model)
    run(model, opt, s, steps=2)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        run(model, opt, s, steps=1)
    names = [e.name for e in prof.events() if e.name.startswith("Memcpy")]
    assert not [n for n in names if "Pageable" in n], names
    assert any("Device -> Pinned" in n for n in names)
