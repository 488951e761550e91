"""Device-resident compressed state in flat buffers on the GPU (offloadopt/step/device_flat.py):
bitwise the per-tensor device pass through the optimizer, compiled (CUDA's default: the flat
pass writes into the buffers from its own compiled graph) and eager, with params cut between
passes, a clip factor under a GradScaler, and moves between fractions; and no host sync in a
step of the flat pass. Run on the GPU host."""

import pytest
import torch

from offloadopt.step import device_flat

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tests/cuda run on the GPU host)")


def cuda_params(fp32: bool = False):
    from test_device_flat import make_params

    made = [p.float() if fp32 else p for p in make_params()]
    return [torch.nn.Parameter(p.detach().cuda()) for p in made]


def run(monkeypatch, on: bool, setting: str, **kw):
    from test_device_flat import build, train

    monkeypatch.setenv("OFFLOADOPT_DEVICE_FLAT", "1" if on else "0")
    # torch's CUDA unscale refuses bf16 grads: under a GradScaler, every param in fp32
    params = cuda_params(fp32="scaler" in kw)
    opt = build(params, setting, **kw.pop("build", {}))
    train(params, opt, kw.pop("steps", 4), **kw)
    torch.cuda.synchronize()
    assert bool(opt.debug.updater.flat.where) == on
    return params, opt


@pytest.mark.parametrize("chunk", [1024, 2**26])
@pytest.mark.parametrize("step_mode", ["compiled", "eager"])
@pytest.mark.parametrize("setting", ["int8", "sr8", "bf16"])
def test_the_flat_pass_is_bitwise_the_per_tensor_pass_on_cuda(monkeypatch, setting, step_mode,
                                                               chunk):  # fmt: skip
    from test_device_flat import same

    monkeypatch.setenv("OFFLOADOPT_DEVICE_STEP", step_mode)
    monkeypatch.setitem(device_flat.FLAT_CHUNK, "cuda", chunk)
    old = run(monkeypatch, False, setting)
    new = run(monkeypatch, True, setting)
    same(*old, *new, f"{setting}, {step_mode}, passes of {chunk}")


# fp32 params (their own masters): sr8's bf16-sr would have no param to act on
@pytest.mark.parametrize("setting", ["int8", "bf16"])
def test_clipped_under_a_grad_scaler_on_cuda(monkeypatch, setting):
    from test_device_flat import same

    runs = []
    for on in (False, True):
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
        scaler.scale(torch.ones((), device="cuda"))
        runs.append(run(monkeypatch, on, setting, steps=6, scaler=scaler, bad={2},
                        build=dict(max_grad_norm=0.5)))  # fmt: skip
    same(*runs[0], *runs[1], f"{setting}, clipped under a GradScaler")


def test_moves_between_fractions_on_cuda(monkeypatch):
    from test_device_flat import same

    moves = {2: 0.5, 4: 0.0}
    old = run(monkeypatch, False, "int8", steps=6, moves=moves)
    new = run(monkeypatch, True, "int8", steps=6, moves=moves)
    same(*old, *new, "moved 0 -> 0.5 -> 0")


def test_a_flat_step_makes_no_host_sync(monkeypatch):
    params, opt = run(monkeypatch, True, "int8", steps=3)
    flat = opt.debug.updater.flat
    group = opt.param_groups[0]
    hyper = opt.rule.freeze(group)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing op raises
    try:
        done, rest = flat.update(hyper, list(group["params"]), None, None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not rest and len(done) == len(group["params"])
