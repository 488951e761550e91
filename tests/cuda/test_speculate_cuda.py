"""speculate=True on the GPU (offloadopt/step/speculate.py's note): steps that clip, steps that
do not, inf and NaN steps under a GradScaler, mixed in one run, bitwise the run without
speculation, with the side streams and the worker slowed (a redo must wait for the
speculative H2D before it restores the host master). Run on the GPU host."""

import time

import pytest
import torch

from offloadopt import HybridAdamW
from offloadopt.step.speculate import Speculation


@pytest.fixture(autouse=True)
def every_step_speculates(monkeypatch):
    """These tests check the speculative path on steps that clip in a row: no back-off, no
    holding back after a step that clipped (MAX_HOLD 0 turns both off; tests/test_speculate.py
    checks them on the CPU, test_a_step_after_one_that_clipped_is_held_back_on_the_gpu here)."""
    monkeypatch.setattr(Speculation, "MAX_HOLD", 0)


BAD = {3: float("inf"), 5: float("nan")}  # step -> the value one element of a grad gets
FACTORS = [1, 1000, 1, 1, 1000, 1000, 1, 1]  # the loss's factor: 1000 makes the clip bite


def model_of(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda().to(dtype)


def slow(opt):
    def hook(kind):
        torch.cuda._sleep(20_000_000)  # ~10 ms: every copy on the side streams starts late

    for transfer in opt.debug.pipeline.transfers.values():
        transfer.side_stream_hook = hook
    opt.debug.pipeline.worker_hook = lambda bucket: time.sleep(0.005)


def run(spec, dtype, scaler, state_dtype, steps=8):
    model = model_of(dtype)
    s = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2) if scaler else None
    opt = HybridAdamW(model.parameters(), lr=1e-3, offload_fraction=0.75, overlap="backward",
                      wait="module", max_grad_norm=1.0, grad_scaler=s, speculate=spec,
                      state_dtype=state_dtype, bucket_nbytes=2**20)  # fmt: skip
    opt.watch(model)
    x = torch.randn(32, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    params = list(model.parameters())
    losses = []
    for step in range(steps):
        if step == 1:
            slow(opt)
        handle = None
        if scaler and step in BAD:
            bad = BAD[step]
            handle = params[2].register_hook(lambda g, bad=bad: g.index_fill(0, torch.tensor([7], device=g.device), bad))  # fmt: skip
        loss = model(x.to(dtype)).float().pow(2).mean() * FACTORS[step]
        losses.append(loss.detach().clone())
        (s.scale(loss) if s else loss).backward()
        if handle is not None:
            handle.remove()
        if s:
            s.step(opt)
            s.update()
        else:
            opt.step()
        opt.zero_grad()
    opt.synchronize()
    torch.cuda.synchronize()
    counts = opt.speculation
    opt.close()
    return losses + [p.detach().clone() for p in params], counts


# torch's GradScaler refuses bf16 grads ("not implemented for 'BFloat16'"): bf16 runs clip only
CASES = [(torch.float32, "fp32", False), (torch.float32, "fp32", True),
         (torch.float32, "int8", True), (torch.bfloat16, "fp32", False),
         (torch.bfloat16, "int8", False)]  # fmt: skip


@pytest.mark.parametrize("dtype, state_dtype, scaler", CASES)
def test_speculative_runs_are_bitwise_the_non_speculative_ones_on_the_gpu(
    dtype, state_dtype, scaler
):
    want, _ = run(False, dtype, scaler, state_dtype)
    got, counts = run(True, dtype, scaler, state_dtype)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counts["steps"] == 8 and counts["redone_clip"] >= 1, counts
    if scaler:
        assert counts["redone_inf"] == 2, counts
    print(f"{dtype} {state_dtype} scaler {scaler}: {counts}")


def test_a_step_after_one_that_clipped_is_held_back_on_the_gpu(monkeypatch):
    """FOLLOW_CLIP on CUDA: a held-back step's clip coefficient reaches the host by a copy
    without a sync (an event), read by the next step; FACTORS clip at steps 1, 4 and 5, so
    steps 2, 5 and 6 follow a step that clipped (step 1 speculates, is redone, and starts a
    back-off that step 2 also serves). The bits are the non-speculative run's."""
    monkeypatch.setattr(Speculation, "MAX_HOLD", 8)
    want, _ = run(False, torch.float32, False, "fp32")
    got, counts = run(True, torch.float32, False, "fp32")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counts["held_back"] >= 2 and counts["redone_clip"] <= 2, counts
    print(f"follow clip: {counts}")
