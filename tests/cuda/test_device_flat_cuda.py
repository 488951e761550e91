"""Device-resident compressed state in flat buffers on the GPU (offloadopt/step/device_flat.py):
bitwise the per-tensor device pass through the optimizer, eager, compiled (the flat pass writes
into the buffers from its own compiled graph; the per-tensor path compiled too) and as Triton's
kernel (CUDA's default, kernels/flat_triton.py: the eager pass's bits, so against the eager
per-tensor path), with params cut between passes, a clip factor under a GradScaler, and moves
between fractions; the Triton kernel bitwise the eager flat pass in every mode and option; and
no host sync in a step of the flat pass. Run on the GPU host."""

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


# the per-tensor path's mode whose bits each flat mode gives: Triton's kernel, the eager pass's
ORACLE = {"eager": "eager", "compiled": "compiled", "triton": "eager"}


def run(monkeypatch, on: bool, setting: str, how: str = "triton", **kw):
    """A run of the flat pass (``on``, as ``how`` says) or of the per-tensor path (as
    ``ORACLE[how]`` says)."""
    from test_device_flat import build, train

    monkeypatch.setenv("OFFLOADOPT_DEVICE_FLAT", "1" if on else "0")
    monkeypatch.setenv("OFFLOADOPT_DEVICE_STEP", how if on else ORACLE[how])
    # torch's CUDA unscale refuses bf16 grads: under a GradScaler, every param in fp32
    params = cuda_params(fp32="scaler" in kw)
    opt = build(params, setting, **kw.pop("build", {}))
    train(params, opt, kw.pop("steps", 4), **kw)
    torch.cuda.synchronize()
    assert bool(opt.debug.updater.flat.where) == on
    return params, opt


@pytest.mark.parametrize("chunk", [1024, 2**26])
@pytest.mark.parametrize("step_mode", ["triton", "compiled", "eager"])
@pytest.mark.parametrize("setting", ["int8", "sr8", "bf16"])
def test_the_flat_pass_is_bitwise_the_per_tensor_pass_on_cuda(monkeypatch, setting, step_mode,
                                                               chunk):  # fmt: skip
    from test_device_flat import same

    monkeypatch.setitem(device_flat.FLAT_CHUNK, "cuda", chunk)
    old = run(monkeypatch, False, setting, step_mode)
    new = run(monkeypatch, True, setting, step_mode)
    same(*old, *new, f"{setting}, {step_mode}, passes of {chunk}")


def test_triton_is_the_default_flat_pass_on_cuda(monkeypatch):
    from offloadopt.kernels import adam, flat_triton

    monkeypatch.delenv("OFFLOADOPT_DEVICE_STEP", raising=False)
    assert flat_triton.available(torch.device("cuda"))
    assert adam.device_step_mode(torch.device("cuda")) == "triton"


@pytest.mark.parametrize("moments,master", [(m, ma) for m in (0, 1, 2)
                                            for ma in ("fp32", "fp32+w", "bf16-sr")])  # fmt: skip
@pytest.mark.parametrize("option", ["defaults", "maximize", "L2", "a loss scale",
                                    "scalars by pointer", "lerp weight 0.7, addcmul value 1",
                                    "fp32 grads, device_flat's counters"])  # fmt: skip
def test_the_triton_kernel_is_bitwise_the_eager_flat_pass_on_cuda(moments, master, option):
    """tests/test_flat_triton.py's passes on the GPU, 3 in a row: no sqrt to correct here
    (torch's CUDA sqrt is IEEE's), CUDA's own forms (its reciprocal of a host scalar)."""
    from test_flat_triton import OPTIONS, both, kwargs, make, same

    opts = dict(OPTIONS.get(option, {}), cuda_div=True)
    tensors = opts.pop("tensors", False)
    made = ("g_fp32", "device_flat_counters", "beta1", "beta2", "cuda_div")
    bufs = make(moments, master, **{k: v for k, v in opts.items() if k in made})
    bufs = [None if t is None else t.cuda() for t in bufs]
    kw = kwargs(moments, master, **{k: v for k, v in opts.items() if k not in made[:2]})
    kernel_kw = None
    if tensors:
        kernel_kw = dict(kw, grad_scale=torch.tensor(kw["grad_scale"], device="cuda"),
                         wd_factor=torch.tensor(kw["wd_factor"], device="cuda"))  # fmt: skip
    a, b = both(bufs, kw, passes=3, kernel_kw=kernel_kw)
    torch.cuda.synchronize()
    same([None if t is None else t.cpu() for t in a], [None if t is None else t.cpu() for t in b],
         f"cuda: moments {moments}, {master}, {option}")  # fmt: skip


# fp32 params (their own masters): sr8's bf16-sr would have no param to act on
@pytest.mark.parametrize("setting", ["int8", "bf16"])
def test_clipped_under_a_grad_scaler_on_cuda(monkeypatch, setting):
    from test_device_flat import same

    for how in ("triton", "compiled"):
        runs = []
        for on in (False, True):
            scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
            scaler.scale(torch.ones((), device="cuda"))
            runs.append(run(monkeypatch, on, setting, how, steps=6, scaler=scaler, bad={2},
                            build=dict(max_grad_norm=0.5)))  # fmt: skip
        same(*runs[0], *runs[1], f"{setting}, {how}, clipped under a GradScaler")


def test_moves_between_fractions_on_cuda(monkeypatch):
    from test_device_flat import same

    moves = {2: 0.5, 4: 0.0}
    old = run(monkeypatch, False, "int8", steps=6, moves=moves)
    new = run(monkeypatch, True, "int8", steps=6, moves=moves)
    same(*old, *new, "moved 0 -> 0.5 -> 0")


@pytest.mark.parametrize("how", ["triton", "compiled"])
def test_a_flat_step_makes_no_host_sync(monkeypatch, how):
    params, opt = run(monkeypatch, True, "int8", how, steps=3)
    flat = opt.debug.updater.flat
    group = opt.param_groups[0]
    hyper = opt.rule.freeze(group)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing op raises
    try:  # under no_grad, as step() runs it (the weights are written in place)
        with torch.no_grad():
            done, rest = flat.update(hyper, list(group["params"]), None, None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not rest and len(done) == len(group["params"])
